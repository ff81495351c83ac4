#!/usr/bin/env python3
"""pre-commit's ``kvtier-audit`` hook: run ``audit`` from this checkout, nothing installed.

pre-commit installs a ``language: python`` hook with ``pip install .``, which would pull every
runtime dependency of kvtier (numpy, redis, pyzmq, aiohttp, pydantic, ...) to run a
standard-library linter. The hook is ``language: script`` instead: pre-commit runs this file
from the hook repository's root with the first ``python3`` on PATH (3.11 or newer: ``tomllib``),
and ``audit/`` is imported from the checkout next to it.
"""

import sys
from pathlib import Path

if sys.version_info < (3, 11):  # noqa: UP036 (whatever python3 is on PATH runs this)
    sys.exit(f"kvtier audit needs Python 3.11 or newer; {sys.executable} is "
             f"{sys.version.split()[0]}")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from audit.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
