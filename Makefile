# consul-resolver-operator. `make test` is what CI runs (.ci/run).
CARGO ?= cargo

.PHONY: build release test check e2e unit cluster-selftest e2e-deps image image-deps crds fmt lint demo bench-operator bench-scale bench-tenants bench-soak bench-cost bench-peers

build:
	$(CARGO) build --workspace --all-targets

release:
	$(CARGO) build --release --bin consul-resolver-operator

# Everything CI runs: the fast checks, then the end-to-end suite.
test: check e2e

# The inner loop (under a minute on a warm build): formatting, lints and crate boundaries,
# the unit tests of every crate, and the crates' own integration tests (the snapshot
# schema, the Consul simulator, the xDS server driven by a gRPC client).
check: lint unit
	$(CARGO) test -p consul-resolver-core -p consul-sim -p consul-resolver-xds --test '*'

unit:
	$(CARGO) test --workspace --lib --bins

# The end-to-end suite against a real local control plane (each test binary starts its own
# etcd + kube-apiserver through e2e/cluster.sh, and runs the operator as its own process),
# then the control plane's self-test.
e2e: cluster-selftest
	$(CARGO) test -p e2e --test '*'

# Proves the control plane itself: CRs, status subresource, watch, RBAC, teardown.
cluster-selftest:
	bash e2e/cluster-selftest.sh

# Debian packages and the cached kube-apiserver the e2e suite needs (built once, ~8 min).
e2e-deps:
	bash e2e/cluster.sh build

# The operator at scale (10,000 Mappings, 1,000 Consul services) against the local control
# plane and the simulator; results in docs/benchmarks.md. Not part of `make test`.
bench-operator:
	$(CARGO) run --release -p e2e --bin operator-bench

# 50,000 Mappings, 5,000 Consul services x 15 instances, held to the scale targets; then
# twice that (100,000 Mappings, 10,000 x 15), held to the doubled profile's, over plain
# HTTP/1.1 and over TLS (HTTP/2: a blocking query per service, as docs/consul.md says to
# reach a Consul this large).
bench-scale:
	BENCH_PROFILE=scale $(CARGO) run --release -p e2e --bin operator-bench
	BENCH_PROFILE=double $(CARGO) run --release -p e2e --bin operator-bench
	BENCH_PROFILE=double BENCH_CONSUL_TLS=1 $(CARGO) run --release -p e2e --bin operator-bench

# Many tenants: 10,000 Kubernetes Services over 200 namespaces beside the default Consul
# side, one operator over the cluster, held to the endpoints watch budget.
bench-tenants:
	BENCH_PROFILE=tenants $(CARGO) run --release -p e2e --bin operator-bench

# Soak: 10 minutes of steady changes (port changes, health flips, Mapping churn) at the
# default size; memory, sockets and tasks after warm-up, every change in the final snapshot.
bench-soak:
	BENCH_SOAK_SECS=$${BENCH_SOAK_SECS:-600} BENCH_MODES=$${BENCH_MODES:-100} \
		$(CARGO) run --release -p e2e --bin operator-bench

# A health flip's way to each consumer, the operator beside a peer: a real Consul agent,
# Traefik's consulCatalog provider (polling, then watch=true), the operator's /snapshot and
# its export's EndpointSlices; min/median/p90/max per consumer. Then the traffic level: the
# same flips through a real Envoy fed by the operator over xDS and through Traefik, to real
# backends, request by request. Results in docs/benchmarks.md.
bench-peers:
	bash scripts/real-parts.sh consul
	bash scripts/real-parts.sh traefik
	bash scripts/real-parts.sh envoy
	$(CARGO) run --release -p e2e --bin peer-bench

# Cost table: 2,500 / 10,000 / 50,000 Mappings with 1 / 1 / 15 instances per service.
bench-cost:
	BENCH_SIZES=$${BENCH_SIZES:-250x1,1000x1,5000x15} BENCH_MAPPINGS_PER_SERVICE=$${BENCH_MAPPINGS_PER_SERVICE:-10} \
		$(CARGO) run --release -p e2e --bin operator-bench

# The container image (Containerfile): the binary as a static release build (cached under
# target/<triple>/release), CA certificates and a non-root user, FROM scratch, built by
# podman (or buildah). Named consul-resolver-operator:VERSION, as manifests/deployment.yaml
# runs it; IMAGE=name:tag overrides. e2e/tests/image.rs builds and checks it.
image:
	bash image/build.sh build

# podman and runc from Debian (.ci/run installs them, so the image test runs in CI).
image-deps:
	bash image/build.sh deps

# Regenerate the committed CRDs from the Rust types (a unit test fails on drift): crds/ with
# the CEL validation rules (Kubernetes 1.25+), crds/pre-1.25/ without them (older servers).
crds:
	$(CARGO) run --quiet --bin consul-resolver-operator -- crd consulresolver > crds/consulresolver.yaml
	$(CARGO) run --quiet --bin consul-resolver-operator -- crd consulservice > crds/consulservice.yaml
	$(CARGO) run --quiet --bin consul-resolver-operator -- crd consulresolver --without-validation-rules > crds/pre-1.25/consulresolver.yaml
	$(CARGO) run --quiet --bin consul-resolver-operator -- crd consulservice --without-validation-rules > crds/pre-1.25/consulservice.yaml

fmt:
	$(CARGO) fmt --all

# Lints are errors (unreachable_pub and dead_code included, see Cargo.toml), and the core's
# dependency list is its boundary: no Kubernetes client, HTTP or network crate. No function
# of any crate is over 80 code lines (clippy.toml), and no crate's top-level modules import
# each other in a cycle (scripts/module-cycles.py).
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	@if $(CARGO) tree -p consul-resolver-core -e normal --prefix none | grep -E '^(kube|k8s-openapi|reqwest|hyper|mio|socket2) '; then \
		echo "consul-resolver-core depends on a network or Kubernetes crate (above): it must stay pure"; exit 1; fi
	python3 scripts/module-cycles.py . crates/api crates/core crates/consul-watch crates/consul-sim crates/heap-peak crates/xds e2e

# A local control plane, the Consul simulator and an example, with the operator in the
# foreground; Ctrl-C tears it all down.
demo:
	bash e2e/demo.sh
