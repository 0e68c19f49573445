"""One rank's context-parallel attention against the full row in one process, the all-gather replaced by the
row's own keys/values (``gather_tokens`` patched): ``sdpa_varlen`` (explicit lower-right masks), and, through
the kernel doubles, ``flash_attn`` and ``torch_varlen`` called with ``cu_seqlens_q != cu_seqlens_k`` (their
bottom-right causal alignment), with a sliding window crossing the ranks' boundaries and GQA."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from tests.gpu_sim import flex_double
from trainer.model.backends_sdpa import sdpa_varlen_attention
from trainer.parallel import cp_attention as cp_attention_module
from trainer.parallel.cp_attention import cp_attention
from trainer.parallel.cp_layout import plan_shards

LENGTHS = [3, 29, 1, 9, 14]
CP = 4


class _Module:
    is_causal = True


def _row(dtype, device="cpu", head_dim=8):
    g = torch.Generator().manual_seed(0)
    n = sum(LENGTHS)
    return [torch.randn(1, h, n, head_dim, generator=g).to(device, dtype).requires_grad_() for h in (4, 2, 2)]


def _cp_row(q, k, v, kernel, split, window):
    """The row's attention output and q/k/v gradients, assembled from every rank's CP attention."""
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    shards = [dataclasses.replace(s, kernel=kernel).to(q.device) for s in plan_shards(cu, CP, split)]
    index_all = torch.cat([s.index for s in shards]).clamp(min=0)
    k_all, v_all = k[:, :, index_all], v[:, :, index_all]  # the all-gather's result, in rank order
    out = torch.zeros(1, q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype, device=q.device)
    for s in shards:
        keep = s.index >= 0
        local_q = q[:, :, s.index.clamp(min=0)]
        stand_in = iter([k_all, v_all])  # the all-gather's result: the row's own keys and values
        with mock.patch.object(cp_attention_module, "gather_tokens", lambda x, group, kv=stand_in: next(kv)):
            o, _ = cp_attention(_Module(), local_q, None, None, None, scaling=0.35, cp_shard=s, sliding_window=window)
        out = out.index_put((torch.zeros_like(s.index[keep]), s.index[keep]), o[0][keep].to(out.dtype))
    return out


@pytest.mark.parametrize("split", ["contiguous", "balanced"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kernel", ["sdpa_varlen", "flash_attn", "torch_varlen", "flex"])
def test_cp_attention_equals_full_row(kernel, window, split, request, monkeypatch):
    if kernel in ("flash_attn", "torch_varlen"):
        request.getfixturevalue("simulated_gpu_fp32")
    if kernel == "flex":
        flex_double.install(monkeypatch)
    q, k, v = _row(torch.float32)
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    ref, _ = sdpa_varlen_attention(
        _Module(), q, k, v, None, scaling=0.35, cu_seq_lens_q=cu, cu_seq_lens_k=cu, sliding_window=window
    )
    ref_grads = torch.autograd.grad((ref * ref).sum(), (q, k, v))
    out = _cp_row(q, k, v, kernel, split, window)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    assert (out - ref).abs().max() < 1e-5
    for a, b in zip(grads, ref_grads, strict=True):
        assert (a - b).abs().max() < 1e-5


@pytest.mark.parametrize("kernel", ["sdpa_varlen", "flex"])
def test_per_forward_work_is_done_once_per_forward_not_per_layer(kernel, monkeypatch):
    """A shard's SDPA masks and host bounds, or its flex BlockMask, are made once per forward and window, not
    once per layer: kept with the layout of the shard's query boundaries, which survives the copies of the
    shard FSDP2 hands each layer; the next forward's shard gets its own."""
    flex_double.install(monkeypatch)
    builds = []
    for name in ("query_runs", "flex_query_block_mask"):
        original = getattr(cp_attention_module, name)
        monkeypatch.setattr(
            cp_attention_module, name, lambda *a, _f=original, _n=name, **k: builds.append(_n) or _f(*a, **k)
        )
    q, k, v = _row(torch.float32)
    cu = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]

    def forward(shard, layers=4):
        outs = []
        for layer in range(layers):  # sliding and full layers alternate, each layer a copy of the shard
            layer_shard = dataclasses.replace(shard)
            stand_in = iter([k, v])
            with mock.patch.object(cp_attention_module, "gather_tokens", lambda x, group, kv=stand_in: next(kv)):
                outs.append(
                    cp_attention(
                        _Module(),
                        q[:, :, layer_shard.index.clamp(min=0)],
                        None,
                        None,
                        None,
                        scaling=0.35,
                        cp_shard=layer_shard,
                        sliding_window=6 if layer % 2 else None,
                    )[0]
                )
        return outs

    shard = dataclasses.replace(plan_shards(cu, 1, "contiguous")[0], kernel=kernel)
    first = forward(shard)
    expected = "flex_query_block_mask" if kernel == "flex" else "query_runs"
    assert builds == [expected, expected]  # one per window, for four layers
    again = forward(dataclasses.replace(plan_shards(cu, 1, "contiguous")[0], kernel=kernel))  # the next forward
    assert builds == [expected] * 4
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def test_a_shard_without_its_kernel_is_refused_not_run_on_a_default():
    """No default kernel anywhere on the CP path: a shard nobody gave the run's backend fails in one line
    instead of attending through SDPA on a GPU run that asked for flash-attn."""
    shard = plan_shards([0, 4], 1, "contiguous")[0]
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="a context-parallel shard without its attention kernel"):
        cp_attention(_Module(), q, q, q, None, scaling=0.35, cp_shard=shard)
