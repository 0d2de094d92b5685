#!/usr/bin/env bash
# A real Kubernetes control plane on loopback: etcd (Debian's etcd-server) and a
# kube-apiserver built once from Debian's `kubernetes` source package and cached
# outside the repo. One implementation, used by `make demo`, the e2e harness and CI.
#
#   e2e/cluster.sh deps            install the Debian packages it needs (when missing)
#   e2e/cluster.sh build           build kube-apiserver into the cache (when missing)
#   e2e/cluster.sh up DIR          start etcd + kube-apiserver, state and kubeconfigs in DIR
#   e2e/cluster.sh down DIR        stop exactly the processes `up` started (by pid)
#   e2e/cluster.sh env DIR         print the environment a client needs (KUBECONFIG=...)
#   e2e/cluster.sh apiserver-path  print the cached binary's path
set -euo pipefail

KUBE_VERSION=1.20.2
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/consul-resolver-operator"
CACHE_DIR="$CACHE_ROOT/kube-apiserver-$KUBE_VERSION"
APISERVER="$CACHE_DIR/kube-apiserver"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The operator's identity inside the test cluster; manifests/ bind RBAC to it.
OPERATOR_NS=consul-resolver-system
OPERATOR_SA=consul-resolver-operator

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { printf '[cluster] error: %s\n' "$*" >&2; exit 1; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_updated=
apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ -z "$apt_updated" ]; then as_root apt-get update -qq; apt_updated=1; fi
  log "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

cmd_deps() {
  apt_install etcd-server openssl ca-certificates curl
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
  if [ -x "$APISERVER" ]; then log "kube-apiserver $KUBE_VERSION cached at $APISERVER"; return 0; fi
  log "kube-apiserver $KUBE_VERSION is not cached: building it once from Debian's source package"
  log "(about 8-15 minutes on 2 cores; later runs reuse $CACHE_DIR)"
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
  log "building cmd/kube-apiserver (make WHAT=cmd/kube-apiserver, GOPATH mode)"
  local start=$SECONDS
  (
    cd "$src"
    export GO111MODULE=off GOFLAGS=-mod=vendor GOCACHE="$work/gocache" GOPATH="$work/gopath"
    export KUBE_GIT_VERSION="v$KUBE_VERSION" KUBE_GIT_TREE_STATE=clean
    unset GOFLAGS
    make WHAT=cmd/kube-apiserver 2>&1 | sed -u 's/^/[cluster:make] /' >&2
  )
  local built
  built=$(find "$src/_output" -type f -name kube-apiserver -perm -u+x | head -n1)
  [ -n "$built" ] || die "build finished but no kube-apiserver binary was found under $src/_output"
  mkdir -p "$CACHE_DIR"
  cp "$built" "$APISERVER.tmp" && mv "$APISERVER.tmp" "$APISERVER"
  log "built in $((SECONDS - start))s: $APISERVER"
  rm -rf "$work"
}

case "${1:-}" in
  deps) cmd_deps ;;
  build) cmd_deps; cmd_build ;;
  apiserver-path) echo "$APISERVER" ;;
  *) die "usage: $0 deps|build|up DIR|down DIR|env DIR|apiserver-path" ;;
esac
