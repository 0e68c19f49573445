"""``python -m tests.faults.signal_entry OVERRIDES``: ``trainer.train`` that signals itself or torchrun mid-run.

``PFTEST_SIGNAL=NAME:TARGET:RANK:STEP``: on the first torchrun attempt, after optimizer step STEP, rank RANK
sends signal NAME (``SIGTERM``, ``SIGUSR1``) to TARGET: ``parent`` (torchrun, which forwards it to every
worker, as a scheduler's SIGTERM reaches a job) or ``self`` (this worker only).
``PFTEST_SIGNAL=NAME:setup:METHOD:0``: this worker signals itself inside ``Trainer.METHOD`` (setup).
"""

from __future__ import annotations

import os
import signal

from tests.quick_exit import run_then_exit
from trainer import loop, train


def signal_after(name: str, target: str, rank: int, step: int):
    original = loop.Trainer.train_step

    def train_step(self):
        metrics = original(self)
        if self.step == step and self.rank == rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getppid() if target == "parent" else os.getpid(), getattr(signal, name))
        return metrics

    return train_step


def signal_in_setup(name: str, phase: str):
    """Signal this worker from inside the setup method ``phase`` (``build_data``: the cache build)."""
    original = getattr(loop.Trainer, phase)

    def during(self, *args, **kwargs):
        os.kill(os.getpid(), getattr(signal, name))
        return original(self, *args, **kwargs)

    return during


if __name__ == "__main__":
    sig, where, on_rank, at_step = os.environ["PFTEST_SIGNAL"].split(":")
    if where == "setup":  # PFTEST_SIGNAL=SIGTERM:setup:<method>:0
        setattr(loop.Trainer, on_rank, signal_in_setup(sig, on_rank))
    else:
        loop.Trainer.train_step = signal_after(sig, where, int(on_rank), int(at_step))
    run_then_exit(train.main)
