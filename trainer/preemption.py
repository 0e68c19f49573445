"""Preemption: SIGTERM / SIGUSR1 stop the run at the next step boundary, on every rank, after a checkpoint.

A scheduler announces the end of a job with a signal (SLURM: SIGTERM at preemption or cancellation,
``--signal=USR1@SECONDS`` before the time limit; torchrun forwards the signals it handles to every worker).
The handler only records the signal: the loop asks ``StepBoundary.agree`` after every optimizer step, and
one all-reduce (MAX) of ``[signal number, checkpoint-clock due]`` gives every rank the same answer, so a rank
that got the signal a step later than another never leaves the others waiting in a collective. The run then
saves a checkpoint and exits with ``PREEMPTED_EXIT_CODE``; ``resume=auto`` continues from there exactly.

The clock of ``checkpoint.every_minutes`` is rank 0's, shared by the same all-reduce, so ranks whose clocks
differ still save together.

A rank that is stuck (a hung peer, a kernel that never returns) never reaches the boundary, and with a
handler installed the signal no longer ends it. So the signal also starts a watchdog: when no boundary is
reached within ``max(MIN_GRACE_S, 3 x the longest step so far)`` (a step's interval includes its eval and
checkpoint), the rank exits with ``128 + signal`` and one line, as the signal alone would have ended it.

Outside the loop, and for native code and the launcher, see ``trainer.stop_signals`` (light: the entry
point imports it before torch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

import torch

from trainer import distributed
from trainer.stop_signals import stop_handlers

log = logging.getLogger("trainer")

MIN_GRACE_S = 10.0
"""Shortest wait for the next step boundary after a signal before a rank counts as stuck."""


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
        self.last_save = self.last_boundary = time.monotonic()
        self.longest_step_s = 0.0
        self._handlers = contextlib.ExitStack()
        """The stop handlers installed on entry (``stop_handlers``), removed on exit."""
        self._watchdog: threading.Timer | None = None
        self.saving = False
        """Inside a checkpoint save: a signal then arms no watchdog until the save is done."""
        self.phase: str | None = None
        """A phase between step boundaries that may take longer than a step (``eval``)."""
        self.longest_phase_s: dict[str, float] = {}
        self._lock = threading.Lock()
        """Guards the watchdog: the watcher thread arms it, the main thread stops and re-arms it."""

    def __enter__(self) -> StepBoundary:
        if threading.current_thread() is not threading.main_thread():  # Python takes signals there only
            log.warning("training outside the main thread: SIGTERM/SIGUSR1 will not save a checkpoint first")
            return self
        self._handlers.enter_context(stop_handlers(self._record, self._seen))
        return self

    def __exit__(self, *exc: object) -> None:
        self._handlers.close()
        self._stop_watchdog()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # The Python handler (main thread, maybe long after the signal): a flag only, no lock (logging or the
        # watchdog's lock could deadlock here). The watcher thread saw the signal first and armed the watchdog.
        self.received = signum

    def _seen(self, signum: int) -> None:
        """The watcher thread, the moment the signal arrives (the main thread may be in native code)."""
        self.received = signum
        if not self.saving:
            self._arm_watchdog()

    def _arm_watchdog(self) -> None:
        with self._lock:
            if self._watchdog is None and self.received:
                grace = max(MIN_GRACE_S, 3 * self.longest_step_s)
                if self.phase is not None:  # the phase running now is what must end in time, not a step
                    if self.phase not in self.longest_phase_s:
                        return  # its first run: no measure yet; the collective timeout still bounds a stuck one
                    grace = max(grace, 3 * self.longest_phase_s[self.phase])
                self._watchdog = threading.Timer(grace, self._stuck, (self.received,))
                self._watchdog.daemon = True
                self._watchdog.start()

    def _stuck(self, signum: int) -> None:
        os.write(
            2,
            f"packfsdp: rank {distributed.rank()}: {signal.Signals(signum).name} received but no step "
            "boundary was reached in time (a stuck collective or kernel): exiting without a checkpoint\n".encode(),
        )
        os._exit(128 + signum)

    def _stop_watchdog(self) -> None:
        with self._lock:
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None

    @contextlib.contextmanager
    def saving_checkpoint(self) -> Iterator[None]:
        """Around a save: it may take longer than a step, and a signal during it must not cut it short; the
        wall-clock interval starts again after it."""
        self.saving = True
        try:
            yield
        finally:
            self.saving = False
            self.last_save = time.monotonic()
        self._arm_watchdog()  # a signal that came during the save: the next boundary is due in time

    @contextlib.contextmanager
    def long_phase(self, name: str) -> Iterator[None]:
        """Around work between two boundaries that may outlast a step (an eval): the watchdog's grace counts
        that phase's own duration, so a signal during a long eval still ends in a checkpoint."""
        self.phase = name
        self._stop_watchdog()
        self._arm_watchdog()
        start = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - start
            self.longest_phase_s[name] = max(self.longest_phase_s.get(name, 0.0), took)
            self.phase = None
            self._stop_watchdog()
        self._arm_watchdog()  # a signal during the phase: the next boundary is due within a step's grace

    def agree(self) -> Boundary:
        """One all-reduce (MAX): the signal any rank received, and whether rank 0's checkpoint clock is due."""
        now = time.monotonic()
        self.longest_step_s = max(self.longest_step_s, now - self.last_boundary)
        self.last_boundary = now
        clock_due = distributed.is_rank0() and self.every_s > 0 and now - self.last_save >= self.every_s
        signum, due = distributed.all_reduce_max([float(self.received), float(clock_due)], self.device)
        self._stop_watchdog()  # every rank reached the boundary: none is stuck, this one saves and stops
        name = signal.Signals(int(signum)).name if signum else None
        return Boundary(stop_signal=name, clock_due=bool(due))
