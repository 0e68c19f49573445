"""On a GPU (``launch/gpu_check.sh`` runs the ``gpu`` tests): hybrid models' token mixers on CUDA, packed ==
each example alone, logits and gradients.

Two routes (``trainer.model.mixer_routes``): the one the GPU image picks for each family of
tests/unit/test_mixers.py (``per_example`` without the kernel packages; transformers' own kernels or torch
fallbacks inside), and ``varlen_kernels`` through the real flash-linear-attention where it is installed and
usable, with the convolution's double (causal-conv1d has no wheel to carry). The reference is each example
through the bare transformers model alone, on the same GPU.

Seen on the H200 (2026-12-04, torch 2.11, Triton 3.6, fla 0.6.0 carried as a wheel): fla refuses its own
gated delta rule backward there ("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for
gated chunk_bwd_dqkwg"), in transformers' own path too, which picks an installed fla; the GPU check therefore
carries no fla, and the build refuses it there in one line (``mixer_kernels.fla_refusal``): these tests skip.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.gpu_sim import mixer_kernel_doubles as doubles
from tests.unit.test_mixers import CONFIGS, alone, build, gap, packed
from tests.unit.test_mixers import examples as cpu_examples
from trainer.config import ConfigError
from trainer.model.mixers import describe, find_token_mixers

pytestmark = pytest.mark.gpu

FLOAT32 = 1e-4
"""float32 on CUDA (no TF32 by default): the per-example route runs the same kernels as the reference."""
FLA = 5e-3
"""fla's chunked kernels in float32 (Triton dots) against transformers' own path per example."""
FLA_FAMILIES = ["gated delta rule (qwen3_next)", "gated delta rule (qwen3_5_text)", "KDA (kimi_linear)"]


def cuda_model(family: str, overrides: dict):
    """``test_mixers.build`` on CUDA in float32; skipped where an installed fla is refused on this GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        return build(family, overrides, dtype=torch.float32, device="cuda")
    except ConfigError as e:  # an installed fla that refuses its backward on this GPU (mixer_kernels.fla_refusal)
        if "flash-linear-attention refuses" in str(e):
            pytest.skip(str(e))
        raise


def examples(lengths) -> list[torch.Tensor]:
    return [e.cuda() for e in cpu_examples(lengths)]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_each_mixer_family_packed_equals_alone_on_cuda(kind):
    family, overrides, lengths = CONFIGS[kind]
    model = cuda_model(family, overrides)
    exs = examples(lengths)
    found = gap(packed(model, exs), alone(model, exs))
    assert found < FLOAT32, (found, describe(model.token_mixers))


@pytest.mark.parametrize("kind", FLA_FAMILIES)
def test_real_fla_kernels_keep_each_example_alone(kind, monkeypatch):
    if importlib.util.find_spec("fla") is None:
        pytest.skip("flash-linear-attention not installed")
    doubles.install(monkeypatch, ("causal_conv1d",))  # the convolution's double; fla is the real one
    family, overrides, lengths = CONFIGS[kind]
    model = cuda_model(family, overrides)
    assert {m.module.forward.route.name for m in find_token_mixers(model.model)} == {"varlen_kernels"}
    exs = examples(lengths)
    reference = alone(model, exs)
    found = gap(packed(model, exs), reference)
    assert found < FLA, (found, describe(model.token_mixers))
    assert doubles.CALLS["causal_conv1d_fn:bounded"] > 0
