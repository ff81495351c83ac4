#!/usr/bin/env bash
# `make lmcache`: kvtier's LMCache L2 adapter (connector/lmcache_l2, issue #48) tested inside
# LMCache itself, with real Redis (the machine's standalone one and a Redis Cluster the tests
# start) and LMCache's own objects, plugin loader and MP server.
#
# How it is installed, the lightest way that works on a CPU box: .venv-lmcache is a venv that
# sees .venv's packages (a .pth running site.addsitedir, so kvtier's editable install is seen
# too), plus the lmcache wheel installed with --no-deps: its own dependencies that matter here
# (torch CPU, pyzmq, fastapi, uvicorn, redis, msgspec, ...) are .venv's; the rest it names
# (cupy-cuda13x, cuda-python, cufile, nvtx, cloud SDKs) are for GPUs and clouds and are never
# imported on this path. LMCache's pinned Prometheus exporter (its MP server imports it; it brings
# LMCache's OpenTelemetry 1.40 pins into this venv only). valkey-glide-sync is added for LMCache's own `valkey` adapter, a peer in
# benchmarks/bench_lmcache_l2.py. LMCache is never a dependency of kvtier. Idempotent: a stamp
# keyed on this script, the version and .venv.
#
#   LMCACHE_VERSION=0.5.6        the release to test
#   LMCACHE_FIND_LINKS=/dir      install the wheels from this folder, not the index
#   LMCACHE_VENV_ONLY=1          build the venv and stop (what `make bench` needs)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${LMCACHE_VERSION:-0.5.6}
GLIDE=valkey-glide-sync==2.5.3
# lmcache.v1.storage_backend (which its valkey adapter imports) imports these two at load.
AIOFILE="aiofile aiofiles"
# LMCache's MP server, started as its users start it (observability on), imports this one.
OTEL="opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0"
VENV=.venv-lmcache

[ -x .venv/bin/python ] || bash scripts/bootstrap.sh

base_site=$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
stamp="$VENV/.kvtier-lmcache-$( (cat scripts/lmcache.sh; echo "$VERSION $GLIDE $OTEL $AIOFILE $base_site") |
  sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[lmcache] building $VENV: lmcache $VERSION (--no-deps) over .venv's packages" >&2
  rm -rf "$VENV"
  "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv "$VENV"
  site_dir=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  echo "import site; site.addsitedir('$base_site')" > "$site_dir/kvtier-base-venv.pth"
  "$VENV/bin/python" -m pip install -q --no-deps \
    ${LMCACHE_FIND_LINKS:+--no-index --find-links "$LMCACHE_FIND_LINKS"} "lmcache==$VERSION"
  "$VENV/bin/python" -m pip install -q \
    ${LMCACHE_FIND_LINKS:+--no-index --find-links "$LMCACHE_FIND_LINKS"} "$GLIDE" "$OTEL" $AIOFILE
  touch "$stamp"
fi

[ -z "${LMCACHE_VENV_ONLY:-}" ] || exit 0

export LMCACHE_DISABLE_BANNER=1 LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}

# The version, read without importing lmcache; and a check that it is the venv's own.
"$VENV/bin/python" - "$VERSION" "$VENV" <<'EOF'
import importlib.metadata as md
import importlib.util
import os
import sys

want, venv = sys.argv[1], os.path.realpath(sys.argv[2])
found = os.path.realpath(importlib.util.find_spec("lmcache").origin)
if not found.startswith(venv + os.sep) or md.version("lmcache") != want:
    sys.exit(f"[lmcache] {venv} imports lmcache from {found} ({md.version('lmcache')}), "
             f"not {want}")
print(f"[lmcache] lmcache {md.version('lmcache')}, torch {md.version('torch')}, "
      f"python {sys.version.split()[0]}")
EOF

log=$(mktemp)
trap 'rm -f "$log"' EXIT
rc=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=5 tests/lmcache 2>&1 |
  tee "$log" || rc=$?
# pytest's last line, "1 failed, 30 passed in 20.5s", less the time.
summary=$(grep -E '^=* ?[0-9]+ [a-z]+.* in [0-9.]+s' "$log" | tail -n 1 |
  grep -oE '[0-9]+ (passed|failed|errors?|skipped|xfailed|xpassed)' | paste -sd, - |
  sed 's/,/, /g' || true)
echo "lmcache $VERSION: ${summary:-no result}"
exit "$rc"
