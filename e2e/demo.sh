#!/usr/bin/env bash
# make demo: a local control plane, the Consul simulator, a realistic example, and the
# operator in the foreground. Ctrl-C tears everything down (only what this script started).
#
#   DEMO_TOUR=1      (default) the guided tour, then the operator keeps running until Ctrl-C
#   DEMO_TOUR=0      no tour: the operator runs until Ctrl-C
#   DEMO_TOUR=check  the whole tour non-interactively, then everything is torn down; exits 1
#                    when a step fails (e2e/tests/demo.rs runs this in `make test`)
#   DEMO_PORT, DEMO_PORT2  the replicas' ports (default 8080 and the next one)
#   DEMO_XDS_PORT, DEMO_XDS_PORT2  their xDS ports (default DEMO_PORT + 2 and the next one)
#
# Envoy (1.40.0, cached by `bash scripts/real-parts.sh envoy`) takes its clusters from both
# replicas over xDS and routes to two local backends registered in Consul. Without it the
# demo says so and the tour skips its Envoy step; under CI=true, DEMO_TOUR=check fails
# instead, as the e2e build does when a real part is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { printf '\033[1m[demo]\033[0m %s\n' "$*"; }
TOUR="${DEMO_TOUR:-1}"
case "$TOUR" in 0|1|check) ;; *) say "DEMO_TOUR must be 0, 1 or check, not '$TOUR'"; exit 2 ;; esac

ENVOY="$(bash scripts/real-parts.sh envoy-path)"
if [ ! -x "$ENVOY" ]; then
  if [ "$TOUR" = check ] && [ "${CI:-}" = true ]; then
    say "CI=true and Envoy is missing, so the tour's Envoy step would not run: bash scripts/real-parts.sh envoy"
    exit 1
  fi
  say "Envoy is NOT installed (bash scripts/real-parts.sh envoy installs it): the demo runs without it and the tour skips its Envoy step"
  ENVOY=
fi

bash e2e/cluster.sh build
say "building the operator and the Consul simulator"
# The simulator is its own crate (crates/consul-sim); both builds are the ones `make test` makes.
cargo build --quiet -p consul-resolver-operator --bin consul-resolver-operator -p consul-sim --bin consul-sim
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}/debug"

DIR="$(mktemp -d -t cro-demo-XXXXXX)"
SIM_PID=
OP_PID=
OP2_PID=
ENVOY_PID=
GREETER_PIDS=
cleanup() {
  trap - EXIT INT TERM
  say "tearing down"
  # Background jobs of a script ignore Ctrl-C, so what it started is stopped here, by pid.
  for pid in $ENVOY_PID $OP_PID $OP2_PID $GREETER_PIDS; do kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true; done
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

# greeter: two real instances on loopback, each answering its own name, for Envoy to route to.
cat > "$DIR/greeter.py" <<'PY'
import http.server, sys
name = sys.argv[1].encode() + b"\n"
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(name)))
        self.end_headers()
        self.wfile.write(name)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print("listening on", server.server_address[1], flush=True)
server.serve_forever()
PY
declare -A GREETER_PORT
for n in 1 2; do
  python3 "$DIR/greeter.py" "greeter-$n" > "$DIR/greeter-$n.out" 2>&1 &
  GREETER_PIDS="$GREETER_PIDS $!"
  for _ in $(seq 100); do grep -q '^listening on ' "$DIR/greeter-$n.out" 2>/dev/null && break; sleep 0.1; done
  GREETER_PORT[$n]="$(sed -n 's/^listening on //p' "$DIR/greeter-$n.out")"
  [ -n "${GREETER_PORT[$n]}" ] || { say "the greeter-$n backend did not start"; cat "$DIR/greeter-$n.out"; exit 1; }
done
say "registering greeter-1 (127.0.0.1:${GREETER_PORT[1]}) and greeter-2 (127.0.0.1:${GREETER_PORT[2]}), both passing"
for n in 1 2; do register "node-greeter-$n" 127.0.0.1 greeter "greeter-$n" "${GREETER_PORT[$n]}" passing; done

say "applying the CRDs and the example (2 resolvers, 13 Mappings)"
# crds/pre-1.25/: the demo's API server is 1.20, where kubectl refuses the CEL rules of crds/.
kubectl apply -f crds/pre-1.25/ -f e2e/crds/ambassador.yaml > /dev/null
kubectl wait --for condition=established --timeout=60s crd/consulresolvers.consulresolver.io crd/mappings.getambassador.io crd/tcpmappings.getambassador.io > /dev/null
kubectl create namespace demo-shop > /dev/null
kubectl create namespace demo-blog > /dev/null
kubectl apply -f e2e/demo/example.yaml > /dev/null

PORT="${DEMO_PORT:-8080}"
PORT2="${DEMO_PORT2:-$((PORT + 1))}"
XDS_PORT="${DEMO_XDS_PORT:-$((PORT + 2))}"
XDS_PORT2="${DEMO_XDS_PORT2:-$((XDS_PORT + 1))}"

# Two replicas on one Lease, as manifests/deployment.yaml runs them: both serve
# /snapshot and xDS, the lease holder writes the ConfigMap, statuses and Events.
start_replica() { # name port xds-port
  DEMO_CONSUL_ADDR="$CONSUL_ADDR" KUBECONFIG="$DIR/cluster/operator.kubeconfig" RUST_LOG="${RUST_LOG:-info,kube=warn}" \
    "$TARGET/consul-resolver-operator" run --listen "127.0.0.1:$2" --xds-listen "127.0.0.1:$3" \
    --bootstrap-timeout 10s --address-env DEMO_CONSUL_ADDR \
    --snapshot-configmap consul-resolver-system/consul-resolver-snapshot \
    --leader-election-lease consul-resolver-system/consul-resolver-operator \
    --leader-election-identity "$1" --leader-election-duration 5s > "$DIR/$1.log" 2>&1 &
}
say "running two replicas of the operator (replica-a on :$PORT, xDS :$XDS_PORT; replica-b on :$PORT2, xDS :$XDS_PORT2)"
say "their logs: tail -f $DIR/replica-a.log $DIR/replica-b.log"
start_replica replica-a "$PORT" "$XDS_PORT"
OP_PID=$!
start_replica replica-b "$PORT2" "$XDS_PORT2"
OP2_PID=$!

# Envoy: clusters over ADS from either replica (its xds cluster lists both, so losing one
# leaves it the other), and a listener on a loopback port the kernel picks that routes
# everything to greeter's cluster. The admin's and the listener's ports are read back.
GREETER_CLUSTER=consul/demo-shop/consul/greeter
ENVOY_PORT=
ENVOY_ADMIN=
if [ -n "$ENVOY" ]; then
  cat > "$DIR/envoy.json" <<JSON
{
  "node": {"id": "demo-edge", "cluster": "demo"},
  "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
  "dynamic_resources": {
    "ads_config": {
      "api_type": "GRPC", "transport_api_version": "V3", "set_node_on_first_message_only": true,
      "grpc_services": [{"envoy_grpc": {"cluster_name": "xds",
        "retry_policy": {"retry_back_off": {"base_interval": "0.25s", "max_interval": "1s"}}}}]
    },
    "cds_config": {"ads": {}, "resource_api_version": "V3"}
  },
  "static_resources": {
    "clusters": [{
      "name": "xds", "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "1s",
      "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}},
      "load_assignment": {"cluster_name": "xds", "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": $XDS_PORT}}}},
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": $XDS_PORT2}}}}]}]}
    }],
    "listeners": [{
      "name": "ingress", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
      "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {"name": "static", "validate_clusters": false, "virtual_hosts": [{"name": "all", "domains": ["*"],
          "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "$GREETER_CLUSTER"}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
      }}]}]
    }]
  }
}
JSON
  say "starting Envoy (xDS from both replicas); its log: $DIR/envoy.log"
  "$ENVOY" -c "$DIR/envoy.json" --disable-hot-restart --use-dynamic-base-id --concurrency 1 -l warning \
    --admin-address-path "$DIR/envoy-admin" > "$DIR/envoy.log" 2>&1 &
  ENVOY_PID=$!
  for _ in $(seq 200); do
    ENVOY_ADMIN="$(cat "$DIR/envoy-admin" 2>/dev/null || true)"
    [ -n "$ENVOY_ADMIN" ] && ENVOY_PORT="$(curl -fsS "http://$ENVOY_ADMIN/listeners?format=json" 2>/dev/null |
      python3 -c "import json,sys; print(json.load(sys.stdin)['listener_statuses'][0]['local_address']['socket_address'].get('port_value') or '')" 2>/dev/null || true)"
    [ -n "$ENVOY_PORT" ] && break
    sleep 0.1
  done
  [ -n "$ENVOY_PORT" ] || { say "Envoy did not start"; tail -n 20 "$DIR/envoy.log"; exit 1; }
  ENVOY_MSG="  Through Envoy to greeter's instances (cluster $GREETER_CLUSTER, from either replica's xDS):
    curl -s http://127.0.0.1:$ENVOY_PORT/
    curl -s http://$ENVOY_ADMIN/clusters | grep greeter"
else
  ENVOY_MSG="  No Envoy (bash scripts/real-parts.sh envoy installs it): nothing routes to greeter."
fi

cat <<MSG

  Where to look (in another terminal):
    export KUBECONFIG=$KUBECONFIG
    kubectl get cres -A
    kubectl get mappings -A
    kubectl -n consul-resolver-system get lease consul-resolver-operator
    curl -s http://127.0.0.1:$PORT/snapshot | python3 -m json.tool | less
    curl -s http://127.0.0.1:$PORT/metrics | grep consul_resolver
    kubectl -n consul-resolver-system get configmap consul-resolver-snapshot -o yaml
    curl -s http://127.0.0.1:$PORT/xds/clients | python3 -m json.tool
$ENVOY_MSG
  Change the world through Consul's HTTP API, e.g.:
    curl -X PUT http://$CONSUL_ADDR/v1/catalog/deregister -d '{"Node":"node-1","ServiceID":"billing-1"}'
  Both replicas run as the ServiceAccount consul-resolver-operator with the RBAC of manifests/.
  Ctrl-C stops everything. DEMO_TOUR=0 skips the guided tour; DEMO_TOUR=check runs it and exits.

MSG

# Waits (up to 30 s, however long each try takes) until the command succeeds; says what it
# waited for.
until_ok() { # description command...
  local what=$1 deadline=$((SECONDS + 30)); shift
  while [ "$SECONDS" -lt "$deadline" ]; do "$@" > /dev/null 2>&1 && { say "  ok: $what"; return 0; }; sleep 0.1; done
  say "  still waiting for: $what (giving up on the tour)"; return 1
}
LIVE_PORT=$PORT
snapshot_has() { # python expression over s (the snapshot)
  curl -fsS "http://127.0.0.1:$LIVE_PORT/snapshot" | python3 -c "import json,sys; s=json.load(sys.stdin); sys.exit(0 if ($1) else 1)"
}
endpoints_of() { # resolver-namespace service -> python expression: its endpoint count
  echo "sum(len(v['endpoints']) for r in s['resolvers'] if r['namespace']=='$1' for v in r['services'] if v['name']=='$2')"
}
through_envoy() { # n: the answers of n requests through Envoy, one a line; fails if one fails
  for _ in $(seq "$1"); do curl -fsS --max-time 2 "http://127.0.0.1:$ENVOY_PORT/" || return 1; done
}
answered_by() { # "names": six requests through Envoy were answered by exactly these backends
  local got; got=$(through_envoy 6) || return 1
  [ "$(printf '%s\n' "$got" | sort -u | paste -sd' ')" = "$1" ]
}
show_envoy() { say "  curl -s http://127.0.0.1:$ENVOY_PORT/, six times: $(through_envoy 6 | paste -sd' ')"; }
xds_client_of() { # ops port: Envoy is a client of that replica's xDS server
  curl -fsS "http://127.0.0.1:$1/xds/clients" |
    python3 -c "import json,sys; sys.exit(0 if any(c['nodeId']=='demo-edge' for c in json.load(sys.stdin)['clients']) else 1)"
}
envoy_served_by() { xds_client_of "$1" && answered_by "greeter-1 greeter-2"; }
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

  if [ -n "$ENVOY" ]; then
    say "5. Envoy routes to $GREETER_CLUSTER, from xDS: both greeter instances answer"
    until_ok "both greeter instances answer through Envoy" answered_by "greeter-1 greeter-2" || return 1
    show_envoy || return 1
    say "   greeter-1's check turns critical in Consul: Envoy stops sending it requests"
    register node-greeter-1 127.0.0.1 greeter greeter-1 "${GREETER_PORT[1]}" critical || return 1
    until_ok "only greeter-2 answers through Envoy" answered_by "greeter-2" || return 1
    show_envoy || return 1
    say "   greeter-1's check passes again: it is back in the rotation"
    register node-greeter-1 127.0.0.1 greeter greeter-1 "${GREETER_PORT[1]}" passing || return 1
    until_ok "both greeter instances answer through Envoy again" answered_by "greeter-1 greeter-2" || return 1
  else
    say "5. skipped: Envoy is not installed (bash scripts/real-parts.sh envoy)"
  fi

  say "6. the leader stops: the other replica takes the lease and carries on"
  local leader; leader=$(kubectl -n consul-resolver-system get lease consul-resolver-operator -o jsonpath='{.spec.holderIdentity}') || return 1
  local pid=$OP_PID; LIVE_PORT=$PORT2
  if [ "$leader" = replica-b ]; then pid=$OP2_PID; LIVE_PORT=$PORT; fi
  local other=replica-b; [ "$leader" = replica-b ] && other=replica-a
  if [ -n "$ENVOY" ]; then
    if xds_client_of "$LIVE_PORT"; then say "   Envoy takes xDS from $other, which keeps running"
    else say "   Envoy takes xDS from $leader: it reconnects to $other"; fi
  fi
  kill "$pid" || return 1
  until_ok "the lease moved from $leader" sh -c "kubectl -n consul-resolver-system get lease consul-resolver-operator -o jsonpath='{.spec.holderIdentity}' | grep -qv '^$leader\$'" || return 1
  say "leader now: $(kubectl -n consul-resolver-system get lease consul-resolver-operator -o jsonpath='{.spec.holderIdentity}')"
  if [ -n "$ENVOY" ]; then
    until_ok "Envoy takes xDS from the replica left and still reaches both greeter instances" envoy_served_by "$LIVE_PORT" || return 1
  fi
  say "7. a change after the handover reaches the ConfigMap through the new leader"
  curl -fsS -X PUT "http://$CONSUL_ADDR/v1/catalog/deregister" -d '{"Node":"node-2","ServiceID":"billing-2"}' > /dev/null || return 1
  until_ok "billing has no endpoints in the ConfigMap" sh -c "kubectl -n consul-resolver-system get configmap consul-resolver-snapshot -o jsonpath='{.data.snapshot\\.json}' | python3 -c \"import json,sys; s=json.load(sys.stdin); sys.exit(0 if ($(endpoints_of demo-shop billing)) == 0 else 1)\"" || return 1
  kubectl get cres -A || return 1
}
case "$TOUR" in
  check)
    if tour; then say "tour passed: every step"; exit 0; fi
    say "tour FAILED; the replicas' (and Envoy's) last log lines:"
    tail -n 20 "$DIR/replica-a.log" "$DIR/replica-b.log" ${ENVOY:+"$DIR/envoy.log"} || true
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
