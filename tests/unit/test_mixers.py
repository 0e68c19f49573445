"""Token mixers outside attention (short convolutions, gated delta rule, state-space scans) in packed rows.

The reference here is this file's own: each example through the bare transformers model alone, its float64
cross-entropy summed; the packed row goes through ``VarlenCausalLM`` (``prepare_model``: the mixers kept
per example) and its logits are cut at the boundaries. No comparison of the library's own is used. The
gated delta rule and the Mamba-2 scan compute in float32 inside transformers' float64 models, so their gaps
are ~1e-7; a mixer that carries its state across a boundary is off by 1e-3 and more.
"""

from __future__ import annotations

import copy
import warnings
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._composable import checkpoint as checkpoint_activations
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.config import ConfigError
from trainer.model import prepare
from trainer.model.attention import AttentionNeeds, resolve_backend
from trainer.model.certification import measure, packed_batch
from trainer.model.certification.shrink import replica_config
from trainer.model.mixers import PackedMixerForward, find_token_mixers
from trainer.model.prepare import prepare_model
from trainer.parallel.route import refuse_unshardable

VOCAB = 96
LENGTHS = (23, 1, 9, 9, 3)
"""Longer than every convolution (4 taps) and Mamba-2's chunks (16 here); two of one length share a call."""
LONG = (70, 1, 9, 9, 3)
"""For the gated delta rule, whose chunks are 64 tokens."""
TOLERANCE = 1e-5
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=2,
    max_position_embeddings=256,
    pad_token_id=0,
    tie_word_embeddings=False,
)
CONFIGS = {
    "short convolution (lfm2)": ("lfm2", dict(layer_types=["conv", "full_attention"], block_ff_dim=64), LENGTHS),
    "gated delta rule (qwen3_next)": (
        "qwen3_next",
        dict(
            layer_types=["linear_attention", "full_attention"],
            mlp_only_layers=[0, 1],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
        LONG,
    ),
    "state-space scan, Mamba-1 (falcon_mamba)": (
        "falcon_mamba",
        dict(state_size=8, expand=2, time_step_rank=4),
        LENGTHS,
    ),
    "gated delta rule (qwen3_5_text)": (
        "qwen3_5_text",
        dict(
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
        LONG,
    ),
    "KDA (kimi_linear)": (
        "kimi_linear",
        dict(
            layer_types=["linear_attention", "full_attention"],
            num_key_value_heads=4,
            num_experts=4,
            num_experts_per_token=2,
            moe_intermediate_size=16,
            linear_num_heads=4,
            linear_head_dim=8,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            kv_lora_rank=16,
            q_lora_rank=16,
            mlp_layer_types=["dense", "dense"],
        ),
        LENGTHS,
    ),
    "Mamba-2 (nemotron_h)": (
        "nemotron_h",
        dict(
            layers_block_type=["mamba", "attention"],
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=1,
            chunk_size=16,
        ),
        LENGTHS,
    ),
    "Mamba-2 (falcon_h1)": (
        "falcon_h1",
        dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16),
        LENGTHS,
    ),
    "Mamba-2 (granitemoehybrid)": (
        "granitemoehybrid",
        dict(
            layer_types=["mamba", "attention"],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_chunk_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        LENGTHS,
    ),
}
"""The families the issue names (the convolution, delta-rule / KDA and Mamba-1 / Mamba-2 kinds among them)."""


def build(family: str, overrides: dict, lengths=LENGTHS, dtype=torch.float64, device="cpu"):
    device = torch.device(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(family, **(SMALL | overrides))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        ).to(device)  # grouped GEMM: no float64
    backend = resolve_backend("sdpa_varlen", device, dtype, AttentionNeeds.of(config))
    wrapped = prepare_model(model, backend)
    wrapped.padded_attention = "eager"
    return wrapped.eval()  # gradients still flow


def examples(lengths) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]


def token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum")


def grads_of(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def alone(wrapped, exs):
    """Each example through the bare transformers model, no mask, no wrapper, transformers' eager attention."""
    wrapped.model.config._attn_implementation = "eager"
    logits = []
    for e in exs:
        out = wrapped.model(input_ids=e[None], use_cache=False).logits[0]
        token_loss(out, e).backward()
        logits.append(out.detach())
    return logits, grads_of(wrapped)


def packed(wrapped, exs):
    """The examples in one packed row through the wrapper (positions restarting, ``cu_seqlens``)."""
    device = exs[0].device
    cu = torch.tensor([0, *torch.tensor([len(e) for e in exs]).cumsum(0).tolist()], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(len(e), device=device) for e in exs])[None]
    out = wrapped(torch.cat(exs)[None], positions, cu, max(len(e) for e in exs))[0]
    pieces = [out[s:t] for s, t in pairwise(cu.tolist())]
    sum(token_loss(p, e) for p, e in zip(pieces, exs, strict=True)).backward()
    return [p.detach() for p in pieces], grads_of(wrapped)


def padded(wrapped, exs):
    """The examples as the padded baseline's batch: one row each, right-padded with the pad token, a mask."""
    width = max(len(e) for e in exs)
    ids = torch.zeros(len(exs), width, dtype=torch.long)
    mask = torch.zeros(len(exs), width, dtype=torch.long)
    for i, e in enumerate(exs):
        ids[i, : len(e)], mask[i, : len(e)] = e, 1
    out = wrapped(ids, torch.arange(width).expand(len(exs), -1), attention_mask=mask)
    pieces = [out[i, : len(e)] for i, e in enumerate(exs)]
    sum(token_loss(p, e) for p, e in zip(pieces, exs, strict=True)).backward()
    return [p.detach() for p in pieces], grads_of(wrapped)


def gap(run, reference) -> float:
    """The worst relative gap of logits and gradients (a gradient in one run only: infinite)."""
    (logits, grads), (ref_logits, ref_grads) = run, reference
    worst = max(
        float((a - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in zip(logits, ref_logits, strict=True)
    )
    if grads.keys() != ref_grads.keys():
        return float("inf")
    return max(
        worst,
        *(float((grads[k] - ref_grads[k]).abs().max()) / max(1.0, float(ref_grads[k].abs().max())) for k in grads),
    )


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_packed_and_padded_rows_equal_each_example_alone(kind):
    model = build(*CONFIGS[kind])
    assert find_token_mixers(model.model), "no token mixer found"
    exs = examples(CONFIGS[kind][2])
    reference = alone(model, exs)
    assert gap(packed(model, exs), reference) < TOLERANCE
    assert gap(padded(model, exs), reference) < TOLERANCE


@pytest.mark.parametrize("kind", ["short convolution (lfm2)", "state-space scan, Mamba-1 (falcon_mamba)"])
def test_the_comparison_sees_a_mixer_left_across_the_boundaries(kind, monkeypatch):
    """The same comparison with the mixers as transformers wrote them: examples leak (the test binds)."""
    monkeypatch.setattr(prepare, "keep_mixers_apart", lambda *args: [])
    model = build(*CONFIGS[kind])
    exs = examples(CONFIGS[kind][2])
    assert gap(packed(model, exs), alone(model, exs)) > 1e-3


def test_mixers_are_found_from_the_built_modules():
    """The outermost module that owns a sequence convolution or a recurrence's decay is kept apart, once:
    Kimi's delta attention owns its convolutions and its forget gate (A_log, dt_bias), which is not wrapped
    again; attention and MLP modules are not mixers."""
    found = find_token_mixers(build(*CONFIGS["KDA (kimi_linear)"]).model)
    assert [(m.name, type(m.module).__name__, m.traits) for m in found] == [
        ("model.layers.0.self_attn", "KimiLinearDeltaAttention", ("short convolution",))
    ]


@pytest.mark.parametrize("kind", ["gated delta rule (qwen3_next)", "state-space scan, Mamba-1 (falcon_mamba)"])
def test_activation_checkpointing_recomputes_per_example(kind):
    """A checkpointed layer runs again in backward, after the forward's boundaries are gone: the relay finds
    them again from the layer's input (Falcon-Mamba's layers are called without any boundary kwargs)."""
    model = build(*CONFIGS[kind])
    exs = examples(CONFIGS[kind][2])
    reference = alone(model, exs)
    for layer in model.decoder_layers():
        checkpoint_activations(layer)
    assert gap(packed(model, exs), reference) < TOLERANCE


def test_a_deep_copy_keeps_its_own_mixers():
    """The preference reference is a ``deepcopy`` of the model: its mixers run its own weights, per example,
    through its own relay."""
    model = build(*CONFIGS["short convolution (lfm2)"])
    frozen = copy.deepcopy(model)
    mixer = find_token_mixers(frozen.model)[0].module
    forward = mixer.__dict__["forward"]
    assert isinstance(forward, PackedMixerForward) and forward.module is mixer
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    exs = examples(LENGTHS)
    assert gap(packed(frozen, exs), alone(frozen, exs)) < TOLERANCE


def test_context_parallel_refuses_a_model_with_token_mixers():
    model = build(*CONFIGS["short convolution (lfm2)"])
    refuse_unshardable(model.model, 1)
    with pytest.raises(
        ConfigError, match=r"parallel.cp=2: .*Lfm2ShortConv .*short convolution.*use parallel.cp=1"
    ) as info:
        refuse_unshardable(model.model, 2)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kept", [True, False])
def test_the_startup_self_check_sees_the_mixers(kept, monkeypatch):
    """The run's own self-check (packed through the run's path vs each example alone) passes with the mixers
    kept apart and fails with them left across the boundaries."""
    if not kept:
        monkeypatch.setattr(prepare, "keep_mixers_apart", lambda *args: [])
    model = build(*CONFIGS["short convolution (lfm2)"], dtype=torch.float32)
    result = measure(model, packed_batch(examples(LENGTHS)))
    assert result.ok is kept, result.line()


@pytest.mark.parametrize("family", ["jamba", "zamba2", "nemotron_h", "qwen3_next"])
def test_the_config_verdicts_replica_keeps_a_layer_of_each_kind(family):
    """The released configs' layer patterns (Jamba's attention every 8th layer, Zamba2's hybrid layer ids,
    Nemotron-H's four block types) keep one layer of each kind in the verdict's tiny replica, whose chunks
    are shrunk below its examples; Zamba2's (its layer ids remapped) builds."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(family)
        replica = replica_config(config)

    def kinds(c):
        return set(getattr(c, "layers_block_type", None) or c.layer_types)

    assert kinds(replica) == kinds(config)
    assert getattr(replica, "chunk_size", 8) <= 8
    if family == "zamba2":
        AutoModelForCausalLM.from_config(replica)
