#!/usr/bin/env bash
# make demo: a local control plane, the Consul simulator, a realistic example, and the
# operator in the foreground. Ctrl-C tears everything down (only what this script started).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { printf '\033[1m[demo]\033[0m %s\n' "$*"; }

bash e2e/cluster.sh build
say "building the operator and the Consul simulator"
cargo build --quiet -p consul-resolver-operator --bin consul-resolver-operator -p e2e --bin consul-sim
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}/debug"

DIR="$(mktemp -d -t cro-demo-XXXXXX)"
SIM_PID=
OP_PID=
cleanup() {
  trap - EXIT INT TERM
  say "tearing down"
  # Background jobs of a script ignore Ctrl-C, so the operator is stopped here, by pid.
  [ -n "$OP_PID" ] && kill "$OP_PID" 2>/dev/null && wait "$OP_PID" 2>/dev/null || true
  [ -n "$SIM_PID" ] && kill "$SIM_PID" 2>/dev/null && wait "$SIM_PID" 2>/dev/null || true
  bash "$ROOT/e2e/cluster.sh" down "$DIR/cluster" || true
  rm -rf "$DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bash e2e/cluster.sh up "$DIR/cluster"
export KUBECONFIG="$DIR/cluster/admin.kubeconfig"

say "starting the Consul simulator"
"$TARGET/consul-sim" --listen 127.0.0.1:0 > "$DIR/sim.out" 2> "$DIR/sim.log" &
SIM_PID=$!
for _ in $(seq 100); do grep -q '^listening on ' "$DIR/sim.out" 2>/dev/null && break; sleep 0.1; done
CONSUL_ADDR="$(sed -n 's/^listening on //p' "$DIR/sim.out")"
[ -n "$CONSUL_ADDR" ] || { say "the simulator did not start"; cat "$DIR/sim.log"; exit 1; }

register() { # node address service id port status
  curl -fsS -X PUT "http://$CONSUL_ADDR/v1/catalog/register" -d "{\"Node\":\"$1\",\"Address\":\"$2\",
    \"Service\":{\"ID\":\"$4\",\"Service\":\"$3\",\"Address\":\"$2\",\"Port\":$5,\"Tags\":[\"demo\"]},
    \"Check\":{\"CheckID\":\"check-$4\",\"Name\":\"$3 health\",\"Status\":\"$6\",\"ServiceID\":\"$4\"}}" > /dev/null
}
say "registering services in Consul (one instance of checkout is failing its check)"
i=0
for svc in billing cart checkout search inventory postgres posts comments audit; do
  for n in 1 2; do
    i=$((i + 1))
    register "node-$n" "192.0.2.$i" "$svc" "$svc-$n" $((8000 + i)) passing
  done
done
register node-3 192.0.2.99 checkout checkout-3 9000 critical

say "applying the CRDs and the example (2 resolvers, 12 Mappings)"
kubectl apply -f crds/ -f e2e/crds/ambassador.yaml > /dev/null
kubectl wait --for condition=established --timeout=60s crd/consulresolvers.consulresolver.io crd/mappings.getambassador.io crd/tcpmappings.getambassador.io > /dev/null
kubectl create namespace demo-shop > /dev/null
kubectl create namespace demo-blog > /dev/null
kubectl apply -f e2e/demo/example.yaml > /dev/null

PORT="${DEMO_PORT:-8080}"
cat <<MSG

  Where to look (in another terminal):
    export KUBECONFIG=$KUBECONFIG
    kubectl get cres -A
    kubectl get mappings -A
    curl -s http://127.0.0.1:$PORT/snapshot | python3 -m json.tool | less
    curl -s http://127.0.0.1:$PORT/metrics | grep consul_resolver
    kubectl -n consul-resolver-system get configmap consul-resolver-snapshot -o yaml
  Change the world through Consul's HTTP API, e.g.:
    curl -X PUT http://$CONSUL_ADDR/v1/catalog/deregister -d '{"Node":"node-1","ServiceID":"billing-1"}'
  The operator runs as the ServiceAccount consul-resolver-operator with the RBAC of manifests/.
  Ctrl-C stops everything.

MSG
say "running the operator"
DEMO_CONSUL_ADDR="$CONSUL_ADDR" KUBECONFIG="$DIR/cluster/operator.kubeconfig" RUST_LOG="${RUST_LOG:-info,kube=warn}" \
  "$TARGET/consul-resolver-operator" run --listen "127.0.0.1:$PORT" --bootstrap-timeout 10s \
  --snapshot-configmap consul-resolver-system/consul-resolver-snapshot &
OP_PID=$!
wait "$OP_PID" || true
