"""Parent side of the demo and the e2e benchmark: one engine lifetime = one child process.

``run_engine(spec)`` writes the spec as JSON, starts ``python -m connector.demo.workload``,
echoes the child's progress lines to stderr (with elapsed time), keeps everything else in
a log file, and returns the child's JSON result. A separate process per engine lifetime
makes an "engine restart" real and keeps each measurement's memory and timing clean.
Does not import vLLM.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from connector.demo.presets import CPU_ENGINE_ENV
from connector.demo.workload import PROGRESS_TAG

REPO_ROOT = Path(__file__).resolve().parent.parent


# "pkg.SomeError: message", alone or after vLLM's "(Worker pid=1) ERROR <date> [file]" prefix
_ERROR_LINE = re.compile(r"(?:^|\] |^\s+)([\w.]*(?:Error|Exception): .*)")


class EngineRunError(RuntimeError):
    """A child engine process failed; the message carries the tail of its log."""


def _child_env(extra_paths: list[str], secrets: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, **secrets)
    for key, value in CPU_ENGINE_ENV.items():
        env.setdefault(key, value)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    paths = [p for p in extra_paths if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_engine(spec: dict[str, Any], *, log_dir: Path | None = None, timeout_s: float = 600,
               quiet: bool = False, extra_paths: list[str] | None = None,
               secrets: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one engine lifetime in a child process; return its result dict.

    ``secrets`` (e.g. the Redis URL with its password, named in the spec by
    ``redis_url_env``) reach the child through its environment only: the spec file, the
    log and the output in ``log_dir`` never hold them.
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvtier-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in spec["label"]).strip("-")
    spec_path = log_dir / f"{slug}.spec.json"
    out_path = log_dir / f"{slug}.out.json"
    log_path = log_dir / f"{slug}.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "connector.demo.workload", str(spec_path), str(out_path)]
    t0 = time.monotonic()
    tail: deque[str] = deque(maxlen=40)
    errors: deque[str] = deque(maxlen=8)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=_child_env(extra_paths or [], secrets or {}),
                                cwd=str(REPO_ROOT))
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip())
                found = _ERROR_LINE.search(line)
                if found:
                    errors.append(found.group(1).rstrip())
                if line.startswith(PROGRESS_TAG) and not quiet:
                    msg = line[len(PROGRESS_TAG):].strip()
                    print(f"  [{time.monotonic() - t0:5.1f}s] {msg}", file=sys.stderr,
                          flush=True)
                if time.monotonic() - t0 > timeout_s:
                    proc.kill()
                    break
            rc = proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = -9
    if rc != 0 or not out_path.exists():
        cause = "\n".join(dict.fromkeys(errors)) or "(no exception line in the log)"
        last = "\n".join(tail)
        raise EngineRunError(
            f"engine run {spec['label']!r} failed (exit {rc}); full log: {log_path}\n"
            f"errors:\n{cause}\nlog tail:\n{last}")
    return json.loads(out_path.read_text())
