"""Preemption: SIGTERM / SIGUSR1 stop the run at the next step boundary, on every rank, after a checkpoint.

A scheduler announces the end of a job with a signal (SLURM: SIGTERM at preemption or cancellation,
``--signal=USR1@SECONDS`` before the time limit; torchrun forwards the signals it handles to every worker).
The handler only records the signal: the loop asks ``StepBoundary.agree`` after every optimizer step, and
one all-reduce (MAX) of ``[signal number, checkpoint-clock due]`` gives every rank the same answer, so a rank
that got the signal a step later than another never leaves the others waiting in a collective. The run then
saves a checkpoint and exits with ``PREEMPTED_EXIT_CODE``; ``resume=auto`` continues from there exactly.

The clock of ``checkpoint.every_minutes`` is rank 0's, shared by the same all-reduce, so ranks whose clocks
differ still save together.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType

import torch

from trainer import distributed

log = logging.getLogger("trainer")

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run stopped by a signal after saving its checkpoint (``EX_TEMPFAIL``: try again later)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass(frozen=True)
class Boundary:
    """What every rank does after a step (the same on all ranks)."""

    stop_signal: str | None
    """Name of the signal a rank received (``SIGTERM``, ``SIGUSR1``), or ``None``."""
    clock_due: bool
    """``checkpoint.every_minutes`` passed since the last save."""


class StepBoundary:
    """Records stop signals (while active) and decides, identically on every rank, what happens after a step.

    Use as a context manager around the training loop: the handlers are installed on entry and the previous
    ones restored on exit, so nothing outside the loop (setup, tests in the same process) changes behaviour.
    """

    def __init__(self, every_minutes: float, device: torch.device) -> None:
        self.every_s = every_minutes * 60.0
        self.device = device
        self.received: int = 0
        self.last_save = time.monotonic()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StepBoundary:
        if threading.current_thread() is not threading.main_thread():  # Python takes signals there only
            log.warning("training outside the main thread: SIGTERM/SIGUSR1 will not save a checkpoint first")
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # nothing else: logging from a signal handler can deadlock on its lock

    def saved(self) -> None:
        """A checkpoint was just written: the wall-clock interval starts again."""
        self.last_save = time.monotonic()

    def agree(self) -> Boundary:
        """One all-reduce (MAX): the signal any rank received, and whether rank 0's checkpoint clock is due."""
        clock_due = distributed.is_rank0() and self.every_s > 0 and time.monotonic() - self.last_save >= self.every_s
        signum, due = distributed.all_reduce_max([float(self.received), float(clock_due)], self.device)
        name = signal.Signals(int(signum)).name if signum else None
        return Boundary(stop_signal=name, clock_due=bool(due))
