"""Attention backends at the function level, backend resolution, and the startup self-check.

Each backend is compared with a float64 per-example reference (explicit masked softmax) on random q/k/v,
with GQA and sliding windows, values and gradients. The example lengths make ``sdpa_varlen`` use several
length buckets and ``sdpa_block_mask`` several tiles, so the gather/scatter paths are exercised.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from tests.conftest import REPO
from trainer.model import backends_sdpa
from trainer.model.attention import BACKENDS, AttentionBackendError, AttentionNeeds, attention_dropout, resolve_backend
from trainer.model.packed_layout import PackedLayout

CAUSAL = SimpleNamespace(is_causal=True)


def reference(q, k, v, lengths, window, scale):
    """Per-example causal (windowed) attention in float64: ``[1, H, T, D]`` -> ``[1, T, H, D]``."""
    q, k, v = (x.double() for x in (q, k, v))
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    outs, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        scores = (q[:, :, s] @ k[:, :, s].transpose(-1, -2)) * scale
        i = torch.arange(n)
        ok = i[None, :] <= i[:, None]
        if window:
            ok &= i[:, None] - i[None, :] < window
        outs.append(scores.masked_fill(~ok, float("-inf")).softmax(-1) @ v[:, :, s])
        start += n
    return torch.cat(outs, 2).transpose(1, 2)


def qkv(lengths, heads=4, kv_heads=4, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, heads, total, dim, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, total, dim, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, total, dim, generator=g, requires_grad=True)
    return q, k, v


def call(fn, q, k, v, lengths, window=None):
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    out, _ = fn(
        CAUSAL,
        q,
        k,
        v,
        None,
        scaling=0.3,
        dropout=0.0,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max(lengths),
        max_length_k=max(lengths),
        sliding_window=window,
    )
    return out


LENGTH_SETS = {
    "mixed": [7, 1, 30, 12, 3, 25, 9],
    "one": [19],
    "equal": [8, 8, 8],
}


@pytest.mark.parametrize("grouping", ["few", "many"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("lengths", list(LENGTH_SETS), ids=str)
@pytest.mark.parametrize("backend", ["sdpa_varlen", "sdpa_block_mask"])
def test_cpu_backend_matches_reference(backend, lengths, kv_heads, window, grouping, monkeypatch):
    lengths = LENGTH_SETS[lengths]
    if grouping == "many":  # a bucket per length, a tile per longest example: the gather paths run
        monkeypatch.setattr(backends_sdpa, "CALL_COST", 1.0)
        monkeypatch.setattr(backends_sdpa, "tile_width", lambda lengths, longest, call_pairs: longest)
    q, k, v = qkv(lengths, kv_heads=kv_heads)
    out = call(BACKENDS[backend].fn, q, k, v, lengths, window)
    ref = reference(q, k, v, lengths, window, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.float())
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_flex_forward_matches_reference_on_cpu(window):
    lengths = LENGTH_SETS["mixed"]
    q, k, v = (x.detach() for x in qkv(lengths, kv_heads=2))
    with torch.no_grad():
        out = call(BACKENDS["flex"].fn, q, k, v, lengths, window)
    torch.testing.assert_close(out.double(), reference(q, k, v, lengths, window, 0.3), atol=1e-5, rtol=1e-5)


def test_buckets_and_tiles():
    assert backends_sdpa.length_buckets([10, 2, 9, 8, 3], call_pairs=40) == [[0, 2], [3], [4, 1]]
    assert backends_sdpa.length_buckets([10, 2, 9, 8, 3], call_pairs=0) == [[0], [2], [3], [4], [1]]
    assert backends_sdpa.tiles([5, 5, 5, 2, 9], width=10) == [[0, 1], [2, 3], [4]]
    assert backends_sdpa.tile_width([5, 5, 5, 2, 9], 9) == 26  # one tile beats three of 64
    assert backends_sdpa.tile_width([300] * 8, 300) == 320  # 8 tiles of 320 beat one of 2400
    assert backends_sdpa.tile_width([300] * 8, 300, call_pairs=1e7) == 2400  # unless gathers cost more


def test_missing_boundaries_is_an_error():
    q, k, v = qkv([4, 4])
    for name in ("sdpa_varlen", "sdpa_block_mask", "flex"):
        with pytest.raises(AttentionBackendError, match="cu_seq_lens_q"):
            BACKENDS[name].fn(CAUSAL, q, k, v, None, scaling=0.3)
    with pytest.raises(AttentionBackendError, match="ends at"):
        call(BACKENDS["sdpa_varlen"].fn, q, k, v, [4, 3])


def test_layout_cache_follows_the_tensor():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert PackedLayout.of(cu) is PackedLayout.of(cu)
    cu[2] = 6  # an in-place change is seen
    assert PackedLayout.of(cu).lengths == [3, 3]


@pytest.mark.parametrize("name", ["flash_attn", "torch_varlen", "flex"])
def test_gpu_backends_refuse_cpu_with_one_line(name):
    with pytest.raises(AttentionBackendError) as e:
        resolve_backend(name, torch.device("cpu"), torch.bfloat16)
    message = str(e.value)
    assert "\n" not in message and f"model.attention={name} cannot run here" in message


def test_auto_and_unknown():
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16).name == "sdpa_varlen"
    with pytest.raises(AttentionBackendError, match="choose one of"):
        resolve_backend("magic", torch.device("cpu"))


def test_dropout_needs_a_backend_that_has_it(monkeypatch):
    """A model with attention dropout never gets a backend without it: ``auto`` moves on, a name fails."""
    import trainer.model.attention as attention

    # Pretend torch_varlen (no dropout) could run on this CPU.
    fake = dict(
        BACKENDS, torch_varlen=dataclasses.replace(BACKENDS["torch_varlen"], unavailable=lambda d, t=None: None)
    )
    monkeypatch.setattr(attention, "BACKENDS", fake)
    assert resolve_backend("auto", torch.device("cpu")).name == "torch_varlen"
    dropout = attention_dropout(SimpleNamespace(attn_pdrop=0.1))
    assert resolve_backend("auto", torch.device("cpu"), needs=AttentionNeeds(dropout=dropout)).name == "sdpa_varlen"
    with pytest.raises(AttentionBackendError, match="dropout"):
        resolve_backend("torch_varlen", torch.device("cpu"), needs=AttentionNeeds(dropout=dropout))


def test_a_head_dim_below_flex_kernels_minimum_is_refused_in_one_line(monkeypatch):
    """On an H200, Inductor's flex lowering failed deep in a compile for head dim 8 ("NYI: embedding
    dimension ... at least 16"): the head dim is read from the config and flex refused at start."""
    import trainer.model.attention as attention

    fake = dict(BACKENDS, flex=dataclasses.replace(BACKENDS["flex"], unavailable=lambda d, t=None: None))
    monkeypatch.setattr(attention, "BACKENDS", fake)
    cuda = torch.device("cuda")
    tiny = AttentionNeeds.of(AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=4))
    assert tiny.head_dim == 8
    with pytest.raises(AttentionBackendError, match="flex cannot run here: its kernel takes head dims of 16 and up"):
        resolve_backend("flex", cuda, needs=tiny)
    assert resolve_backend("flex", cuda, needs=AttentionNeeds.of(AutoConfig.for_model("llama"))).name == "flex"
    mla = AttentionNeeds.of(AutoConfig.for_model("deepseek_v3", qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8))
    assert mla.head_dim == 8
    assert AttentionNeeds.of(AutoConfig.for_model("gpt2", n_embd=64, n_head=8)).head_dim == 8


def test_config_names_exactly_the_registered_backends():
    """``model.attention`` is validated against ``trainer.config.ATTENTION_BACKENDS`` (no torch import)."""
    from trainer.config import ATTENTION_BACKENDS
    from trainer.model.attention import AUTO_ORDER

    assert tuple(BACKENDS) == ATTENTION_BACKENDS == AUTO_ORDER


@pytest.mark.slow
def test_cli_flash_attn_on_cpu_fails_with_one_line(tmp_path, cache_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            "model.attention=flash_attn",
            f"run_dir={tmp_path}",
            "parallel.device=cpu",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PACKFSDP_CACHE": cache_dir, "WANDB_MODE": "offline"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("packfsdp:")]
    assert len(lines) == 1 and "flash_attn cannot run here" in lines[0] and "CUDA" in lines[0], proc.stderr[-2000:]
