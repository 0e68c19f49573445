"""``trainer.train`` with the CUDA kernels simulated in this process:
``torchrun ... -m tests.gpu_sim.simulated_train ARGS`` takes the arguments of ``python -m trainer.train`` (a
Hydra ``-m`` sweep included) and runs the product's own entry point unchanged.

Ranks are separate processes, so a monkeypatch in the pytest process never reaches them: every rank
installs the doubles itself (the flash-attn double, CPU kernels under torch's ``varlen_attn``, the device
pretence: the same three pieces as the ``simulated_gpu`` fixture) before the entry point runs.

At exit rank 0 prints how often each double ran for a training step (``KERNEL_CALLS_LINE``): backward
passes of the flash-attn double and of torch's flash op (the self-check and eval run no backward). A run
that resolved a kernel backend but trained through something else shows zero there.
"""

from __future__ import annotations

import functools
import os
from collections import Counter

import pytest

from tests.gpu_sim import flash_attn_double, torch_varlen_double
from tests.gpu_sim.device import pretend_capable_gpu
from tests.quick_exit import run_then_exit
from trainer import train

KERNEL_CALLS_LINE = "simulated kernel calls in training steps:"
training_calls: Counter[str] = Counter()


def _counted(backend: str, kernel):
    @functools.wraps(kernel)
    def counting(*args, **kwargs):
        training_calls[backend] += 1
        return kernel(*args, **kwargs)

    return counting


def main() -> None:
    with pytest.MonkeyPatch.context() as mp:
        flash_attn_double.install(mp)
        # Counted in the backward kernels, below torch.compile (parallel.compile=true): a counter in Python
        # that dynamo traces would be a guard, and every count a recompile. The flash-attn double's backward
        # op looks ``varlen_bwd`` up at each call; torch's is registered when ``registered()`` is entered.
        mp.setattr(flash_attn_double, "varlen_bwd", _counted("flash_attn", flash_attn_double.varlen_bwd))
        mp.setattr(torch_varlen_double, "_backward", _counted("torch_varlen", torch_varlen_double._backward))
        pretend_capable_gpu(mp)
        with torch_varlen_double.registered():
            try:
                train.main()
            finally:
                if os.environ.get("RANK", "0") == "0":
                    print(
                        KERNEL_CALLS_LINE,
                        *(f"{k}={training_calls[k]}" for k in ("flash_attn", "torch_varlen")),
                        flush=True,
                    )


if __name__ == "__main__":
    run_then_exit(main)
