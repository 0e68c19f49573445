"""Stop signals outside the training loop, in native code, and when the launcher dies (light: no torch).

**Outside the loop** (setup: the tokenizer's training, the data cache, the config verdict, the self-check,
the DPO reference's precompute; ``packfsdp export``) nothing is saved: ``signals_interrupt`` makes a stop
signal raise ``Interrupted`` (cleanups run on the way out) and the entry point writes one line and exits
with ``PREEMPTED_EXIT_CODE``.

**Native code.** Python runs a signal handler in the main thread, between two bytecodes; a main thread inside
native code (the tokenizers trainer, a gloo wait for a peer, a long kernel) gets there minutes later. The C
handler also writes the signal number to ``signal.set_wakeup_fd``'s pipe, which one watcher thread
(``SignalWatcher``) reads at once: it starts the loop's watchdog, or outside the loop gives the main thread
``INTERRUPT_GRACE_S`` to stop by itself before it writes the line and ends the process.

**The launcher.** Under torchrun a worker must not outlive its agent (a SIGKILLed agent would leave workers
training unsupervised): ``stop_with_launcher`` asks Linux for SIGTERM when the parent dies
(``PR_SET_PDEATHSIG``) and watches the parent pid (for other systems, and a parent gone before the request),
so a worker whose agent died stops like a preempted one: at the next boundary, with a checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run stopped by a signal (``EX_TEMPFAIL``: try again later; ``resume=auto`` continues)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
INTERRUPT_GRACE_S = 5.0
"""Outside the loop: how long the main thread has, after a stop signal, to raise ``Interrupted`` and run its
cleanups before the watcher ends the process (it is in native code). torchrun waits 30 s before SIGKILL."""
PARENT_POLL_S = 1.0
"""How often a torchrun worker checks that its agent (its parent process) is still there."""


class Interrupted(BaseException):
    """SIGTERM/SIGUSR1 outside the training loop (``signals_interrupt``): nothing to save. A ``BaseException``,
    so no ``except Exception`` on the way swallows it; cleanups run on the way out. ``line`` is what the
    entry point writes before it exits (``exit_interrupted``)."""

    def __init__(self, signum: int, line: Callable[[str], str]) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signal_name = signal.Signals(signum).name
        self.line = line(self.signal_name)


class SignalWatcher:
    """The one thread that sees a stop signal the moment it arrives, whatever the main thread is doing (see
    the module docstring): it reads ``signal.set_wakeup_fd``'s pipe and calls ``on_signal(signum)`` in this
    thread. ``on_signal`` is whatever the innermost ``signals_interrupt`` or ``StepBoundary`` set (``None``:
    nothing). Started once per process (``watcher()``), from the main thread."""

    def __init__(self) -> None:
        self.on_signal: Callable[[int], None] | None = None
        read, write = os.pipe()
        os.set_blocking(write, False)  # the C handler must never block
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._run, args=(read,), name="packfsdp-signals", daemon=True)
        self.thread.start()

    def _run(self, read: int) -> None:
        while data := os.read(read, 64):
            for signum in data:
                if signum in STOP_SIGNALS and (on_signal := self.on_signal) is not None:
                    on_signal(signum)


_WATCHER: SignalWatcher | None = None


def watcher() -> SignalWatcher:
    """The process's ``SignalWatcher``, started on first use (main thread only)."""
    global _WATCHER
    if _WATCHER is None:
        _WATCHER = SignalWatcher()
    return _WATCHER


_EXITING = threading.Lock()


def exit_interrupted(line: str) -> None:
    """Write ``line`` (``packfsdp: ...``; nothing when empty) and leave with ``PREEMPTED_EXIT_CODE`` at once
    (no collective, no teardown: other ranks may be anywhere). Once per process: a second caller (the
    watcher and the main thread at the same moment) waits for the first one's exit."""
    if not _EXITING.acquire(blocking=False):
        time.sleep(3600)
    if line:
        os.write(2, (line.rstrip("\n") + "\n").encode())  # unbuffered: no lock the main thread may hold
    os._exit(PREEMPTED_EXIT_CODE)


@contextlib.contextmanager
def stop_handlers(handler: Callable[[int, FrameType | None], None], on_signal: Callable[[int], None]) -> Iterator[None]:
    """``handler`` for ``STOP_SIGNALS`` (main thread) and ``on_signal`` in the watcher thread while inside; on
    exit the watcher's previous ``on_signal`` comes back, then the previous handlers. Main thread only."""
    watch = watcher()
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    previous_on_signal, watch.on_signal = watch.on_signal, on_signal
    try:
        yield
    finally:
        watch.on_signal = previous_on_signal
        for sig, restored in previous.items():
            signal.signal(sig, restored)


@contextlib.contextmanager
def signals_interrupt(line: Callable[[str], str]) -> Iterator[None]:
    """Around work outside the training loop: a stop signal raises ``Interrupted`` (carrying
    ``line(signal_name)``) in the main thread; if the main thread has not ended the process
    ``INTERRUPT_GRACE_S`` later (it is in native code), the watcher writes that line and exits with
    ``PREEMPTED_EXIT_CODE``. Main thread only; the previous handlers come back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum, line)

    timers: list[threading.Timer] = []

    def too_long(signum: int) -> None:  # in the watcher thread
        timer = threading.Timer(INTERRUPT_GRACE_S, exit_interrupted, (line(signal.Signals(signum).name),))
        timer.daemon = True
        timers.append(timer)
        timer.start()

    interrupted = False
    try:
        with stop_handlers(interrupt, too_long):
            yield
    except Interrupted:
        interrupted = True
        raise
    finally:
        if not interrupted:  # a signal now belongs to whoever handles it next (e.g. the loop's boundary)
            for timer in timers:
                timer.cancel()


def stop_with_launcher() -> None:
    """Under torchrun, end this worker (SIGTERM: it stops as a preempted run does) when its agent dies.

    Linux sends it on the parent's death (``prctl(PR_SET_PDEATHSIG)``, a request children do not inherit);
    a thread also polls the parent pid every ``PARENT_POLL_S``: on other systems, for an agent that died
    before the request, and where the request is lost. Only the direct parent counts: torchrun's own
    launcher (srun, a script) may come and go while the agent supervises. A plain ``python -m
    trainer.train`` is left alone (``nohup`` or a closed terminal must not end it)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch_parent, name="packfsdp-parent", daemon=True).start()
