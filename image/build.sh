#!/usr/bin/env bash
# The operator's container image (Containerfile at the repository root), built without
# pulling anything: a static release build of the binary on the host, a build context of
# exactly the files the image holds, and `podman build` (or `buildah bud`) FROM scratch.
#
#   image/build.sh deps     install podman and runc from Debian (when missing)
#   image/build.sh binary   the static release binary (cached under target/); prints its path
#   image/build.sh build    binary + context + image; IMAGE=name:tag overrides the name
#
# The image is named consul-resolver-operator:VERSION (the crate's version, as printed by
# the binary's `version`), the name manifests/deployment.yaml runs.
#
# The binary is linked statically against glibc (-C target-feature=+crt-static, the
# machine's own x86_64-unknown-linux-gnu target: no musl toolchain is needed) so it runs
# with no loader or libraries in the image. TLS is rustls with ring (no OpenSSL); name
# resolution is glibc's getaddrinfo, whose `files` and `dns` modules are built into glibc
# 2.34+ and so into the static binary; the image's /etc/nsswitch.conf selects them.
# The build uses its own directory, target/<triple>/release, and is incremental like any
# cargo build: a second `make image` with no source change takes seconds.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
CONTEXT="$TARGET_DIR/image/context"
# The non-root user the image runs as (the Deployment's runAsUser/runAsGroup too).
IMAGE_UID=65532

log() { printf '[image] %s\n' "$*" >&2; }
die() { printf '[image] error: %s\n' "$*" >&2; exit 1; }

# as_root, apt_install
source "$REPO_ROOT/scripts/apt.sh"

# podman builds the image; runc runs it in the image test where crun cannot (crun refuses
# a host whose cgroups are mounted in hybrid v1/v2 mode, as on some CI sandboxes).
# ca-certificates provides the bundle the image carries; binutils' readelf checks that
# the binary is static.
cmd_deps() {
  apt_install podman runc ca-certificates binutils
}

host_triple() { rustc -vV | sed -n 's/^host: //p'; }

cmd_binary() {
  local triple bin
  triple=$(host_triple)
  [ -n "$triple" ] || die "cannot tell the host's target triple from rustc -vV"
  log "static release build for $triple (the first one takes several minutes)"
  # RUSTFLAGS with an explicit --target apply to the binary and its dependencies only,
  # not to build scripts and proc macros (which must stay dynamic to be loaded). Always
  # the same value, so cargo reuses the previous build.
  (cd "$REPO_ROOT" && CARGO_INCREMENTAL=0 RUSTFLAGS='-C target-feature=+crt-static' \
    "${CARGO:-cargo}" build --release --locked --target "$triple" --bin consul-resolver-operator >&2)
  bin="$TARGET_DIR/$triple/release/consul-resolver-operator"
  [ -x "$bin" ] || die "the build left no binary at $bin"
  # A dynamic binary would need a loader and libraries that FROM scratch does not have.
  if readelf -l "$bin" | grep -q 'Requesting program interpreter'; then
    die "$bin is dynamically linked: it cannot run in the scratch image"
  fi
  echo "$bin"
}

# The build context: exactly the files the image holds, with their modes (COPY keeps the
# modes and makes root the owner, so the non-root user cannot change any of them).
stage_context() {
  local bin=$1 ca=/etc/ssl/certs/ca-certificates.crt
  [ -s "$ca" ] || die "$ca is missing: install ca-certificates (image/build.sh deps)"
  rm -rf "$CONTEXT"
  mkdir -p "$CONTEXT/etc/ssl/certs"
  install -m 0755 "$bin" "$CONTEXT/consul-resolver-operator"
  # Symbols only serve backtraces; the panic message and location are kept without them.
  strip --strip-all "$CONTEXT/consul-resolver-operator"
  install -m 0644 "$ca" "$CONTEXT/etc/ssl/certs/ca-certificates.crt"
  printf 'root:x:0:0:root:/:/sbin/nologin\nnonroot:x:%s:%s:nonroot:/:/sbin/nologin\n' "$IMAGE_UID" "$IMAGE_UID" >"$CONTEXT/etc/passwd"
  printf 'root:x:0:\nnonroot:x:%s:\n' "$IMAGE_UID" >"$CONTEXT/etc/group"
  # Without this file glibc tries DNS before /etc/hosts; Kubernetes writes both.
  printf 'hosts: files dns\n' >"$CONTEXT/etc/nsswitch.conf"
  chmod 0644 "$CONTEXT/etc/passwd" "$CONTEXT/etc/group" "$CONTEXT/etc/nsswitch.conf"
}

cmd_build() {
  local bin version image builder epoch
  bin=$(cmd_binary)
  version=$("$bin" version | awk '{print $2}')
  [ -n "$version" ] || die "$bin version printed no version"
  image="${IMAGE:-consul-resolver-operator:$version}"
  stage_context "$bin"
  # The commit's time as the image's creation time: the same commit and binary give the
  # same image id.
  epoch=$(git -C "$REPO_ROOT" log -1 --format=%ct 2>/dev/null || echo 0)
  if command -v podman >/dev/null; then builder=(podman build)
  elif command -v buildah >/dev/null; then builder=(buildah bud)
  else die "neither podman nor buildah is installed (image/build.sh deps installs podman)"; fi
  log "building $image with ${builder[*]}"
  local previous="" id
  if [ "${builder[0]}" = podman ]; then previous=$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true); fi
  id=$("${builder[@]}" --quiet --layers=false --timestamp "$epoch" --build-arg "VERSION=$version" \
    --file "$REPO_ROOT/Containerfile" --tag "$image" "$CONTEXT")
  # The image this tag named before is left with no name: remove it (only it) rather than
  # let each rebuild leave one behind. It stays if a container still uses it.
  if [ -n "$previous" ] && [ "$previous" != "$id" ]; then podman rmi "$previous" >/dev/null 2>&1 || true; fi
  log "built $image ($(du -sh "$CONTEXT" | cut -f1) of files)"
  echo "$image"
}

case "${1:-}" in
  deps) cmd_deps ;;
  binary) cmd_binary ;;
  build) cmd_build ;;
  *) die "usage: $0 deps|binary|build" ;;
esac
