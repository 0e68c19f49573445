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


def test_compiled_blocks_with_sinks_equal_eager(simulated_gpu_fp32):
    """``parallel.compile=true``: the lse's gradient through the kernel stays out of dynamo's trace
    (``kernel_lse`` is a graph break: dynamo fails on an autograd.Function whose backward calls a closure;
    the ``eager`` compile backend is dynamo alone, where it failed), and the compiled blocks train what
    eager does."""
    import copy

    from tests.gpu_sim.test_compile_recompiles import train_step
    from trainer.config import ParallelConfig
    from trainer.parallel import apply_compile

    torch._dynamo.reset()
    model = gpt_oss(
        "flash_attn",
        dtype=torch.float32,
        num_hidden_layers=1,
        layer_types=["sliding_attention"],
        num_local_experts=1,
        num_experts_per_tok=1,
    )  # one block, one expert: compile in seconds
    eager = copy.deepcopy(model)
    apply_compile(model.decoder_layers(), ParallelConfig(compile=True, compile_backend="eager"))
    for lengths in ([14, 15, 3, 10], [6, 5, 10, 12]):
        (loss, grads), (loss_eager, grads_eager) = train_step(model, lengths), train_step(eager, lengths)
        torch.testing.assert_close(loss, loss_eager, rtol=1e-6, atol=1e-5)
        for g, e in zip(grads, grads_eager, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
