"""Run pytest jobs, one mutant each, in forked children of one warmed-up interpreter.

``python -m tests.mutants.run JOBS.json`` where JOBS.json is a list of
``{"mutant": name, "args": [pytest args], "report": path, "log": path}``; each child sets
``KVTIER_MUTANT`` / ``KVTIER_MUTANT_REPORT`` and runs ``pytest.main(args)`` with
``-p tests.mutants.apply`` among the args, so each mutant lives in its own process. Forking
saves each job the imports of pytest, hypothesis and the clients (seconds on 2 shared CPUs).
Writes ``{mutant: {"rc": exit code, "seconds": wall, "cpu_seconds": CPU}}`` to
JOBS.json + ``.rc``. Jobs run one at a time.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no BLAS threads alive across a fork

import hypothesis.stateful  # noqa: E402,F401  (warm imports, shared copy-on-write)
import numpy  # noqa: E402,F401
import pytest  # noqa: E402
import redis  # noqa: E402,F401
import zmq  # noqa: E402,F401


def run_job(job: dict) -> tuple[int, float]:
    """The child's exit code and CPU seconds."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        rc = 70
        try:
            os.environ["KVTIER_MUTANT"] = job["mutant"]
            os.environ["KVTIER_MUTANT_REPORT"] = job["report"]
            fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            rc = int(pytest.main(job["args"]))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    _, status, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime


def main(path: str) -> None:
    with open(path) as f:
        jobs = json.load(f)
    done = {}
    for job in jobs:
        start = time.monotonic()
        rc, cpu = run_job(job)
        done[job["mutant"]] = {"rc": rc, "seconds": round(time.monotonic() - start, 2),
                               "cpu_seconds": round(cpu, 2)}
    with open(path + ".rc", "w") as f:
        json.dump(done, f)


if __name__ == "__main__":
    main(sys.argv[1])
