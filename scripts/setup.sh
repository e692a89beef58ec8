#!/usr/bin/env bash
# Create .venv (if missing) and install hicache with its dev tools.
# A machine that already has a CUDA torch keeps it: the venv sees system site-packages
# when HICACHE_SYSTEM_TORCH=1, or when `python3 -c 'import torch'` works with CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv (the first setup installs torch and the dev tools: 2-5 min)" >&2
  if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
     || [ "${HICACHE_SYSTEM_TORCH:-0}" = 1 ]; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
quiet_pip() {  # pip's status, without its warnings about package locations it skips
  .venv/bin/pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  # CPU build from local disk where it is offered; any torch >= 2.4 works.
  quiet_pip "torch==2.13.0" || quiet_pip "torch>=2.4"
fi
EXTRAS=dev
if .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  EXTRAS=dev,cuda  # cuda-python: the layered restore's strided DMAs
fi
# Installed once per pyproject.toml and extras (a stamp in .venv): later runs skip pip. A failed
# install stops here with pip's output.
STAMP="$(sha256sum pyproject.toml | cut -c1-16) $EXTRAS"
if [ "$(cat .venv/.hicache-installed 2>/dev/null)" != "$STAMP" ] \
   || ! .venv/bin/python -c 'import hicache, transitions, hypothesis' 2>/dev/null; then
  rm -f .venv/.hicache-installed
  echo "setup: installing hicache into .venv (pip install -e '.[$EXTRAS]')" >&2
  if ! .venv/bin/pip install -q -e ".[$EXTRAS]" >.venv/pip.log 2>&1; then
    grep -v -E "^WARNING: Location" .venv/pip.log >&2 || true
    echo "setup: pip install -e '.[$EXTRAS]' failed (above)" >&2
    exit 1
  fi
  grep -v -E "^WARNING: Location" .venv/pip.log || true
  echo "$STAMP" >.venv/.hicache-installed
fi
.venv/bin/python -c 'import hicache, transitions, hypothesis'
# Mooncake Store for the `mooncake` L3 store and its tests (tests/mooncake): the CPU wheel,
# and the native libraries it loads even for TCP (RDMA verbs, netlink), unpacked from the
# distribution's packages into .venv/mooncake-libs (the tests point LD_LIBRARY_PATH there).
# READY tells the tests that Mooncake is meant to work here: they then fail instead of skip.
# HICACHE_MOONCAKE=0 leaves it out.
install_mooncake() {
  local tmp pkgs="libibverbs1 libnl-3-200 libnl-route-3-200"
  tmp=$(mktemp -d) || return 1
  if ! .venv/bin/pip show -q mooncake-transfer-engine mooncake-transfer-engine-non-cuda >/dev/null 2>&1; then
    .venv/bin/pip install -q --retries 1 --timeout 30 "mooncake-transfer-engine-non-cuda==0.3.13.post1" >"$tmp/pip.log" 2>&1 \
      || { grep -v "^WARNING: Location" "$tmp/pip.log" >&2; rm -rf "$tmp"; return 1; }
  fi
  (cd "$tmp" && apt-get download $pkgs >/dev/null 2>&1) \
    || { [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 && (cd "$tmp" && apt-get download $pkgs >/dev/null); } \
    || { rm -rf "$tmp"; return 1; }
  mkdir -p .venv/mooncake-libs
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" .venv/mooncake-libs || { rm -rf "$tmp"; return 1; }; done
  rm -rf "$tmp"
  touch .venv/mooncake-libs/READY
}
if [ "${HICACHE_MOONCAKE:-1}" = 1 ] && [ ! -e .venv/mooncake-libs/READY ]; then
  install_mooncake || echo "setup: Mooncake could not be installed; the mooncake store tests will skip" >&2
fi
