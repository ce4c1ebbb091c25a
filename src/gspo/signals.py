"""SIGTERM and SIGINT (a scheduler's preemption notice, Ctrl-C) end a run cleanly.

The first signal only sets a flag: the loop finishes the optimiser steps under way or abandons a
rollout that has no update yet, writes a checkpoint of the last finished step, prints where to
`--resume` from and exits with 128 + the signal number (143 for SIGTERM, 130 for SIGINT), as
SLURM and shells expect. A second signal exits at once, except under torchrun: a scheduler
(SLURM's scancel, a terminal's Ctrl-C) signals every process of the job and torchrun then
forwards the one it got to its ranks, so each rank sees it twice, and that copy is not a request
to hurry. There torchrun's own escalation (SIGKILL after its grace period) is the way to exit at
once, and a rank that has stopped ignores further copies. Under torchrun, ranks agree at each
check (a max over ranks), so they stop at the same point; torchrun gives its workers about 30 s
after forwarding a SIGTERM, which bounds how long the final checkpoint may take there.

What gspo cannot change: torchrun, when it got the signal itself, re-raises it once its workers
have exited, as a `SignalException` traceback, and exits 1 (torch.distributed.run does so by
design and has no option to keep quiet; gspo runs only in the workers). So rank 0's final line
says, under torchrun, that a traceback after it only reports the signal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterator

from gspo.errors import GspoError

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGINT)

def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ  # set by torchrun for its workers


class Interrupted(GspoError):
    """The run stopped on a signal after saving what it had; the message says how to resume."""

    rank0_says_it = True  # every rank stops alike: under torchrun one line, from rank 0

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


@contextlib.contextmanager
def signal_defaults() -> Iterator[None]:
    """SIGNALS end the process at once for the duration (main thread only), whatever handler
    (a StopRequest's) is installed: for a wait in C++ that returns to Python, where a stop
    request is seen, only when it ends. Under torchrun, the join: a rank that failed before it
    (rank 0 finding the run directory busy) left the others waiting there through torchrun's
    SIGTERM until its SIGKILL, ~35 s. Nothing is written before the join, so nothing is lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_DFL) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class StopRequest:
    """Installs the handlers for the duration of a `with` block (main thread only; elsewhere it
    stays inert) and records the first signal."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            # a stopped rank exits next: torchrun's forwarded copy may still be on its way
            stopped = self.signum is not None and under_torchrun()
            signal.signal(s, signal.SIG_IGN if stopped else handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None and under_torchrun():
            return  # torchrun's forwarded copy; torchrun itself escalates to SIGKILL
        if self.signum is not None:  # the second signal: no more waiting
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: said once
            log.warning("%s received: stopping after the step under way, with a checkpoint "
                        "(send it again to exit at once)", signal.Signals(signum).name)

    def agreed(self, d) -> int:
        """The signal any rank got, 0 for none (a collective under torchrun: call it on every
        rank)."""
        return int(d.max([float(self.signum or 0)])[0])

    def requested(self, d) -> bool:
        return self.agreed(d) > 0

    def name(self, d) -> tuple[int, str]:
        signum = self.agreed(d)
        return signum, signal.Signals(signum).name
