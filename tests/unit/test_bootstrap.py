"""scripts/bootstrap.sh on machines it was not run on (issue 45.7), with stand-in commands:
a user who is not root (with and without sudo), a Python whose venv lacks ensurepip (Debian
without python3-venv), root (CI). Nothing is installed: apt-get, sudo, the Python and Redis
are small scripts that log how they were called."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("cat", "sha256sum", "cut", "seq", "sleep", "touch", "dirname", "env", "mkdir")

STUBS = {
    # the log is $LOG; state lives in $STATE
    "id": 'echo "$UID_STUB"',
    "sudo": 'echo "sudo $*" >> "$LOG"; exec "$@"',
    "apt-get": 'echo "apt-get $*" >> "$LOG"; for a in "$@"; do case $a in *-venv) '
               'touch "$STATE/venv-ok";; redis-server) touch "$STATE/redis-installed";; esac; '
               'done',
    "apt-cache": 'case $2 in python3.*-venv) exit 0;; esac; exit 1',
    "python3": r'''case "$*" in
  *ensurepip*) [ -f "$STATE/venv-ok" ] || exit 1;;
  "-m venv .venv") mkdir -p .venv/bin && printf '#!/bin/bash\nexit 0\n' > .venv/bin/python
                   /bin/chmod +x .venv/bin/python; echo "venv made" >> "$LOG";;
  "-c import sys; sys.exit(sys.version_info < (3, 11))") exit 0;;
  *'print(f"'*) echo 3.11;;
  *) exit 0;;
esac''',
    "redis-server": 'echo "redis-server $*" >> "$LOG"; touch "$STATE/redis-up"',
    "redis-cli": '[ -f "$STATE/redis-up" ]',
    "openssl": "exit 0",
}


def _run(tmp_path: Path, *, uid: int, sudo: bool, ensurepip: bool, redis_installed: bool
         ) -> tuple[subprocess.CompletedProcess[str], str]:
    root, bindir, state = tmp_path / "repo", tmp_path / "bin", tmp_path / "state"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "bootstrap.sh", root / "scripts")
    shutil.copy(REPO / "pyproject.toml", root)
    bindir.mkdir()
    state.mkdir()
    for tool in TOOLS:
        os.symlink(shutil.which(tool), bindir / tool)
    for name, body in STUBS.items():
        if name == "sudo" and not sudo:
            continue
        if name.startswith("redis") and not redis_installed:
            continue
        (bindir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bindir / name).chmod(0o755)
    if ensurepip:
        (state / "venv-ok").touch()
    env = {"PATH": str(bindir), "LOG": str(tmp_path / "log"), "STATE": str(state),
           "UID_STUB": str(uid), "HOME": str(tmp_path)}
    out = subprocess.run(["/bin/bash", str(root / "scripts" / "bootstrap.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    log = (tmp_path / "log").read_text() if (tmp_path / "log").exists() else ""
    return out, log


def test_a_user_without_sudo_is_told_what_to_do(tmp_path: Path) -> None:
    out, log = _run(tmp_path, uid=1000, sudo=False, ensurepip=True, redis_installed=False)
    assert out.returncode == 1
    assert "need root to install redis-server redis-tools" in out.stderr
    assert "run this script as root, or install sudo" in out.stderr
    assert "apt-get" not in log


def test_a_user_with_sudo_installs_through_sudo(tmp_path: Path) -> None:
    out, log = _run(tmp_path, uid=1000, sudo=True, ensurepip=True, redis_installed=False)
    assert "sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server " \
           "redis-tools" in log, log
    assert "sudo apt-get update -qq" in log


@pytest.mark.parametrize("uid", [0, 1000])
def test_a_python_without_ensurepip_gets_its_venv_package(tmp_path: Path, uid: int) -> None:
    out, log = _run(tmp_path, uid=uid, sudo=True, ensurepip=False, redis_installed=True)
    assert out.returncode == 0, out.stderr
    assert "apt-get install -y -qq python3.11-venv" in log, log
    assert log.index("python3.11-venv") < log.index("venv made")
    assert ("sudo " in log) == bool(uid)


def test_root_installs_without_sudo_and_says_how_to_stop_the_redis_it_starts(
        tmp_path: Path) -> None:
    out, log = _run(tmp_path, uid=0, sudo=False, ensurepip=True, redis_installed=True)
    assert out.returncode == 0, out.stderr
    assert "sudo" not in log and "redis-server --daemonize yes" in log
    assert "redis-cli -h 127.0.0.1 -p 6379 shutdown nosave" in out.stderr
