"""``python -m megaloop <command>``: the ``megaloop`` console command (megaloop/cli/main.py)."""

import sys

from megaloop.cli.main import main

if __name__ == "__main__":  # (guarded: checkpoint writers re-import __main__ in their workers)
    sys.exit(main())
