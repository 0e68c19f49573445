"""A model with attention sinks (gpt_oss) through the CUDA backends' real code on CPU, via the kernel doubles.

``flash_attn`` and ``torch_varlen`` get an lse without a gradient from their kernels and give it one through
the kernel (``trainer.model.sinks.KernelLSE``); ``flex`` rescales by its differentiable lse (its dense double
here has the backward CPU FlexAttention lacks). fp32 (the doubles' ``accept_fp32``): the plumbing exactly,
every gradient the sinks' included; bf16 autocast over fp32 master weights, as FSDP's mixed precision runs it.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu_sim import flex_double
from tests.unit.test_attention_sinks import gpt_oss, packed_and_alone, worst
from trainer.model.attention import BACKENDS, resolve_backend

LENGTHS = [9, 1, 14, 5, 11, 3]


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "flex"])
def test_packed_gpt_oss_through_the_kernels_fp32(backend, simulated_gpu_fp32, monkeypatch):
    flex_double.install(monkeypatch)
    model = gpt_oss(dtype=torch.float32)
    model.backend = BACKENDS[backend]  # resolve_backend rightly refuses fp32 for the real kernels
    packed, alone, g_packed, g_alone = packed_and_alone(model, LENGTHS)
    assert any(name.endswith("sinks") for name in g_packed)
    assert worst(packed, alone) < 1e-5 and worst(g_packed, g_alone) < 1e-5


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_packed_gpt_oss_through_the_kernels_bf16_autocast(backend, simulated_gpu):
    model = gpt_oss(dtype=torch.float32)
    model.backend = resolve_backend(backend, torch.device("cpu"), torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packed, alone, g_packed, g_alone = packed_and_alone(model, LENGTHS)
    assert worst(packed, alone) < 3e-2 and worst(g_packed, g_alone) < 3e-2
