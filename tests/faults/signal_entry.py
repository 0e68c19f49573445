"""``python -m tests.faults.signal_entry OVERRIDES``: ``trainer.train`` that signals itself or torchrun mid-run.

``PFTEST_SIGNAL=NAME:TARGET:RANK:STEP``: on the first torchrun attempt, after optimizer step STEP, rank RANK
sends signal NAME (``SIGTERM``, ``SIGUSR1``) to TARGET: ``parent`` (torchrun, which forwards it to every
worker, as a scheduler's SIGTERM reaches a job) or ``self`` (this worker only).
``PFTEST_SIGNAL=NAME:setup:METHOD:0``: this worker signals itself inside ``Trainer.METHOD`` (setup).
``PFTEST_SIGNAL=NAME:cp_gather:RANK:STEP``: rank RANK signals itself at step STEP's first context-parallel
all-gather (inside attention, after FSDP's all-gather of the block: the other rank then waits in the CP group's).
``PFTEST_SIGNAL=NAME:native:RANK:0``: rank RANK sends NAME to torchrun as the local tokenizer's training starts,
then stays in native code for two minutes, as the tokenizers trainer's merge phase does (stop signals blocked
in its main thread, so no Python handler runs there until it returns).
``PFTEST_PIDFILE=PATH``: each worker writes its pid to ``PATH.RANK`` first (a test can then wake a stopped one);
without ``PFTEST_SIGNAL`` the run is plain ``trainer.train``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

from tests.quick_exit import run_then_exit
from trainer import loop, train
from trainer.parallel import cp_attention


def signal_after(name: str, target: str, rank: int, step: int):
    original = loop.Trainer.train_step

    def train_step(self):
        metrics = original(self)
        if self.step == step and self.rank == rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getppid() if target == "parent" else os.getpid(), getattr(signal, name))
        return metrics

    return train_step


def signal_in_cp_gather(name: str, rank: int, step: int) -> None:
    """Patch the CP all-gather (and ``forward_backward``, which says which step runs) to signal this rank."""
    original_fb, original_gather = loop.Trainer.forward_backward, cp_attention._AllGatherTokens.forward
    now = {"step": 0, "sent": False}

    def forward_backward(self, *args, **kwargs):
        now["step"], now["rank"] = self.step + 1, self.rank
        return original_fb(self, *args, **kwargs)

    def gather(ctx, x, group):
        if now["step"] == step and now["rank"] == rank and not now["sent"]:
            now["sent"] = True
            time.sleep(0.5)  # the heartbeat writes the step (at most five writes per heartbeat interval)
            os.kill(os.getpid(), getattr(signal, name))
        return original_gather(ctx, x, group)

    loop.Trainer.forward_backward = forward_backward
    cp_attention._AllGatherTokens.forward = staticmethod(gather)


def signal_in_native_tokenizer_training(name: str, rank: int) -> None:
    from trainer.data import tokenizer

    def train_bpe_tokenizer(*args, **kwargs):
        if int(os.environ.get("RANK", 0)) == rank:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
            os.kill(os.getppid(), getattr(signal, name))
            ctypes.CDLL(None).sleep(120)  # native, the GIL released (the Rust trainer releases it too)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGUSR1})
        return original(*args, **kwargs)

    original, tokenizer.train_bpe_tokenizer = tokenizer.train_bpe_tokenizer, train_bpe_tokenizer


def signal_in_setup(name: str, phase: str):
    """Signal this worker from inside the setup method ``phase`` (``build_data``: the cache build)."""
    original = getattr(loop.Trainer, phase)

    def during(self, *args, **kwargs):
        os.kill(os.getpid(), getattr(signal, name))
        return original(self, *args, **kwargs)

    return during


if __name__ == "__main__":
    if os.environ.get("PFTEST_PIDFILE"):  # whole or absent: written aside, then renamed into place
        pidfile = f"{os.environ['PFTEST_PIDFILE']}.{os.environ.get('RANK', '0')}"
        with open(f"{pidfile}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{pidfile}.tmp", pidfile)
    sig, where, on_rank, at_step = os.environ.get("PFTEST_SIGNAL", "-:-:0:0").split(":")
    if where == "-":
        pass
    elif where == "native":
        signal_in_native_tokenizer_training(sig, int(on_rank))
    elif where == "setup":  # PFTEST_SIGNAL=SIGTERM:setup:<method>:0
        setattr(loop.Trainer, on_rank, signal_in_setup(sig, on_rank))
    elif where == "cp_gather":
        signal_in_cp_gather(sig, int(on_rank), int(at_step))
    else:
        loop.Trainer.train_step = signal_after(sig, where, int(on_rank), int(at_step))
    run_then_exit(train.main)
