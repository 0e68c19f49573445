"""Length-dependent rope types (Phi-3 longrope, Llama dynamic NTK) are exact when packed.

transformers picks their frequencies from the longest position of the whole input, so in a packed row the
longest example would set them for every example beside it. The reference is transformers' own model,
untouched, running each example alone from a fresh rope state; the packed row goes through the model as
``build_model`` prepares it (``trainer.model.rope``). Examples of lengths 9, 1, 14, 5, 11, 3 cross the
original context of 8.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.model import VarlenCausalLM, resolve_backend
from trainer.model.loading import prepare_model
from trainer.model.relay import BoundaryRelay
from trainer.model.rope import RopeError, apply_per_example_rope, example_lengths

ORIGINAL = 8
LENGTHS = (9, 1, 14, 5, 11, 3)
TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
ROPES = {
    "phi3-longrope": (
        "phi3",
        dict(
            max_position_embeddings=64,
            original_max_position_embeddings=ORIGINAL,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=[1.0, 1.1, 1.2, 1.3],
                long_factor=[2.0, 3.0, 4.0, 5.0],
                original_max_position_embeddings=ORIGINAL,
            ),
        ),
    ),
    "llama-dynamic": (
        "llama",
        dict(
            max_position_embeddings=ORIGINAL,
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0),
        ),
    ),
}


def hf_model(case: str) -> nn.Module:
    family, overrides = ROPES[case]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(family, **TINY, **overrides), attn_implementation="sdpa"
    )
    model.config.use_cache = False
    return model


def backend():
    return resolve_backend("sdpa_varlen", torch.device("cpu"), torch.float32)


def examples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 97, (n,), generator=g) for n in LENGTHS]


def fresh_rope(model: nn.Module) -> None:
    """Undo transformers' rope state (``dynamic`` keeps grown frequencies across calls): a fresh model."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "max_seq_len_cached"):
            module.inv_freq = module.original_inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len


class Run(NamedTuple):
    logits: list[torch.Tensor]
    """Each example's."""
    grads: dict[str, torch.Tensor]
    """Every parameter's gradient of the summed token cross-entropy."""


def token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    found = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return found


def reference(model: nn.Module, exs: list[torch.Tensor]) -> Run:
    """transformers' own model, each example alone from a fresh rope state; gradients summed."""
    wrapped = VarlenCausalLM(model, backend())
    logits = []
    for e in exs:
        fresh_rope(model)
        out = wrapped(
            input_ids=e[None], position_ids=torch.arange(len(e))[None], attention_mask=torch.ones_like(e)[None]
        )[0]
        token_loss(out, e).backward()
        logits.append(out.detach())
    return Run(logits, gradients(wrapped))


def run_packed(wrapped: VarlenCausalLM, exs: list[torch.Tensor]) -> Run:
    """The examples in one packed row through ``wrapped``: each example's logits, the summed loss's gradients."""
    cu = torch.tensor([0, *torch.tensor([len(e) for e in exs]).cumsum(0).tolist()], dtype=torch.int32)
    out = wrapped(torch.cat(exs)[None], torch.cat([torch.arange(len(e)) for e in exs])[None], cu, max(LENGTHS))[0]
    pieces = [out[s:t] for s, t in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=False)]
    sum(token_loss(piece, e) for piece, e in zip(pieces, exs, strict=False)).backward()
    return Run([piece.detach() for piece in pieces], gradients(wrapped))


def differences(packed: Run, alone: Run) -> tuple[float, float]:
    """(max |logit diff|, max |grad diff|), each relative to max(1, |one by one|)."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))

    return (
        max(rel(p, a) for p, a in zip(packed.logits, alone.logits, strict=False)),
        max(rel(packed.grads[n], g) for n, g in alone.grads.items()),
    )


@pytest.mark.parametrize("case", list(ROPES))
def test_packed_equals_one_by_one(case):
    model = hf_model(case)
    expected = reference(copy.deepcopy(model), examples())
    assert max(LENGTHS) > ORIGINAL >= min(LENGTHS)
    logit_diff, grad_diff = differences(run_packed(prepare_model(model, backend()), examples()), expected)
    assert logit_diff <= 1e-5 and grad_diff <= 1e-5, (logit_diff, grad_diff)


@pytest.mark.parametrize("case", list(ROPES))
def test_without_the_fix_packing_is_wrong(case):
    """What transformers alone does: the longest example sets the rope of every example in the row."""
    model = hf_model(case)
    expected = reference(copy.deepcopy(model), examples())
    logit_diff, grad_diff = differences(run_packed(VarlenCausalLM(model, backend()), examples()), expected)
    assert logit_diff > 1e-5 and grad_diff > 1e-4, (logit_diff, grad_diff)  # far outside the contract's 1e-5


@pytest.mark.parametrize("case", list(ROPES))
def test_padded_rows_get_their_own_rope(case):
    """A padded batch: each row's rope is that of its own length, not the longest row's."""
    model = hf_model(case)
    exs = examples()
    expected = reference(copy.deepcopy(model), exs).logits
    wrapped = prepare_model(model, backend())
    width = max(LENGTHS)
    ids = torch.zeros(len(exs), width, dtype=torch.long)
    mask = torch.zeros(len(exs), width, dtype=torch.long)
    for row, e in enumerate(exs):
        ids[row, : len(e)], mask[row, : len(e)] = e, 1
    with torch.no_grad():
        logits = wrapped(input_ids=ids, position_ids=torch.arange(width).expand(len(exs), width), attention_mask=mask)
    for row, e in enumerate(exs):
        torch.testing.assert_close(logits[row, : len(e)], expected[row], atol=1e-5, rtol=1e-5)


def test_plain_rope_is_untouched():
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))
    assert apply_per_example_rope(model, BoundaryRelay()) == []
    assert "forward" not in vars(model.model.rotary_emb)


def test_example_lengths():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6, 7]])  # 3 tokens, 1 token, 2 tokens, a piece at offset 5
    assert example_lengths(pos).tolist() == [[3, 3, 3, 1, 2, 2, 8, 8, 8]]
    # a piece that happens to continue the previous example's positions: cu_seqlens keeps them apart
    pos = torch.tensor([[0, 1, 2, 3, 4]])
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert example_lengths(pos, cu).tolist() == [[2, 2, 5, 5, 5]]
    # padded rows: the real tokens' length, pads excluded
    pos = torch.arange(4).expand(2, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert example_lengths(pos, attention_mask=mask).tolist() == [[2, 2, 2, 2], [4, 4, 4, 4]]


def test_unknown_length_dependent_rotary_is_refused():
    class HomemadeRotary(nn.Module):
        rope_type = "dynamic"

        def forward(self, x, position_ids):
            return x, x

    holder = nn.Module()
    holder.rotary_emb = HomemadeRotary()
    with pytest.raises(RopeError, match="'dynamic' in HomemadeRotary"):
        apply_per_example_rope(holder, BoundaryRelay())


def test_a_rotary_that_reads_the_length_its_own_way_is_refused():
    """Phi-3.5-MoE's longrope picks its mscale from the whole input's length inside its own forward: the
    per-example frequencies alone would not make it exact, and the check at build says so."""
    rope = dict(ROPES["phi3-longrope"][1]["rope_parameters"], short_mscale=1.0, long_mscale=1.5)
    config = AutoConfig.for_model(
        "phimoe",
        **TINY,
        max_position_embeddings=64,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters=rope,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    with pytest.raises(RopeError, match="phimoe: rope type 'longrope' in PhimoeRotaryEmbedding"):
        apply_per_example_rope(AutoModelForCausalLM.from_config(config), BoundaryRelay())


def label_hidden(wrapped: VarlenCausalLM, ids, positions, labels, cu=None, mask=None) -> torch.Tensor:
    """The hidden states the chunked loss reads (the decoder stack called directly, no logits)."""
    width = int(positions.max()) + 1
    return wrapped.label_hidden(ids, positions, cu, width, mask, labels=labels, fn=lambda head: head.hidden)


def alone(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """transformers' own model on one example (or a split piece at its offset), fresh rope: its label states."""
    fresh_rope(model)
    labels = ids.clone()
    labels[0] = -100
    return label_hidden(VarlenCausalLM(model, backend()), ids[None], positions[None], labels[None], mask=None)


@pytest.mark.parametrize("case", list(ROPES))
def test_the_chunked_loss_path_gets_each_example_its_rope(case):
    """The default loss calls the decoder stack, not the causal LM: the boundaries must reach the rope there
    too. A packed row whose split piece (14 tokens cut at 10: its positions 10, 11) follows an example of
    exactly 10 tokens, so the positions alone run on across the boundary; and a padded batch, through the
    prepared model and through a deep copy of it."""
    model = hf_model(case)
    pristine = copy.deepcopy(model)
    wrapped = prepare_model(model, backend())
    wrapped.use_loss("chunked")
    first, piece = examples()[4][:10], examples()[2][10:12]
    positions = torch.arange(12)
    ids, labels = torch.cat([first, piece]), torch.cat([first, piece])
    labels[[0, 10]] = -100
    cu = torch.tensor([0, 10, 12], dtype=torch.int32)
    packed = label_hidden(wrapped, ids[None], positions[None], labels[None], cu=cu)
    expected = torch.cat([alone(pristine, first, positions[:10]), alone(pristine, piece, positions[10:])])
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=1e-5)

    exs = examples()
    width = max(LENGTHS)
    ids = torch.zeros(len(exs), width, dtype=torch.long)
    mask = torch.zeros(len(exs), width, dtype=torch.long)
    for row, e in enumerate(exs):
        ids[row, : len(e)], mask[row, : len(e)] = e, 1
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    labels[:, 0] = -100
    expected = torch.cat([alone(pristine, e, torch.arange(len(e))) for e in exs])
    for model in (wrapped, copy.deepcopy(wrapped)):  # a copy (DPO's frozen reference) reads its own calls
        padded = label_hidden(model, ids, torch.arange(width).expand(len(exs), width), labels, mask=mask)
        torch.testing.assert_close(padded, expected, atol=1e-5, rtol=1e-5)
