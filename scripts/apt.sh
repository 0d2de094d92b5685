# Debian packages the scripts need, installed only when missing (one `apt-get update` per
# run). Sourced by e2e/cluster.sh and image/build.sh, which define `log`; run directly,
# `bash scripts/apt.sh PACKAGE...` installs the packages (.ci/run).

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

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  log() { printf '[apt] %s\n' "$*" >&2; }
  apt_install "$@"
fi
