"""torchrun with a job log a person can read: ``python -m megaloop.launch [torchrun flags] SCRIPT``.

The same launcher (it runs ``torch.distributed.run.main`` with the same flags, environment and exit
codes); what it prints differs in three places, all where nothing is wrong with the run:

- A launcher that is signalled (SLURM's SIGTERM before a time limit, a preemption, ``scancel``)
  passes the signal to its ranks, which save and stop, and then exits 1 with a 25-line traceback of
  its own ``SignalException``. Here: one line saying so.
- When the launcher on the first node, which hosts the c10d rendezvous store, leaves before the
  others have closed the rendezvous, each of them logs that it "failed to shutdown the rendezvous"
  and torch's C++ store client prints a stack trace (``recvVector failed ... Failed to recv``).
  Both say only that the first node already left: the line becomes one that says so, and the
  launcher's own C++ warnings are not printed (TORCH_CPP_LOG_LEVEL=ERROR in this process only; the
  ranks get the caller's value, so their C++ warnings still show).
- The launcher's own logging is unchanged otherwise: which ranks it starts, which it signals.
"""

from __future__ import annotations

import logging
import os
import sys

SHUTDOWN_RACE = "failed to shutdown the rendezvous"


class _ShutdownRace(logging.Filter):
    """Turns the rendezvous-shutdown warning into one line that says it is harmless."""

    def filter(self, record: logging.LogRecord) -> bool:
        if SHUTDOWN_RACE in record.getMessage():
            record.msg, record.args = (
                "rendezvous closed: the first node's launcher, which hosted it, had already "
                "left (harmless: every rank had finished)"), ()
            record.exc_info = None
        return True


def main(argv=None) -> int:
    caller_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # read once, when libtorch loads
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # The ranks this launcher starts inherit the caller's setting, not the one above.
    if caller_level is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    else:
        os.environ["TORCH_CPP_LOG_LEVEL"] = caller_level
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").addFilter(
        _ShutdownRace())
    try:
        torchrun.main(sys.argv[1:] if argv is None else argv)
    except SignalException as exc:
        print(f"launcher on {os.uname().nodename}: {exc.sigval.name} received and passed on to "
              f"its ranks (they save and stop with --exit-signal-handler); exit code 1",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
