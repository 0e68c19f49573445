"""Packed == one by one, per model family and attention backend: logits and every parameter's gradient.

Tiny random configs of GPT-2 (absolute positions), Llama (RoPE, GQA), Qwen2 (sliding window on its upper
layer), Qwen3 (q/k norms, explicit head_dim, sliding window) and Mistral (sliding window on every layer,
GQA). The reference runs each example alone through transformers' own SDPA path (its own causal and
sliding-window masks); the packed run goes through our backend. Some examples are longer than the window
of 6 and one is a single token, so windows that leak across examples or restart wrongly show up.

The CPU cases use head dim 8 (16 for Qwen3) to stay fast; the GPU cases widen the same configs to real head
dims (64 for every family, 128 for Qwen2), which the kernels and Inductor's flex lowering need.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.data.examples import IGNORE_INDEX
from trainer.model import VarlenCausalLM, resolve_backend

VOCAB = 97
WINDOW = 6
LENGTHS = [9, 1, 14, 5, 11, 3]

FAMILIES = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ),
    "qwen2": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    ),
    "qwen3": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    ),
    "mistral": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=WINDOW,
    ),
}
CPU_BACKENDS = ["sdpa_varlen", "sdpa_block_mask"]
GPU_BACKENDS = ["flash_attn", "torch_varlen", "sdpa_varlen"]
GPU_CASES = [(family, 64) for family in FAMILIES] + [("qwen2", 128)]
FLEX_GPU_CASES = [("llama", 64), ("qwen2", 128)]
"""flex on two cases only: Inductor compiles it per head count and head dim (~20-30 s each on an H200, the
first GPU check), and its masks do not depend on the family. ``sdpa_block_mask`` (the whole row, masked) is a CPU
backend in practice: slower than padding on a GPU."""
GPU_RUNS = [(f, d, b) for f, d in GPU_CASES for b in GPU_BACKENDS] + [(f, d, "flex") for f, d in FLEX_GPU_CASES]
"""(family, head_dim) of the GPU cases: real head dims. The tiny ones (8, 16) are below what Inductor's flex
lowering takes (16 and up) and far from the shapes the kernels are tuned for."""


def family_config(family: str, head_dim: int | None = None):
    """The family's transformers config: tiny (``FAMILIES``), or widened to ``head_dim`` per head with the
    same heads, kv heads, layers and window (hidden size = heads x ``head_dim``, MLP twice that)."""
    overrides = dict(FAMILIES[family])
    if head_dim is not None:
        if family == "gpt2":
            overrides["n_embd"] = overrides["n_head"] * head_dim
        else:
            overrides["hidden_size"] = overrides["num_attention_heads"] * head_dim
            overrides["intermediate_size"] = 2 * overrides["hidden_size"]
            if "head_dim" in overrides:  # qwen3 states it explicitly
                overrides["head_dim"] = head_dim
    return AutoConfig.for_model(family, vocab_size=VOCAB, **overrides)


def tiny_model(
    family: str, backend: str, device="cpu", dtype=torch.float32, head_dim: int | None = None
) -> VarlenCausalLM:
    """The family's model behind ``backend``: tiny, or at a real ``head_dim`` (``family_config``)."""
    torch.manual_seed(0)
    config = family_config(family, head_dim)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device=device, dtype=dtype)
    model.config.use_cache = False
    return VarlenCausalLM(model, resolve_backend(backend, torch.device(device), dtype))


def examples(device="cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).to(device) for n in LENGTHS]


def token_loss_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of one example (its first token has no label)."""
    labels = ids.clone()
    labels[0] = IGNORE_INDEX
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")


def packed_vs_alone(model: VarlenCausalLM, exs: list[torch.Tensor]):
    """(packed logits, alone logits, packed grads, alone grads) of the same examples."""
    device = exs[0].device
    ids = torch.cat(exs)[None]
    cu = torch.tensor([0] + [len(e) for e in exs], device=device).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(len(e), device=device) for e in exs])[None]

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos, cu_seqlens=cu, max_seqlen=max(LENGTHS))[0]
    pieces = [logits[s:e] for s, e in pairwise(cu.tolist())]
    sum(token_loss_sum(p, e) for p, e in zip(pieces, exs, strict=True)).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model.zero_grad(set_to_none=True)
    alone = []
    for e in exs:
        out = model(
            input_ids=e[None],
            position_ids=torch.arange(len(e), device=device)[None],
            attention_mask=torch.ones_like(e)[None],
        )[0]
        token_loss_sum(out, e).backward()
        alone.append(out.detach())
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return [p.detach() for p in pieces], alone, packed_grads, alone_grads


def assert_equivalent(model, exs, atol, rtol, grad_norm_tol=None):
    """Logits element by element; gradients element by element, or (``grad_norm_tol``, for models held in
    bf16, whose gradient sums over tokens round differently by the order of their terms: a few elements of
    a 25k-element embedding gradient off by one bf16 step, seen on an H200) by ``|a - b| / |b|`` over each
    tensor."""
    packed, alone, g_packed, g_alone = packed_vs_alone(model, exs)
    for i, (p, a) in enumerate(zip(packed, alone, strict=True)):
        torch.testing.assert_close(p.float(), a.float(), atol=atol, rtol=rtol, msg=lambda m, i=i: f"example {i}: {m}")
    assert g_packed.keys() == g_alone.keys()
    if grad_norm_tol is not None:
        for name in g_packed:
            a, b = g_packed[name].float(), g_alone[name].float()
            gap = float((a - b).norm() / b.norm().clamp_min(1e-12))
            assert gap < grad_norm_tol, f"grad {name}: |packed - alone| / |alone| = {gap:.3g}"
        return
    for name in g_packed:
        torch.testing.assert_close(
            g_packed[name].float(),
            g_alone[name].float(),
            atol=atol,
            rtol=rtol,
            msg=lambda m, name=name: f"grad {name}: {m}",
        )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_equals_one_by_one_cpu(family, backend):
    model = tiny_model(family, backend)
    if family in ("qwen2", "qwen3", "mistral"):  # the window really is on and shorter than some examples
        assert model.config.sliding_window == WINDOW and max(LENGTHS) > WINDOW
    assert_equivalent(model, examples(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flex_forward_matches_on_cpu(family):
    """FlexAttention's mask logic, checked where it can run here: forward only (no CPU backward)."""
    from trainer.model.attention import BACKENDS

    model = tiny_model(family, "sdpa_varlen")
    model.backend = BACKENDS["flex"]  # bypasses resolve_backend, which refuses flex for training on CPU
    exs = examples()
    with torch.no_grad():
        ids = torch.cat(exs)[None]
        cu = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
        pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
        logits = model(input_ids=ids, position_ids=pos, cu_seqlens=cu, max_seqlen=max(LENGTHS))[0]
        for e, s, t in zip(exs, cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            alone = model(
                input_ids=e[None], position_ids=torch.arange(len(e))[None], attention_mask=torch.ones_like(e)[None]
            )[0]
            torch.testing.assert_close(logits[s:t], alone, atol=1e-5, rtol=1e-5)


def attention_head_dims(model: VarlenCausalLM) -> set[int]:
    """The head dims the model's attention layers really use (read from the built modules)."""
    return {m.head_dim for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "head_dim")}


@pytest.mark.parametrize(("family", "head_dim"), GPU_CASES)
def test_gpu_cases_use_real_head_dims(family, head_dim):
    """Runs without a GPU, so the GPU cases cannot drift back to toy head dims unnoticed."""
    assert head_dim in (64, 128)
    model = tiny_model(family, "sdpa_varlen", head_dim=head_dim)
    assert attention_head_dims(model) == {head_dim}
    window = getattr(family_config(family), "sliding_window", None)
    assert getattr(model.config, "sliding_window", None) == window  # widened, not otherwise changed
    assert {f for f, _ in GPU_CASES} == set(FAMILIES) and 128 in {d for _, d in GPU_CASES}


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "head_dim", "backend"), GPU_RUNS)
def test_packed_equals_one_by_one_gpu(family, head_dim, backend):
    half = backend in ("flash_attn", "torch_varlen")  # their kernels compute in bf16/fp16 only
    dtype = torch.bfloat16 if half else torch.float32
    from trainer.model.attention import BACKENDS

    reason = BACKENDS[backend].unavailable(torch.device("cuda"), dtype)
    if reason:
        pytest.skip(reason)
    model = tiny_model(family, backend, device="cuda", dtype=dtype, head_dim=head_dim)
    tol = 3e-2 if half else 1e-4  # bf16 kernels of different shapes round differently; fp32 on GPU uses TF32-free SDPA
    assert_equivalent(model, examples("cuda"), atol=tol, rtol=tol, grad_norm_tol=1e-2 if half else None)
