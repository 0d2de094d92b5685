#!/usr/bin/env bash
# Self-test of e2e/cluster.sh: a real etcd + kube-apiserver 1.20.2 on loopback.
#
#   1. a half-way `up` (the apiserver cannot start) stops the etcd it started;
#   2. `up` into a temp dir; the ambassador CRDs get Established; a Mapping is created
#      in v3alpha1 and read back as v2;
#   3. a CRD with a status subresource: create, patch status (--subresource=status),
#      list, and a background `kubectl get --watch` sees the change. The apiserver must
#      survive all of it (the vendored reflect2 1.0.1 segfaulted on the first custom
#      resource write; the build swaps in 1.0.2);
#   4. the operator's ServiceAccount token does exactly what manifests/rbac.yaml says;
#   5. the audit log records watch requests;
#   6. `down` stops exactly the recorded processes, twice in a row; `up` again on the
#      same dir restarts the same cluster (same objects, same URL), with each process
#      slow to exec (a process not yet exec'd is starting, not exited);
#   7. no process from the run is left.
# Exits non-zero on any failure and always tears down (trap).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CLUSTER="$HERE/cluster.sh"
ROOT="$(mktemp -d "${TMPDIR:-/tmp}/cluster-selftest.XXXXXX")"
C="$ROOT/c"        # the cluster under test
HALF="$ROOT/half"  # the cluster whose `up` must fail half-way
WATCH_PID=
SEEN_PIDS=()

say() { printf '[selftest] %s\n' "$*" >&2; }
fail() { printf '[selftest] FAIL: %s\n' "$*" >&2; exit 1; }

# Alive and not a zombie.
alive() { local s; s=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true); [ -n "$s" ] && [ "$s" != Z ]; }

# Pids of live processes whose command line mentions the test root (etcd's --data-dir,
# the apiserver's --cert-dir, ...). Only looks; never signals anything.
procs_under_root() {
  local p args
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$p" = $$ ] || [ "$p" = "$BASHPID" ] && continue
    alive "$p" || continue
    args=$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null || true)
    [[ "$args" == *"$ROOT/"* ]] && echo "$p"
  done
  return 0
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$WATCH_PID" ] && alive "$WATCH_PID"; then kill "$WATCH_PID" 2>/dev/null || true; fi
  [ -n "$WATCH_PID" ] && { wait "$WATCH_PID" 2>/dev/null || true; }
  bash "$CLUSTER" down "$C" || rc=1
  bash "$CLUSTER" down "$HALF" || rc=1
  if [ "$rc" = 0 ]; then
    rm -rf "$ROOT"
    say "PASS"
  else
    say "FAILED (exit $rc); logs and state kept in $ROOT"
    for f in "$C/apiserver.log" "$C/etcd.log"; do
      [ -f "$f" ] && { say "--- tail $f"; tail -n 30 "$f" >&2; }
    done
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# wait_for SECONDS DESCRIPTION CMD...: poll CMD until it succeeds.
wait_for() {
  local deadline=$((SECONDS + $1)) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || fail "timed out waiting for: $what"
    sleep 0.2
  done
}

expect_eq() { [ "$2" = "$3" ] || fail "$1: expected '$3', got '$2'"; }

# ---------------------------------------------------------------------------------
say "1. a half-way up stops what it started"
if CLUSTER_APISERVER_BIN=/bin/false bash "$CLUSTER" up "$HALF" 2>"$ROOT/half.err"; then
  fail "up with a broken apiserver succeeded"
fi
grep -q 'up failed: stopping what it started' "$ROOT/half.err" || { cat "$ROOT/half.err" >&2; fail "up did not clean up"; }
left=$(procs_under_root)
[ -z "$left" ] || fail "processes left after a failed up: $left"
[ ! -e "$HALF/etcd.pid" ] || fail "etcd.pid left after a failed up"

# ---------------------------------------------------------------------------------
say "2. up"
t0=$(date +%s.%N)
bash "$CLUSTER" up "$C"
t1=$(date +%s.%N)
say "up took $(python3 -c "print(round($t1 - $t0, 1))")s"
for f in env admin.kubeconfig operator.kubeconfig etcd.pid apiserver.pid audit.log pki/apiserver.crt; do
  [ -s "$C/$f" ] || fail "up did not write $C/$f"
done
# shellcheck disable=SC1090,SC1091
source "$C/env"
eval "$(bash "$CLUSTER" env "$C")"
expect_eq "KUBECONFIG from env" "$KUBECONFIG" "$C/admin.kubeconfig"
expect_eq "KUBECONFIG_ADMIN" "$KUBECONFIG_ADMIN" "$C/admin.kubeconfig"
SEEN_PIDS+=("$ETCD_PID" "$APISERVER_PID")
expect_eq "etcd.pid" "$(cat "$C/etcd.pid")" "$ETCD_PID"
expect_eq "apiserver.pid" "$(cat "$C/apiserver.pid")" "$APISERVER_PID"
alive "$ETCD_PID" || fail "etcd not running"
alive "$APISERVER_PID" || fail "apiserver not running"
if bash "$CLUSTER" up "$C" 2>/dev/null; then fail "a second up on a running dir succeeded"; fi
alive "$APISERVER_PID" || fail "a refused second up stopped the running apiserver"

K=(kubectl --request-timeout=30s)
# The CA in the kubeconfig verifies the serving certificate (no insecure-skip).
grep -q 'insecure-skip-tls-verify' "$KUBECONFIG" && fail "admin.kubeconfig skips TLS verification"
curl -fsS --cacert "$APISERVER_CA" -H "Authorization: Bearer $(cut -d, -f1 "$C/tokens.csv")" "$APISERVER_URL/version" >"$ROOT/version.json"
server_version=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["gitVersion"])' "$ROOT/version.json")
expect_eq "server version" "$server_version" "v1.20.2"

# ---------------------------------------------------------------------------------
say "2b. ambassador CRDs and a Mapping"
"${K[@]}" apply -f "$HERE/crds/ambassador.yaml" >/dev/null
"${K[@]}" wait --for condition=established --timeout=60s \
  crd/mappings.getambassador.io crd/tcpmappings.getambassador.io >/dev/null
"${K[@]}" apply -f - >/dev/null <<'EOF'
apiVersion: getambassador.io/v3alpha1
kind: Mapping
metadata:
  name: selftest
  namespace: default
spec:
  hostname: "*"
  prefix: /selftest/
  service: selftest-svc
  resolver: consul-dc1
---
apiVersion: getambassador.io/v2
kind: TCPMapping
metadata:
  name: selftest-tcp
  namespace: default
spec:
  port: 5432
  service: db.service.consul:5432
  resolver: consul-dc1
EOF
expect_eq "Mapping read as v2" \
  "$("${K[@]}" get mappings.v2.getambassador.io selftest -n default -o jsonpath='{.apiVersion} {.spec.prefix} {.spec.resolver}')" \
  "getambassador.io/v2 /selftest/ consul-dc1"
expect_eq "TCPMapping read as v3alpha1" \
  "$("${K[@]}" get tcpmappings.v3alpha1.getambassador.io selftest-tcp -n default -o jsonpath='{.apiVersion} {.spec.port}')" \
  "getambassador.io/v3alpha1 5432"
alive "$APISERVER_PID" || fail "apiserver died writing a custom resource (reflect2?)"

# ---------------------------------------------------------------------------------
say "3. a CRD with a status subresource: create, status patch, list, watch"
"${K[@]}" apply -f - >/dev/null <<'EOF'
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.selftest.consulresolver.io
spec:
  group: selftest.consulresolver.io
  scope: Namespaced
  names: {kind: Widget, listKind: WidgetList, plural: widgets, singular: widget}
  versions:
    - name: v1
      served: true
      storage: true
      subresources:
        status: {}
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              properties:
                size: {type: integer}
            status:
              type: object
              properties:
                phase: {type: string}
                observedGeneration: {type: integer}
EOF
"${K[@]}" wait --for condition=established --timeout=60s crd/widgets.selftest.consulresolver.io >/dev/null
W=widgets.selftest.consulresolver.io
"${K[@]}" apply -f - >/dev/null <<'EOF'
apiVersion: selftest.consulresolver.io/v1
kind: Widget
metadata:
  name: w1
  namespace: default
spec:
  size: 1
EOF
alive "$APISERVER_PID" || fail "apiserver died on the first custom resource write (reflect2?)"

# A watch in the background; it must see the status change made after it started.
"${K[@]}" get "$W" -n default --watch --output-watch-events --request-timeout=90s \
  -o jsonpath='{.type} {.object.metadata.name} {.object.status.phase}{"\n"}' \
  >"$ROOT/watch.out" 2>"$ROOT/watch.err" &
WATCH_PID=$!
wait_for 30 "the watch to deliver the initial ADDED event" grep -q '^ADDED w1' "$ROOT/watch.out"

gen_before=$("${K[@]}" get "$W" w1 -n default -o jsonpath='{.metadata.generation}')
"${K[@]}" patch "$W" w1 -n default --subresource=status --type=merge \
  -p "{\"status\":{\"phase\":\"Ready\",\"observedGeneration\":$gen_before}}" >/dev/null
wait_for 30 "the watch to deliver MODIFIED w1 Ready" grep -q '^MODIFIED w1 Ready$' "$ROOT/watch.out"
kill "$WATCH_PID" 2>/dev/null || true
wait "$WATCH_PID" 2>/dev/null || true
WATCH_PID=

expect_eq "status after the status patch" \
  "$("${K[@]}" get "$W" w1 -n default -o jsonpath='{.status.phase} {.status.observedGeneration} {.metadata.generation}')" \
  "Ready $gen_before $gen_before"
# Through the main resource, status is ignored and spec changes bump the generation.
"${K[@]}" patch "$W" w1 -n default --type=merge -p '{"spec":{"size":2},"status":{"phase":"Bogus"}}' >/dev/null
expect_eq "after a main-resource patch" \
  "$("${K[@]}" get "$W" w1 -n default -o jsonpath='{.spec.size} {.status.phase} {.metadata.generation}')" \
  "2 Ready $((gen_before + 1))"
"${K[@]}" apply -f - >/dev/null <<'EOF'
apiVersion: selftest.consulresolver.io/v1
kind: Widget
metadata:
  name: w2
  namespace: default
spec:
  size: 3
EOF
expect_eq "list" "$("${K[@]}" get "$W" -A -o name | sort | tr '\n' ' ')" \
  "widget.selftest.consulresolver.io/w1 widget.selftest.consulresolver.io/w2 "
alive "$APISERVER_PID" || fail "apiserver died"

# ---------------------------------------------------------------------------------
say "4. the operator's ServiceAccount token and RBAC"
KO=(kubectl --kubeconfig "$KUBECONFIG_OPERATOR" --request-timeout=30s)
# SelfSubjectAccessReviews name the API group explicitly, so they also answer for
# consulresolvers, whose CRD this test does not install (`kubectl auth can-i` would
# resolve the resource through discovery, lose the group and answer "no").
# check VERB GROUP RESOURCE SUBRESOURCE NAMESPACE WANT ("" namespace = all)
check() {
  local got
  got=$("${KO[@]}" create -o jsonpath='{.status.allowed}' -f - <<EOF
apiVersion: authorization.k8s.io/v1
kind: SelfSubjectAccessReview
spec:
  resourceAttributes: {verb: "$1", group: "$2", resource: "$3", subresource: "$4", namespace: "$5"}
EOF
)
  expect_eq "operator may $1 $3${4:+/$4}.$2 in ${5:-all namespaces}" "$got" "$6"
}
NS=consul-resolver-system
check list      consulresolver.io   consulresolvers ""     ""      true
check watch     consulresolver.io   consulresolvers ""     ""      true
check patch     consulresolver.io   consulresolvers status default true
check update    consulresolver.io   consulresolvers status default false
check update    consulresolver.io   consulresolvers ""     default false
check patch     consulresolver.io   consulresolvers ""     default false
check delete    consulresolver.io   consulresolvers ""     default false
check list      getambassador.io    mappings        ""     ""      true
check watch     getambassador.io    tcpmappings     ""     ""      true
check create    getambassador.io    mappings        ""     default false
check watch     discovery.k8s.io    endpointslices  ""     ""      true
check get       discovery.k8s.io    endpointslices  ""     default false
check list      ""                  endpoints       ""     ""      true
# Secrets only where a RoleBinding grants consul-resolver-operator-secrets (none here).
check list      ""                  secrets         ""     ""      false
check list      ""                  secrets         ""     default false
check get       ""                  secrets         ""     default false
check create    events.k8s.io       events          ""     default true
check patch     events.k8s.io       events          ""     default true
check create    ""                  events          ""     default false
check create    ""                  configmaps      ""     "$NS"   true
check delete    ""                  configmaps      ""     "$NS"   true
check create    ""                  configmaps      ""     default false
check update    coordination.k8s.io leases          ""     "$NS"   true
check patch     coordination.k8s.io leases          ""     "$NS"   false
# Snapshot parts are found by their label in the operator's namespace, nowhere else.
check list      ""                  configmaps      ""     "$NS"   true
check list      ""                  configmaps      ""     default false
check watch     ""                  configmaps      ""     "$NS"   false
check create    coordination.k8s.io leases          ""     default false
check create    apps                deployments     ""     "$NS"   false
check list      ""                  pods            ""     ""      false
# The documented grant opens exactly one namespace's Secrets.
"${K[@]}" -n default create rolebinding consul-resolver-operator-secrets \
  --clusterrole=consul-resolver-operator-secrets \
  --serviceaccount=consul-resolver-system:consul-resolver-operator >/dev/null
check list      ""                  secrets         ""     default true
check watch     ""                  secrets         ""     default true
check get       ""                  secrets         ""     default false
check list      ""                  secrets         ""     "$NS"   false
# Exports write Services and EndpointSlices only where consul-resolver-operator-exports
# is bound.
check list      consulresolver.io   consulservices  ""     ""      true
check patch     consulresolver.io   consulservices  status default true
check create    ""                  services        ""     default false
check patch     discovery.k8s.io    endpointslices  ""     default false
"${K[@]}" -n default create rolebinding consul-resolver-operator-exports \
  --clusterrole=consul-resolver-operator-exports \
  --serviceaccount=consul-resolver-system:consul-resolver-operator >/dev/null
check create    ""                  services        ""     default true
check patch     ""                  services        ""     default true
check update    ""                  services        ""     default false
check patch     discovery.k8s.io    endpointslices  ""     default true
check delete    discovery.k8s.io    endpointslices  ""     default true
check create    ""                  services        ""     "$NS"   false
# And black-box, as a user would ask (the getambassador.io CRDs exist by now).
expect_eq "kubectl auth can-i list mappings -A" \
  "$("${KO[@]}" auth can-i list mappings.getambassador.io --all-namespaces 2>/dev/null || true)" yes
expect_eq "kubectl auth can-i create deployments" \
  "$("${KO[@]}" auth can-i create deployments.apps -n "$NS" 2>/dev/null || true)" no
# Real requests with the token: allowed ones work, others are refused for the SA.
"${KO[@]}" get mappings.getambassador.io -A -o name | grep -qx 'mapping.getambassador.io/selftest' \
  || fail "operator token cannot list mappings"
if "${KO[@]}" get pods -n default 2>"$ROOT/forbidden.err"; then fail "operator token may list pods"; fi
grep -q 'system:serviceaccount:consul-resolver-system:consul-resolver-operator' "$ROOT/forbidden.err" \
  || { cat "$ROOT/forbidden.err" >&2; fail "the refusal does not name the ServiceAccount"; }

# ---------------------------------------------------------------------------------
say "5. the audit log records watches"
watches=$(grep -c '"verb":"watch".*"resource":"widgets"' "$AUDIT_LOG" || true)
[ "$watches" -ge 1 ] || fail "no widget watch in $AUDIT_LOG"
grep -q '"user":{"username":"system:serviceaccount:consul-resolver-system:consul-resolver-operator"' "$AUDIT_LOG" \
  || fail "the operator's requests are not in the audit log"

# ---------------------------------------------------------------------------------
say "6. down (twice), up again on the same dir, down"
bash "$CLUSTER" down "$C"
for p in "${SEEN_PIDS[@]}"; do alive "$p" && fail "pid $p still running after down"; done
[ ! -e "$C/etcd.pid" ] && [ ! -e "$C/apiserver.pid" ] || fail "pid files left after down"
bash "$CLUSTER" down "$C"
old_url=$APISERVER_URL
# Each child held a second between fork and exec: still starting, not exited.
CLUSTER_EXEC_DELAY=1 bash "$CLUSTER" up "$C"
# shellcheck disable=SC1090,SC1091
source "$C/env"
SEEN_PIDS+=("$ETCD_PID" "$APISERVER_PID")
expect_eq "URL after restart" "$APISERVER_URL" "$old_url"
expect_eq "Mapping after restart" \
  "$("${K[@]}" --kubeconfig "$KUBECONFIG_ADMIN" get mappings.getambassador.io selftest -n default -o jsonpath='{.spec.prefix}')" \
  "/selftest/"
bash "$CLUSTER" down "$C"

# ---------------------------------------------------------------------------------
say "7. nothing left"
for p in "${SEEN_PIDS[@]}"; do alive "$p" && fail "pid $p still running after down"; done
left=$(procs_under_root)
[ -z "$left" ] || fail "processes from the run still running: $left"
exit 0
