"""A state-space model trains packed on two gloo ranks: FSDP2 (bf16 policy) and activation checkpointing.

Falcon-Mamba's mixers get no boundary keyword arguments from their layers, so every packed call, and every
layer recomputed in backward under activation checkpointing, finds the boundaries through the relay
(``trainer.model.relay``); a recompute that missed them would run the mixer over the whole row and
torch's checkpoint would stop on the different tensors it saves. Its residual stream is fp32 under the bf16
policy, which the chunked loss reads in the head's dtype.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.slow


def test_falcon_mamba_two_ranks_activation_checkpointing(tmp_path):
    out = run_torchrun(
        [
            "-m",
            "trainer.train",
            "model=qwen2_tiny",
            "model.family=falcon_mamba",
            "model.config_overrides={state_size:8,expand:2}",
            "data.num_records=200",
            "max_steps=2",
            "parallel.activation_checkpointing=full",
            f"run_dir={tmp_path / 'run'}",
            "logger.peak_tflops=1",
        ],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (
        "token mixer FalconMambaMixer x2 (short convolution + recurrent state): packed rows through per_example"
        in out.stdout
    )
    assert "; self-check packed micro-batch" in out.stdout
    assert "activation checkpointing on 2/2 blocks" in out.stdout and "2 steps on 2 rank(s)" in out.stdout
