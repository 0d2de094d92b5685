#!/usr/bin/env bash
# A real Kubernetes control plane on loopback: etcd (Debian's etcd-server) and a
# kube-apiserver built once from Debian's `kubernetes` source package and cached
# outside the repo. One implementation, used by `make demo`, the e2e harness and CI.
# The same build also makes kube-proxy (same version), which e2e/tests/kube_proxy.rs
# runs in iptables mode inside a network namespace of its own, and kube-controller-manager,
# which the export tests that need the real garbage collector, namespace and EndpointSlice
# mirroring controllers run (`controller-manager DIR`).
#
#   e2e/cluster.sh deps            install the Debian packages it needs (when missing)
#   e2e/cluster.sh build           build kube-apiserver, kube-proxy and kube-controller-manager
#                                  into the cache (when any is missing: one `make` builds all)
#   e2e/cluster.sh up DIR          start etcd + kube-apiserver, state and kubeconfigs in DIR
#   e2e/cluster.sh down DIR        stop exactly the processes `up` started (by pid)
#   e2e/cluster.sh env DIR         print the environment a client needs (KUBECONFIG=...)
#   e2e/cluster.sh apiserver DIR [PORT]
#                                  start kube-apiserver again for the running etcd of DIR (after
#                                  a test killed it), on PORT or the port of `up`, and only there
#   e2e/cluster.sh apiserver-path  print the cached kube-apiserver's path
#   e2e/cluster.sh kube-proxy-path print the cached kube-proxy's path (it may not exist yet:
#                                  callers test it, `build` makes it)
#   e2e/cluster.sh controller-manager-path
#                                  print the cached kube-controller-manager's path (likewise)
#
# `up DIR` leaves in DIR (absolute paths; DIR is created if missing):
#   admin.kubeconfig     user admin (group system:masters), bearer token from tokens.csv
#   operator.kubeconfig  ServiceAccount consul-resolver-system/consul-resolver-operator,
#                        a 24h TokenRequest token, bound only by manifests/rbac.yaml
#   env                  shell-sourceable: KUBECONFIG_ADMIN KUBECONFIG_OPERATOR
#                        APISERVER_URL APISERVER_PORT APISERVER_CA APISERVER_PID
#                        ETCD_URL ETCD_PORT ETCD_PEER_PORT ETCD_PID AUDIT_LOG CLUSTER_DIR
#   etcd.pid apiserver.pid etcd.log apiserver.log
#   audit.log            every request at Metadata level, one JSON object a line
#   pki/apiserver.crt    self-signed CA + serving cert (the kubeconfigs' CA)
#   etcd/ sa.key sa.pub tokens.csv audit-policy.yaml
# Both kubeconfigs verify TLS against pki/apiserver.crt. `down DIR` keeps the state:
# `up DIR` again restarts the same cluster (same objects and admin token, same ports
# when still free). No kube-controller-manager runs (tests that need one start their own,
# `controller-manager-path`): no garbage collection of ownerReferences, no namespace
# deletion (namespaces stay Terminating), no default ServiceAccounts. The apiserver is
# 1.20: EndpointSlices are discovery.k8s.io/v1beta1.
#
# Environment: CLUSTER_UP_TIMEOUT (s, default 90), CLUSTER_DOWN_TIMEOUT (s, default 20),
# CLUSTER_APISERVER_BIN / CLUSTER_ETCD_BIN (override the binaries; used by the self-test).
set -euo pipefail

KUBE_VERSION=1.20.2
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/consul-resolver-operator"
CACHE_DIR="$CACHE_ROOT/kube-apiserver-$KUBE_VERSION"
APISERVER="$CACHE_DIR/kube-apiserver"
# Its own directory, so the apiserver's path stays what machines already have cached.
PROXY_CACHE_DIR="$CACHE_ROOT/kube-proxy-$KUBE_VERSION"
KUBE_PROXY="$PROXY_CACHE_DIR/kube-proxy"
CM_CACHE_DIR="$CACHE_ROOT/kube-controller-manager-$KUBE_VERSION"
KUBE_CM="$CM_CACHE_DIR/kube-controller-manager"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The operator's identity inside the test cluster; manifests/ bind RBAC to it.
OPERATOR_NS=consul-resolver-system
OPERATOR_SA=consul-resolver-operator

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { printf '[cluster] error: %s\n' "$*" >&2; exit 1; }

# as_root, apt_install
source "$REPO_ROOT/scripts/apt.sh"

cmd_deps() {
  # iptables: kube-proxy's iptables mode runs iptables-save/-restore (whichever backend
  # the alternatives system selects; Debian's default is nft). conntrack: kube-proxy
  # runs it to flush stale UDP entries. iproute2 (`ip netns`) and curl: the kube-proxy
  # test's network namespace and its requests from inside it.
  apt_install etcd-server openssl ca-certificates curl iptables conntrack iproute2
  command -v kubectl >/dev/null || apt_install kubernetes-client
}

# Debian's archive serves the source package too, but only with a deb-src entry.
ensure_deb_src() {
  if apt-get source --print-uris kubernetes >/dev/null 2>&1; then return 0; fi
  log "adding a deb-src entry for the machine's own Debian archive"
  local f=/etc/apt/sources.list.d/consul-resolver-operator-src.sources
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    # Same URIs/suites as the binary entries, Types: deb-src.
    sed -e 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources | as_root tee "$f" >/dev/null
  else
    grep -E '^deb ' /etc/apt/sources.list | sed 's/^deb /deb-src /' | as_root tee /etc/apt/sources.list.d/consul-resolver-operator-src.list >/dev/null
  fi
  as_root apt-get update -qq
  apt_updated=1
}

cmd_build() {
  if [ -x "$APISERVER" ] && [ -x "$KUBE_PROXY" ] && [ -x "$KUBE_CM" ]; then
    log "kube-apiserver $KUBE_VERSION cached at $APISERVER"
    log "kube-proxy $KUBE_VERSION cached at $KUBE_PROXY"
    log "kube-controller-manager $KUBE_VERSION cached at $KUBE_CM"
    return 0
  fi
  # Any missing: build all in one `make`, so the packages they share (client-go,
  # apimachinery, ...) compile once. The Go cache is deleted after a build, so building
  # only the missing one would cost about as much; a machine that cached some of them
  # before the others were added pays one full build, once.
  log "kube-apiserver, kube-proxy and kube-controller-manager $KUBE_VERSION are not all cached: building them once from Debian's source package"
  log "(about 10-20 minutes on 2 cores; later runs reuse $CACHE_ROOT)"
  apt_install golang-go rsync dpkg-dev golang-github-modern-go-reflect2-dev
  ensure_deb_src
  local work="$CACHE_ROOT/build-$KUBE_VERSION"
  rm -rf "$work"; mkdir -p "$work"
  log "fetching the source package (apt-get source kubernetes)"
  (cd "$work" && apt-get source -qq --download-only kubernetes >/dev/null && dpkg-source -x --skip-patches kubernetes_*.dsc src >/dev/null 2>&1 || dpkg-source -x kubernetes_*.dsc src >/dev/null)
  local src="$work/src"
  [ -d "$src/vendor" ] || die "unexpected source layout in $src (no vendor/)"
  # reflect2 v1.0.1 (vendored) breaks under Go 1.18+: the apiserver segfaults the
  # first time it encodes a custom resource. Debian ships 1.0.2; use its files.
  log "replacing vendor/github.com/modern-go/reflect2 with Debian's 1.0.2"
  rm -rf "$src/vendor/github.com/modern-go/reflect2"
  mkdir -p "$src/vendor/github.com/modern-go/reflect2"
  cp -r /usr/share/gocode/src/github.com/modern-go/reflect2/. "$src/vendor/github.com/modern-go/reflect2/"
  local what="cmd/kube-apiserver cmd/kube-proxy cmd/kube-controller-manager"
  # providerless: no cloud provider is compiled in (the controller manager's would be
  # most of its size and build time; none runs on loopback).
  log "building $what (make WHAT=\"$what\" GOFLAGS=-tags=providerless, GOPATH mode)"
  local start=$SECONDS
  (
    cd "$src"
    export GO111MODULE=off GOCACHE="$work/gocache" GOPATH="$work/gopath"
    export KUBE_GIT_VERSION="v$KUBE_VERSION" KUBE_GIT_TREE_STATE=clean
    export GOFLAGS=-tags=providerless
    make WHAT="$what" 2>&1 | sed -u 's/^/[cluster:make] /' >&2
  )
  local api_built proxy_built cm_built
  api_built=$(find "$src/_output" -type f -name kube-apiserver -perm -u+x | head -n1)
  proxy_built=$(find "$src/_output" -type f -name kube-proxy -perm -u+x | head -n1)
  cm_built=$(find "$src/_output" -type f -name kube-controller-manager -perm -u+x | head -n1)
  [ -n "$api_built" ] || die "build finished but no kube-apiserver binary was found under $src/_output"
  [ -n "$proxy_built" ] || die "build finished but no kube-proxy binary was found under $src/_output"
  [ -n "$cm_built" ] || die "build finished but no kube-controller-manager binary was found under $src/_output"
  mkdir -p "$CACHE_DIR" "$PROXY_CACHE_DIR" "$CM_CACHE_DIR"
  # Each copied under a temporary name and renamed: a binary in the cache is always complete,
  # and a process running from the old file keeps it.
  cp "$api_built" "$APISERVER.tmp" && mv "$APISERVER.tmp" "$APISERVER"
  cp "$proxy_built" "$KUBE_PROXY.tmp" && mv "$KUBE_PROXY.tmp" "$KUBE_PROXY"
  cp "$cm_built" "$KUBE_CM.tmp" && mv "$KUBE_CM.tmp" "$KUBE_CM"
  log "built in $((SECONDS - start))s: $APISERVER $KUBE_PROXY $KUBE_CM"
  rm -rf "$work"
}

# ---------------------------------------------------------------------------------
# up / down / env
# ---------------------------------------------------------------------------------
# Overridable for tests of this script itself (the self-test uses /bin/false to prove
# that a half-way `up` stops what it started).
APISERVER_BIN="${CLUSTER_APISERVER_BIN:-$APISERVER}"
ETCD_BIN="${CLUSTER_ETCD_BIN:-/usr/bin/etcd}"
# Seconds to wait for etcd / the apiserver to answer health checks.
UP_TIMEOUT="${CLUSTER_UP_TIMEOUT:-90}"
# Seconds `down` waits after SIGTERM before SIGKILL.
DOWN_TIMEOUT="${CLUSTER_DOWN_TIMEOUT:-20}"

abs_dir() { mkdir -p "$1" && (cd "$1" && pwd); }

# N distinct free loopback TCP ports, all bound at once so they differ. Another
# process may still grab one before we use it: callers retry on "address in use".
free_ports() {
  python3 - "$1" <<'PY_EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
for s in socks:
    s.close()
PY_EOF
}

# pid_running PID: the process exists and is not a zombie, whatever it runs.
pid_running() {
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)
  [ -n "$state" ] && [ "$state" != Z ]
}

# Is PID alive (not a zombie) and does its command line contain MARKER? The marker
# is a flag naming this cluster's DIR, so a recycled pid is never mistaken for ours.
pid_is_ours() {
  local pid=$1 marker=$2
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] && pid_running "$pid" || return 1
  local args; args=$(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null || true)
  grep -qxF -- "$marker" <<<"$args"
}

# The marker flag each process carries (see pid_is_ours).
etcd_marker() { printf -- '--data-dir=%s/etcd' "$1"; }
apiserver_marker() { printf -- '--cert-dir=%s/pki' "$1"; }

# stop_pid NAME PIDFILE MARKER: TERM, wait up to DOWN_TIMEOUT, then KILL.
stop_pid() {
  local name=$1 pidfile=$2 marker=$3 pid deadline
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile" 2>/dev/null || true)
  if pid_is_ours "$pid" "$marker"; then
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + DOWN_TIMEOUT))
    while pid_is_ours "$pid" "$marker" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    if pid_is_ours "$pid" "$marker"; then
      log "$name (pid $pid) ignored SIGTERM for ${DOWN_TIMEOUT}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      deadline=$((SECONDS + 10))
      while pid_is_ours "$pid" "$marker" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
      pid_is_ours "$pid" "$marker" && die "$name (pid $pid) survived SIGKILL"
    fi
  fi
  rm -f "$pidfile"
}

cmd_down() {
  [ -n "${1:-}" ] || die "usage: $0 down DIR"
  [ -d "$1" ] || { log "$1 does not exist: nothing to stop"; return 0; }
  local dir; dir=$(cd "$1" && pwd)
  stop_pid kube-apiserver "$dir/apiserver.pid" "$(apiserver_marker "$dir")"
  stop_pid etcd "$dir/etcd.pid" "$(etcd_marker "$dir")"
}

cmd_env() {
  [ -n "${1:-}" ] || die "usage: $0 env DIR"
  local dir; dir=$(cd "$1" && pwd)
  [ -f "$dir/env" ] || die "$dir/env not found: run \`$0 up $dir\` first"
  printf 'export KUBECONFIG=%q\n' "$dir/admin.kubeconfig"
  sed -n 's/^\([A-Z_][A-Z0-9_]*=\)/export \1/p' "$dir/env"
}

log_tail() { [ -f "$1" ] && { printf -- '----- last lines of %s -----\n' "$1"; tail -n "${2:-40}" "$1"; printf -- '-----\n'; } >&2 || true; }

# start_bg PIDFILE LOGFILE CMD...: start CMD detached from our stdio (so a caller
# reading our output through a pipe is not kept waiting) and record its pid.
# CLUSTER_EXEC_DELAY (seconds; the self-test sets it) holds the child between fork and
# exec, the window wait_ready must not mistake for an exit.
start_bg() {
  local pidfile=$1 logfile=$2; shift 2
  if [ -n "${CLUSTER_EXEC_DELAY:-}" ]; then
    (sleep "$CLUSTER_EXEC_DELAY"; exec "$@") </dev/null >>"$logfile" 2>&1 &
  else
    "$@" </dev/null >>"$logfile" 2>&1 &
  fi
  echo $! >"$pidfile"
}

# wait_ready NAME PID LOGFILE CHECK...: poll CHECK until it succeeds. Returns 0
# when ready, 2 when the process died because its port was taken, dies otherwise.
wait_ready() {
  local name=$1 pid=$2 logfile=$3; shift 3
  local deadline=$((SECONDS + UP_TIMEOUT))
  while :; do
    if "$@" >/dev/null 2>&1; then return 0; fi
    # Our own child, just started: until it has exec'd, its command line is still this
    # script's (no marker), so only its end counts as an exit. (A busy machine once ran
    # the first check inside that window: "exited during startup" with an empty log.)
    if ! pid_running "$pid"; then
      if grep -q 'address already in use' "$logfile" 2>/dev/null; then return 2; fi
      log_tail "$logfile"
      die "$name (pid $pid) exited during startup; its log is $logfile"
    fi
    if [ $SECONDS -ge $deadline ]; then
      log_tail "$logfile"
      die "$name did not become ready within ${UP_TIMEOUT}s; its log is $logfile"
    fi
    sleep 0.3
  done
}

etcd_healthy() { [[ "$(curl -fsS --max-time 2 "http://127.0.0.1:$1/health")" == *'"health":"true"'* ]]; }
apiserver_ready() {
  # /readyz exists on 1.20 and includes the post-start hooks (RBAC bootstrap roles,
  # CRD informers), so "ok" means cluster-admin and CRD endpoints are usable.
  [ "$(curl -sS --max-time 3 --cacert "$2" -H "Authorization: Bearer $3" "https://127.0.0.1:$1/readyz")" = ok ]
}

# Write a kubeconfig: FILE SERVER CA_FILE USER TOKEN NAMESPACE
write_kubeconfig() {
  local file=$1 server=$2 ca=$3 user=$4 token=$5 ns=$6 ca_line
  ca_line="certificate-authority-data: $(base64 -w0 "$ca")"
  (umask 077; : >"$file.tmp")
  cat >"$file.tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: consul-resolver-e2e
  cluster:
    server: $server
    $ca_line
users:
- name: $user
  user:
    token: $token
contexts:
- name: $user@consul-resolver-e2e
  context:
    cluster: consul-resolver-e2e
    user: $user
    namespace: $ns
current-context: $user@consul-resolver-e2e
EOF
  mv "$file.tmp" "$file"
}

# State that survives `down`: etcd data, keys, tokens. `up` on the same DIR again
# restarts the same cluster (same objects, same admin token, same ports if free).
prepare_state() {
  local dir=$1
  mkdir -p "$dir/pki" "$dir/etcd"
  chmod 700 "$dir/etcd" "$dir/pki"
  if [ ! -s "$dir/sa.key" ]; then
    openssl genrsa -out "$dir/sa.key.tmp" 2048 2>/dev/null
    openssl rsa -in "$dir/sa.key.tmp" -pubout -out "$dir/sa.pub" 2>/dev/null
    chmod 600 "$dir/sa.key.tmp"; mv "$dir/sa.key.tmp" "$dir/sa.key"
  fi
  if [ ! -s "$dir/tokens.csv" ]; then
    # token,user,uid,"groups"
    (umask 077; printf '%s,admin,admin,"system:masters"\n' "$(openssl rand -hex 32)" >"$dir/tokens.csv")
  fi
  # Every request at Metadata level. RequestReceived is omitted, so each request
  # logs one "ResponseComplete" event. A watch is logged only when it ends: 1.20 writes
  # its "ResponseStarted" together with its "ResponseComplete", not when it begins.
  # So a running watch shows as the list its watcher made just before it (same field
  # selector), and every watch shows once the operator has exited. Tests count from this.
  cat >"$dir/audit-policy.yaml" <<'EOF'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
EOF
}

# A value from a previous `up`'s DIR/env ("" when there is none).
env_value() { [ -f "$1/env" ] || return 0; sed -n "s/^$2=//p" "$1/env" | head -n1; }

start_etcd() {
  local dir=$1 attempt client peer rc
  for attempt in 1 2 3 4 5; do
    client= peer=
    if [ "$attempt" = 1 ]; then client=$(env_value "$dir" ETCD_PORT); peer=$(env_value "$dir" ETCD_PEER_PORT); fi
    if [ -z "$client" ] || [ -z "$peer" ]; then read -r client peer < <(free_ports 2); fi
    log "starting etcd on 127.0.0.1:$client (peer $peer), data in $dir/etcd"
    start_bg "$dir/etcd.pid" "$dir/etcd.log" "$ETCD_BIN" \
      --name=default \
      "$(etcd_marker "$dir")" \
      --listen-client-urls="http://127.0.0.1:$client" \
      --advertise-client-urls="http://127.0.0.1:$client" \
      --listen-peer-urls="http://127.0.0.1:$peer" \
      --initial-advertise-peer-urls="http://127.0.0.1:$peer" \
      --initial-cluster="default=http://127.0.0.1:$peer" \
      --initial-cluster-state=new \
      --logger=zap --log-outputs=stderr --log-level=warn
    rc=0; wait_ready etcd "$(cat "$dir/etcd.pid")" "$dir/etcd.log" etcd_healthy "$client" || rc=$?
    if [ $rc = 0 ]; then ETCD_PORT=$client ETCD_PEER_PORT=$peer; return 0; fi
    log "etcd: port taken, retrying with other ports"
  done
  die "etcd: could not get free ports after 5 attempts"
}

# start_apiserver DIR [PORT]: on PORT only when given (a restart: the kubeconfigs name it),
# else on the port of a previous `up`, else on free ports.
start_apiserver() {
  local dir=$1 forced=${2:-} attempt port rc token
  token=$(cut -d, -f1 "$dir/tokens.csv")
  for attempt in 1 2 3 4 5; do
    port=$forced
    if [ -z "$port" ] && [ "$attempt" = 1 ]; then port=$(env_value "$dir" APISERVER_PORT); fi
    [ -n "$port" ] || port=$(free_ports 1)
    log "starting kube-apiserver $KUBE_VERSION on https://127.0.0.1:$port"
    start_bg "$dir/apiserver.pid" "$dir/apiserver.log" "$APISERVER_BIN" \
      "$(apiserver_marker "$dir")" \
      --bind-address=127.0.0.1 \
      --advertise-address=127.0.0.1 \
      --secure-port="$port" \
      --insecure-port=0 \
      --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
      --token-auth-file="$dir/tokens.csv" \
      --authorization-mode=RBAC \
      --service-account-key-file="$dir/sa.pub" \
      --service-account-signing-key-file="$dir/sa.key" \
      --service-account-issuer=https://kubernetes.default.svc.cluster.local \
      --service-cluster-ip-range=10.0.0.0/24 \
      --allow-privileged=true \
      --audit-policy-file="$dir/audit-policy.yaml" \
      --audit-log-path="$dir/audit.log" \
      --audit-log-mode=blocking \
      --endpoint-reconciler-type=none \
      --disable-admission-plugins=ServiceAccount \
      --enable-admission-plugins=OwnerReferencesPermissionEnforcement \
      --profiling=false
    # Why these:
    #  --insecure-port=0: 1.20 still opens an unauthenticated port (8080) by default.
    #  --endpoint-reconciler-type=none: the "kubernetes" Service's Endpoints cannot
    #    hold a loopback address; the reconciler would log errors forever.
    #  --disable-admission-plugins=ServiceAccount: no kube-controller-manager runs, so
    #    no namespace ever gets its "default" ServiceAccount (nor legacy token Secrets)
    #    and this plugin would reject every Pod. Tokens come from the TokenRequest API.
    #  --enable-admission-plugins=OwnerReferencesPermissionEnforcement: on by default in
    #    OpenShift and OKD. Setting an owner reference then needs `delete` on the object,
    #    and `blockOwnerDeletion` needs `update` on the owner's finalizers: the operator's
    #    writes are tested against what such clusters enforce.
    #  --audit-log-mode=blocking: an event is on disk before the response is sent, so
    #    tests can read the audit log right after a request without racing a buffer.
    rc=0; wait_ready kube-apiserver "$(cat "$dir/apiserver.pid")" "$dir/apiserver.log" \
      apiserver_ready "$port" "$dir/pki/apiserver.crt" "$token" || rc=$?
    if [ $rc = 0 ]; then APISERVER_PORT=$port; return 0; fi
    [ -z "$forced" ] || die "kube-apiserver: port $forced is taken"
    log "kube-apiserver: port taken, retrying with another port"
  done
  die "kube-apiserver: could not get a free port after 5 attempts"
}

cmd_up() {
  [ -n "${1:-}" ] || die "usage: $0 up DIR"
  local dir; dir=$(abs_dir "$1")
  [ -x "$APISERVER_BIN" ] || die "no kube-apiserver at $APISERVER_BIN: run \`$0 build\` first"
  [ -x "$ETCD_BIN" ] || die "no etcd at $ETCD_BIN: run \`$0 deps\` first"
  if pid_is_ours "$(cat "$dir/etcd.pid" 2>/dev/null || true)" "$(etcd_marker "$dir")" ||
     pid_is_ours "$(cat "$dir/apiserver.pid" 2>/dev/null || true)" "$(apiserver_marker "$dir")"; then
    die "a cluster is already running in $dir: run \`$0 down $dir\` first"
  fi
  # From here on, a failure (or Ctrl-C) stops whatever this call started.
  UP_DIR=$dir
  trap 'rc=$?; trap - EXIT; if [ $rc -ne 0 ]; then log "up failed: stopping what it started"; cmd_down "$UP_DIR" || true; fi; exit $rc' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  local start=$SECONDS
  prepare_state "$dir"
  start_etcd "$dir"
  # Without --tls-cert-file the apiserver writes a self-signed CA + serving cert
  # (SANs include 127.0.0.1) to pki/apiserver.crt; the bundle verifies its own
  # serving cert, so clients embed it as their CA. Regenerated only if missing.
  start_apiserver "$dir"
  local url="https://127.0.0.1:$APISERVER_PORT" ca="$dir/pki/apiserver.crt" token
  token=$(cut -d, -f1 "$dir/tokens.csv")
  write_kubeconfig "$dir/admin.kubeconfig" "$url" "$ca" admin "$token" default

  local k=(kubectl --kubeconfig "$dir/admin.kubeconfig" --request-timeout=30s)
  log "applying manifests/namespace.yaml and manifests/rbac.yaml"
  "${k[@]}" apply -f "$REPO_ROOT/manifests/namespace.yaml" >/dev/null
  "${k[@]}" apply -f "$REPO_ROOT/manifests/rbac.yaml" >/dev/null

  # A bound ServiceAccount token from the TokenRequest API (kubectl >= 1.24).
  local sa_token
  sa_token=$("${k[@]}" create token "$OPERATOR_SA" -n "$OPERATOR_NS" --duration=24h)
  [ -n "$sa_token" ] || die "TokenRequest returned an empty token"
  write_kubeconfig "$dir/operator.kubeconfig" "$url" "$ca" "$OPERATOR_SA" "$sa_token" "$OPERATOR_NS"
  # The token must authenticate as the ServiceAccount and be bound by its RBAC.
  # (Core resources only: `kubectl auth can-i` on a custom resource whose CRD is not
  # installed yet loses the API group and answers "no".)
  local ko=(kubectl --kubeconfig "$dir/operator.kubeconfig" --request-timeout=30s)
  [ "$("${ko[@]}" auth can-i list endpoints --all-namespaces 2>/dev/null || true)" = yes ] ||
    die "operator.kubeconfig cannot list endpoints: ServiceAccount token or RBAC broken"
  [ "$("${ko[@]}" auth can-i list secrets --all-namespaces 2>/dev/null || true)" = no ] ||
    die "operator.kubeconfig may list every Secret: RBAC is wider than manifests/rbac.yaml"
  [ "$("${ko[@]}" auth can-i create deployments.apps -n "$OPERATOR_NS" 2>/dev/null || true)" = no ] ||
    die "operator.kubeconfig may create deployments: RBAC is wider than manifests/rbac.yaml"

  {
    printf 'KUBECONFIG_ADMIN=%q\n' "$dir/admin.kubeconfig"
    printf 'KUBECONFIG_OPERATOR=%q\n' "$dir/operator.kubeconfig"
    printf 'APISERVER_URL=%q\n' "$url"
    printf 'APISERVER_PORT=%q\n' "$APISERVER_PORT"
    printf 'APISERVER_CA=%q\n' "$ca"
    printf 'APISERVER_PID=%q\n' "$(cat "$dir/apiserver.pid")"
    printf 'ETCD_URL=%q\n' "http://127.0.0.1:$ETCD_PORT"
    printf 'ETCD_PORT=%q\n' "$ETCD_PORT"
    printf 'ETCD_PEER_PORT=%q\n' "$ETCD_PEER_PORT"
    printf 'ETCD_PID=%q\n' "$(cat "$dir/etcd.pid")"
    printf 'AUDIT_LOG=%q\n' "$dir/audit.log"
    printf 'CLUSTER_DIR=%q\n' "$dir"
  } >"$dir/env.tmp"
  mv "$dir/env.tmp" "$dir/env"
  trap - EXIT INT TERM
  log "up in $((SECONDS - start))s: $url (source <($0 env $dir))"
}

# The kube-apiserver of DIR again, for its running etcd: tests kill it to see clients
# survive. The pid file and DIR/env follow the new process.
cmd_apiserver() {
  [ -n "${1:-}" ] || die "usage: $0 apiserver DIR [PORT]"
  local dir; dir=$(cd "$1" && pwd)
  [ -f "$dir/env" ] || die "$dir/env not found: run \`$0 up $dir\` first"
  pid_is_ours "$(cat "$dir/etcd.pid" 2>/dev/null || true)" "$(etcd_marker "$dir")" || die "the etcd of $dir is not running"
  pid_is_ours "$(cat "$dir/apiserver.pid" 2>/dev/null || true)" "$(apiserver_marker "$dir")" &&
    die "the kube-apiserver of $dir is running: stop it first"
  ETCD_PORT=$(env_value "$dir" ETCD_PORT)
  start_apiserver "$dir" "${2:-$(env_value "$dir" APISERVER_PORT)}"
  sed -i "s/^APISERVER_PID=.*/APISERVER_PID=$(cat "$dir/apiserver.pid")/" "$dir/env"
  log "kube-apiserver up again on https://127.0.0.1:$APISERVER_PORT"
}

case "${1:-}" in
  deps) cmd_deps ;;
  build) cmd_deps; cmd_build ;;
  apiserver-path) echo "$APISERVER" ;;
  kube-proxy-path) echo "$KUBE_PROXY" ;;
  controller-manager-path) echo "$KUBE_CM" ;;
  up) shift; cmd_up "$@" ;;
  down) shift; cmd_down "$@" ;;
  env) shift; cmd_env "$@" ;;
  apiserver) shift; cmd_apiserver "$@" ;;
  *) die "usage: $0 deps|build|up DIR|down DIR|env DIR|apiserver DIR [PORT]|apiserver-path|kube-proxy-path|controller-manager-path" ;;
esac
