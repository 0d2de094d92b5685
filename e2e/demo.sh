#!/usr/bin/env bash
# make demo: a local control plane, the Consul simulator, a realistic example, and the
# operator in the foreground. Ctrl-C tears everything down (only what this script started).
#
#   DEMO_TOUR=1      (default) the guided tour, then the operator keeps running until Ctrl-C
#   DEMO_TOUR=0      no tour: the operator runs until Ctrl-C
#   DEMO_TOUR=check  the whole tour non-interactively, then everything is torn down; exits 1
#                    when a step fails (e2e/tests/demo.rs runs this in `make test`)
#   DEMO_PORT, DEMO_PORT2  the replicas' ports (default 8080 and the next one)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { printf '\033[1m[demo]\033[0m %s\n' "$*"; }
TOUR="${DEMO_TOUR:-1}"
case "$TOUR" in 0|1|check) ;; *) say "DEMO_TOUR must be 0, 1 or check, not '$TOUR'"; exit 2 ;; esac

bash e2e/cluster.sh build
say "building the operator and the Consul simulator"
# The simulator is its own crate (crates/consul-sim); both builds are the ones `make test` makes.
cargo build --quiet -p consul-resolver-operator --bin consul-resolver-operator -p consul-sim --bin consul-sim
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}/debug"

DIR="$(mktemp -d -t cro-demo-XXXXXX)"
SIM_PID=
OP_PID=
OP2_PID=
cleanup() {
  trap - EXIT INT TERM
  say "tearing down"
  # Background jobs of a script ignore Ctrl-C, so the operator is stopped here, by pid.
  for pid in $OP_PID $OP2_PID; do kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true; done
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
# crds/pre-1.25/: the demo's API server is 1.20, where kubectl refuses the CEL rules of crds/.
kubectl apply -f crds/pre-1.25/ -f e2e/crds/ambassador.yaml > /dev/null
kubectl wait --for condition=established --timeout=60s crd/consulresolvers.consulresolver.io crd/mappings.getambassador.io crd/tcpmappings.getambassador.io > /dev/null
kubectl create namespace demo-shop > /dev/null
kubectl create namespace demo-blog > /dev/null
kubectl apply -f e2e/demo/example.yaml > /dev/null

PORT="${DEMO_PORT:-8080}"
PORT2="${DEMO_PORT2:-$((PORT + 1))}"
cat <<MSG

  Where to look (in another terminal):
    export KUBECONFIG=$KUBECONFIG
    kubectl get cres -A
    kubectl get mappings -A
    kubectl -n consul-resolver-system get lease consul-resolver-operator
    curl -s http://127.0.0.1:$PORT/snapshot | python3 -m json.tool | less
    curl -s http://127.0.0.1:$PORT/metrics | grep consul_resolver
    kubectl -n consul-resolver-system get configmap consul-resolver-snapshot -o yaml
  Change the world through Consul's HTTP API, e.g.:
    curl -X PUT http://$CONSUL_ADDR/v1/catalog/deregister -d '{"Node":"node-1","ServiceID":"billing-1"}'
  Both replicas run as the ServiceAccount consul-resolver-operator with the RBAC of manifests/.
  Ctrl-C stops everything. DEMO_TOUR=0 skips the guided tour; DEMO_TOUR=check runs it and exits.

MSG

# Two replicas on one Lease, as manifests/deployment.yaml runs them: both serve
# /snapshot, the lease holder writes the ConfigMap, statuses and Events.
start_replica() { # name port
  DEMO_CONSUL_ADDR="$CONSUL_ADDR" KUBECONFIG="$DIR/cluster/operator.kubeconfig" RUST_LOG="${RUST_LOG:-info,kube=warn}" \
    "$TARGET/consul-resolver-operator" run --listen "127.0.0.1:$2" --bootstrap-timeout 10s --address-env DEMO_CONSUL_ADDR \
    --snapshot-configmap consul-resolver-system/consul-resolver-snapshot \
    --leader-election-lease consul-resolver-system/consul-resolver-operator \
    --leader-election-identity "$1" --leader-election-duration 5s > "$DIR/$1.log" 2>&1 &
}
say "running two replicas of the operator (replica-a on :$PORT, replica-b on :$PORT2)"
say "their logs: tail -f $DIR/replica-a.log $DIR/replica-b.log"
start_replica replica-a "$PORT"
OP_PID=$!
start_replica replica-b "$PORT2"
OP2_PID=$!

# Waits (up to 30 s) until the command succeeds; says what it waited for.
until_ok() { # description command...
  local what=$1; shift
  for _ in $(seq 300); do "$@" > /dev/null 2>&1 && { say "  ok: $what"; return 0; }; sleep 0.1; done
  say "  still waiting for: $what (giving up on the tour)"; return 1
}
LIVE_PORT=$PORT
snapshot_has() { # python expression over s (the snapshot)
  curl -fsS "http://127.0.0.1:$LIVE_PORT/snapshot" | python3 -c "import json,sys; s=json.load(sys.stdin); sys.exit(0 if ($1) else 1)"
}
endpoints_of() { # resolver-namespace service -> python expression: its endpoint count
  echo "sum(len(v['endpoints']) for r in s['resolvers'] if r['namespace']=='$1' for v in r['services'] if v['name']=='$2')"
}
# The tour: each step changes the world and waits for the operator to follow. Called where
# `set -e` does not apply (a failed tour must not skip the teardown), so every command that
# matters ends in `|| return 1`.
tour() {
  until_ok "first snapshot published" curl -fsS "http://127.0.0.1:$PORT/readyz" || return 1
  say "kubectl get cres -A:"; kubectl get cres -A || return 1
  say "leader: $(kubectl -n consul-resolver-system get lease consul-resolver-operator -o jsonpath='{.spec.holderIdentity}')"

  say "1. deregistering billing-1 in Consul: the snapshot, the ConfigMap and the status follow"
  curl -fsS -X PUT "http://$CONSUL_ADDR/v1/catalog/deregister" -d '{"Node":"node-1","ServiceID":"billing-1"}' > /dev/null || return 1
  until_ok "billing has 1 endpoint in the snapshot" snapshot_has "$(endpoints_of demo-shop billing) == 1" || return 1
  kubectl get cres -A || return 1

  say "2. checkout-3's check turns passing: it joins checkout's endpoints"
  register node-3 192.0.2.99 checkout checkout-3 9000 passing || return 1
  until_ok "checkout has 3 endpoints" snapshot_has "$(endpoints_of demo-shop checkout) == 3" || return 1

  say "3. a resolver with an unset variable in its address: InvalidSpec, and an Event"
  kubectl apply -f - > /dev/null <<'YAML' || return 1
apiVersion: consulresolver.io/v1alpha1
kind: ConsulResolver
metadata: {name: broken, namespace: demo-shop}
spec: {address: "${NOT_SET_ANYWHERE}:8500"}
YAML
  until_ok "Ready=False reason InvalidSpec" sh -c "kubectl -n demo-shop get cres broken -o jsonpath='{.status.conditions[0].reason}' | grep -qx InvalidSpec" || return 1
  kubectl -n demo-shop describe cres broken | sed -n '/^Status:/,$p'

  say "4. the cart Mapping moves to the search service: cart's Consul watch stops, search's is shared"
  kubectl -n demo-shop patch mapping cart --type merge -p '{"spec":{"service":"search"}}' > /dev/null || return 1
  until_ok "cart gone from the snapshot's services" snapshot_has "$(endpoints_of demo-shop cart) == 0 and not any(v['name']=='cart' for r in s['resolvers'] for v in r['services'])" || return 1

  say "5. the leader stops: the other replica takes the lease and carries on"
  local leader; leader=$(kubectl -n consul-resolver-system get lease consul-resolver-operator -o jsonpath='{.spec.holderIdentity}') || return 1
  local pid=$OP_PID; LIVE_PORT=$PORT2
  if [ "$leader" = replica-b ]; then pid=$OP2_PID; LIVE_PORT=$PORT; fi
  kill "$pid" || return 1
  until_ok "the lease moved from $leader" sh -c "kubectl -n consul-resolver-system get lease consul-resolver-operator -o jsonpath='{.spec.holderIdentity}' | grep -qv '^$leader\$'" || return 1
  say "leader now: $(kubectl -n consul-resolver-system get lease consul-resolver-operator -o jsonpath='{.spec.holderIdentity}')"
  say "6. a change after the handover reaches the ConfigMap through the new leader"
  curl -fsS -X PUT "http://$CONSUL_ADDR/v1/catalog/deregister" -d '{"Node":"node-2","ServiceID":"billing-2"}' > /dev/null || return 1
  until_ok "billing has no endpoints in the ConfigMap" sh -c "kubectl -n consul-resolver-system get configmap consul-resolver-snapshot -o jsonpath='{.data.snapshot\\.json}' | python3 -c \"import json,sys; s=json.load(sys.stdin); sys.exit(0 if ($(endpoints_of demo-shop billing)) == 0 else 1)\"" || return 1
  kubectl get cres -A || return 1
}
case "$TOUR" in
  check)
    if tour; then say "tour passed: every step"; exit 0; fi
    say "tour FAILED; the replicas' last log lines:"
    tail -n 20 "$DIR/replica-a.log" "$DIR/replica-b.log" || true
    exit 1
    ;;
  1)
    if tour; then
      say "tour done; the remaining replica keeps running. Ctrl-C stops everything."
    else
      say "the tour FAILED at the step above; the replicas keep running for a look (logs above). Ctrl-C stops everything."
    fi
    ;;
esac
wait "$OP_PID" "$OP2_PID" || true
