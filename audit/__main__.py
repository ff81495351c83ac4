"""``python -m audit``: the same command as ``kvtier audit``."""

import sys

from audit.cli import main

if __name__ == "__main__":
    sys.exit(main())
