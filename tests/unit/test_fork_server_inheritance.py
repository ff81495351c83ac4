"""The engine host's fork server gives a started process what a spawned one would get: the
starter's environment at start(), its standard output, and the same server for its own
children (a real server and real processes; vLLM is not imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROGRAM = '''
import json, multiprocessing, os, sys
from tests.support import fast_start

def grandchild(q):
    q.put({"who": "grandchild", "pid": os.getpid(), "ppid": os.getppid(),
           "var": os.environ.get("SPEC_VAR")})

def child(q):
    print("child output", flush=True)
    q.put({"who": "child", "pid": os.getpid(), "ppid": os.getppid(),
           "var": os.environ.get("SPEC_VAR")})
    os.environ["SPEC_VAR"] = "set-by-the-child"
    p = multiprocessing.get_context("spawn").Process(target=grandchild, args=(q,))
    p.start()
    p.join()
    sys.exit(3)

if __name__ == "__main__":
    log_path, out_path = sys.argv[1], sys.argv[2]
    os.environ[fast_start.STARTED_LOG_ENV] = log_path
    server = fast_start.install(preload=["tests.support.fast_start"])
    os.environ["SPEC_VAR"] = "set-after-the-server-started"
    saved = os.dup(1)
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT)
    os.dup2(out, 1)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    reports = [q.get(timeout=120), q.get(timeout=120)]
    p.join()
    os.dup2(saved, 1)
    print(json.dumps({"server": server, "me": os.getpid(), "exitcode": p.exitcode,
                      "method": ctx.get_start_method(), "reports": reports}))
'''


def test_a_started_process_gets_its_starters_environment_output_and_server(
        tmp_path: Path) -> None:
    import json

    script, log, out = tmp_path / "probe.py", tmp_path / "started.log", tmp_path / "out.txt"
    script.write_text(PROGRAM)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SPEC_VAR", None)
    done = subprocess.run([sys.executable, str(script), str(log), str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    child, grandchild = sorted(result["reports"], key=lambda r: r["who"])
    assert result["method"] == "forkserver" and result["exitcode"] == 3
    # Both forked by the one server, not by their starters (that is what saves the imports).
    assert child["ppid"] == grandchild["ppid"] == result["server"]
    # Each sees its starter's environment as it was at start(), not the server's.
    assert child["var"] == "set-after-the-server-started"
    assert grandchild["var"] == "set-by-the-child"
    # The child's output went where its starter's fd 1 pointed at start().
    assert out.read_text() == "child output\n"
    # The host learns whose each process is from the log.
    started = {tuple(map(int, line.split())) for line in log.read_text().splitlines()}
    assert started == {(child["pid"], result["me"]), (grandchild["pid"], child["pid"])}
