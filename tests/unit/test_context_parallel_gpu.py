"""On a real GPU (``launch/gpu_check.sh`` runs the ``gpu`` tests): the kernels' bottom-right causal alignment
with ``seqlen_q < seqlen_k``, and one rank's context-parallel attention against the full row in one process
(the all-gather replaced by the row's keys), bf16, every CUDA backend."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.gpu_sim.test_context_parallel_kernels import LENGTHS, _cp_row, _Module, _row
from trainer.model.backends_sdpa import sdpa_varlen_attention

pytestmark = pytest.mark.gpu
KERNELS = ["torch_varlen", "flex", "sdpa_varlen"] + (["flash_attn"] if importlib.util.find_spec("flash_attn") else [])


@pytest.mark.parametrize("split", ["contiguous", "balanced"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kernel", KERNELS)
def test_cp_attention_equals_full_row_on_gpu(kernel, window, split):
    q, k, v = _row(torch.bfloat16, "cuda", head_dim=64)  # flex's compiled kernel takes 16 and up
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    ref, _ = sdpa_varlen_attention(
        _Module(),
        q.float(),
        k.float(),
        v.float(),
        None,
        scaling=0.35,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        sliding_window=window,
    )
    out = _cp_row(q, k, v, kernel, split, window)
    assert (out.float() - ref).abs().max() < 3e-2
