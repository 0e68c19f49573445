"""Packed == one by one, per model family and attention backend: logits and every parameter's gradient.

Tiny random configs of GPT-2 (absolute positions), Llama (RoPE, GQA), Qwen2 (sliding window on its upper
layer), Qwen3 (q/k norms, explicit head_dim, sliding window) and Mistral (sliding window on every layer,
GQA). The reference runs each example alone through transformers' own SDPA path (its own causal and
sliding-window masks); the packed run goes through our backend. Some examples are longer than the window
of 6 and one is a single token, so windows that leak across examples or restart wrongly show up.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.collate import IGNORE_INDEX
from trainer.model import VarlenCausalLM, resolve_backend

VOCAB = 97
WINDOW = 6
LENGTHS = [9, 1, 14, 5, 11, 3]

FAMILIES = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64,
    ),
    "qwen2": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
    ),
    "qwen3": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, max_position_embeddings=64, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
    ),
    "mistral": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, sliding_window=WINDOW,
    ),
}
CPU_BACKENDS = ["sdpa_varlen", "sdpa_block_mask"]
GPU_BACKENDS = ["flash_attn", "torch_varlen", "flex", "sdpa_varlen", "sdpa_block_mask"]


def tiny_model(family: str, backend: str, device="cpu", dtype=torch.float32) -> VarlenCausalLM:
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=VOCAB, **FAMILIES[family])
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
    pieces = [logits[s:e] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    sum(token_loss_sum(p, e) for p, e in zip(pieces, exs)).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    alone = []
    for e in exs:
        out = model(input_ids=e[None], position_ids=torch.arange(len(e), device=device)[None],
                    attention_mask=torch.ones_like(e)[None])[0]
        token_loss_sum(out, e).backward()
        alone.append(out.detach())
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return [p.detach() for p in pieces], alone, packed_grads, alone_grads


def assert_equivalent(model, exs, atol, rtol):
    packed, alone, g_packed, g_alone = packed_vs_alone(model, exs)
    for i, (p, a) in enumerate(zip(packed, alone)):
        torch.testing.assert_close(p.float(), a.float(), atol=atol, rtol=rtol, msg=lambda m: f"example {i}: {m}")
    assert g_packed.keys() == g_alone.keys()
    for name in g_packed:
        torch.testing.assert_close(
            g_packed[name].float(), g_alone[name].float(), atol=atol, rtol=rtol, msg=lambda m: f"grad {name}: {m}"
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
        for e, s, t in zip(exs, cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(input_ids=e[None], position_ids=torch.arange(len(e))[None],
                          attention_mask=torch.ones_like(e)[None])[0]
            torch.testing.assert_close(logits[s:t], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_equals_one_by_one_gpu(family, backend):
    half = backend in ("flash_attn", "torch_varlen")  # their kernels compute in bf16/fp16 only
    dtype = torch.bfloat16 if half else torch.float32
    from trainer.model.attention import BACKENDS

    reason = BACKENDS[backend].unavailable(torch.device("cuda"), dtype)
    if reason:
        pytest.skip(reason)
    model = tiny_model(family, backend, device="cuda", dtype=dtype)
    tol = 3e-2 if half else 1e-4  # bf16 kernels of different shapes round differently; fp32 on GPU uses TF32-free SDPA
    assert_equivalent(model, examples("cuda"), atol=tol, rtol=tol)
