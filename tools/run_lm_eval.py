"""``megaloop lm-eval`` as a script: megaloop/cli/run_lm_eval.py has the command; this file keeps
``python tools/run_lm_eval.py`` working from a checkout that is not installed."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaloop.cli.run_lm_eval import main  # noqa: E402

if __name__ == "__main__":  # (guarded: checkpoint writers re-import __main__ in their workers)
    sys.exit(main())
