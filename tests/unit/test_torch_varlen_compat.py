"""``torch_varlen`` on each ``varlen_attn`` signature torch has shipped, with fakes of that signature on CPU.

torch 2.9 has no ``varlen_attn``; 2.10 takes ``is_causal`` (no scale, no window, no GQA flag); 2.11 adds
keyword-only ``scale`` and ``window_size``; 2.12 on add ``enable_gqa``. Each fake below has the real signature
of its version and computes what the flash kernel does, example by example with SDPA, so the backend's
output is checked against the float64 per-example reference of ``test_attention_backends``. What only a GPU
shows (the real kernels, bf16 numerics) is left to the ``gpu`` tests.
"""

from __future__ import annotations

import sys
from itertools import pairwise

import pytest
import torch
import torch.nn.attention.varlen
import torch.nn.functional as F

from tests.unit.test_attention_backends import call, qkv, reference
from trainer.model import backends_cuda
from trainer.model.attention import AttentionBackendError
from trainer.model.backends_cuda import torch_varlen_attention, torch_varlen_unavailable

LENGTHS = [7, 1, 12, 5]


def flash_kernel(q, k, v, cu, max_len, scale, window_size, enable_gqa=False):
    """What the varlen flash kernel computes, per example with SDPA: ``[T, H, D]`` in and out."""
    assert cu.dtype == torch.int32 and type(max_len) is int
    assert enable_gqa or k.shape[1] == q.shape[1], "kv heads differ from query heads without enable_gqa"
    left, right = window_size
    assert right == 0, "packed attention is causal"
    bounds, outs = cu.tolist(), []
    for start, end in pairwise(bounds):
        i = torch.arange(end - start)
        ok = i[None, :] <= i[:, None]
        if left >= 0:
            ok &= i[:, None] - i[None, :] <= left
        q_ex, k_ex, v_ex = (x[start:end].transpose(0, 1) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q_ex, k_ex, v_ex, attn_mask=ok, scale=scale, enable_gqa=enable_gqa)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert is_causal
    return flash_kernel(query, key, value, cu_seq_q, max_q, None, (-1, 0))


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    return flash_kernel(query, key, value, cu_seq_q, max_q, scale, window_size)


def varlen_attn_2_13(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    kv_heads_seen.append(key.shape[1])
    return flash_kernel(query, key, value, cu_seq_q, max_q, scale, window_size, enable_gqa)


kv_heads_seen: list[int] = []


@pytest.fixture
def use_varlen_attn(monkeypatch):
    """Install a fake ``varlen_attn`` and forget the signature read from the previous one."""

    def install(fake):
        monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", fake)
        monkeypatch.setattr(backends_cuda, "_varlen_attn_signature", {})

    return install


def check_against_reference(kv_heads: int, window: int | None) -> None:
    q, k, v = qkv(LENGTHS, heads=4, kv_heads=kv_heads)
    out = call(torch_varlen_attention, q, k, v, LENGTHS, window)
    out.sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = reference(q2, k2, v2, LENGTHS, window, 0.3)
    ref.sum().backward()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for grad, x in zip(grads, (q2, k2, v2), strict=True):
        torch.testing.assert_close(grad, x.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_torch_2_11_signature_has_no_enable_gqa(use_varlen_attn, kv_heads, window):
    use_varlen_attn(varlen_attn_2_11)
    check_against_reference(kv_heads, window)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_torch_2_13_signature_gets_enable_gqa(use_varlen_attn, kv_heads):
    use_varlen_attn(varlen_attn_2_13)
    kv_heads_seen.clear()
    check_against_reference(kv_heads, window=5)
    assert kv_heads_seen == [kv_heads]  # GQA left to the kernel: kv heads not repeated


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_torch_2_10_signature_folds_the_scale_into_the_query(use_varlen_attn, kv_heads):
    use_varlen_attn(varlen_attn_2_10)
    check_against_reference(kv_heads, window=None)


def test_torch_2_10_refuses_a_sliding_window_in_one_line(use_varlen_attn):
    use_varlen_attn(varlen_attn_2_10)
    q, k, v = qkv(LENGTHS)
    with pytest.raises(AttentionBackendError, match="no sliding window.*torch >= 2.11"):
        call(torch_varlen_attention, q, k, v, LENGTHS, window=5)


def test_signature_is_read_once(use_varlen_attn, monkeypatch):
    use_varlen_attn(varlen_attn_2_11)
    reads = []
    real_signature = backends_cuda.inspect.signature
    monkeypatch.setattr(backends_cuda.inspect, "signature", lambda fn: reads.append(fn) or real_signature(fn))
    for _ in range(3):
        call(torch_varlen_attention, *qkv(LENGTHS), LENGTHS)
    assert [fn for fn in reads if fn is varlen_attn_2_11] == [varlen_attn_2_11]


def test_torch_without_varlen_attn_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # import now fails
    monkeypatch.setattr(backends_cuda, "_varlen_attn_signature", {})
    reason = torch_varlen_unavailable(torch.device("cuda"), torch.bfloat16)
    assert "has no torch.nn.attention.varlen.varlen_attn" in reason and "torch 2.10" in reason
    assert "\n" not in reason
