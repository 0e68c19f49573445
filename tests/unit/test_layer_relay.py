"""Chunked attention and the attention temperature of Llama 4, windows kept in the mask: handed to the layers.

``trainer.model.layer_relay``: a chunked layer attends inside chunks of ``attention_chunk_size`` positions
of each example (finer boundaries); a NoPE layer's temperature reads the token's position, not its row
index; Phi-3.5-MoE / Qwen2-MoE sliding layers get their window. Checked with an independent float64 probe
(``test_attention_sinks.packed_and_alone``: logits and every gradient, packed through the backend vs each
example alone through transformers' eager path), with the relay on (exact) and off (wrong), and in-process
through ``build_model`` and the startup self-check as the trainer runs it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.unit.test_attention_sinks import packed_and_alone, worst
from trainer.model import layer_relay
from trainer.model.attention import BACKENDS, AttentionBackendError, AttentionNeeds
from trainer.model.layer_relay import chunk_boundaries, per_token_floor_scale
from trainer.model.prepare import prepare_model

LLAMA4 = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=32,
    intermediate_size_mlp=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    num_local_experts=2,
    attention_chunk_size=4,
    floor_scale=4,
    attn_scale=0.5,
    pad_token_id=0,
    layer_types=["chunked_attention", "chunked_attention", "chunked_attention", "full_attention"],
    no_rope_layers=[1, 1, 1, 0],
)
"""Chunks of 4 and a temperature step every 4 positions (the NoPE layer is the full one, as in Llama 4)."""
LENGTHS = [9, 1, 14, 5, 11, 3]


def llama4(backend="sdpa_varlen", **overrides):
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama4_text", **(LLAMA4 | overrides))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="eager")
    model.config.use_cache = False
    return prepare_model(model, BACKENDS[backend])


def test_chunk_boundaries_cut_each_example_at_its_own_chunks():
    cu = torch.tensor([0, 9, 10, 24], dtype=torch.int32)
    assert chunk_boundaries(cu, 4).tolist() == [0, 4, 8, 9, 10, 14, 18, 22, 24]
    assert chunk_boundaries(cu, 32).tolist() == cu.tolist()
    assert chunk_boundaries(cu, 4).dtype == torch.int32


def test_per_token_floor_scale_gives_each_token_its_positions_floor():
    positions = torch.cat([torch.arange(n) for n in (9000, 1, 20000, 37)])[None]
    rows = torch.arange(1, positions.shape[1] + 1, dtype=torch.float32)
    divisors = per_token_floor_scale(positions, 8192.0)
    alone = torch.floor((positions[0].float() + 1) / 8192)
    torch.testing.assert_close(torch.floor(rows / divisors), alone, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["sdpa_varlen", "sdpa_block_mask"])
def test_packed_llama4_with_binding_chunks_equals_one_by_one_in_float64(backend):
    model = llama4(backend)
    packed, alone, g_packed, g_alone = packed_and_alone(model, LENGTHS)
    assert worst(packed, alone) < 1e-12 and worst(g_packed, g_alone) < 1e-10


@pytest.mark.parametrize("relay", ["CHUNK_DROPPED", "TEMPERATURE_BY_ROW"])
def test_without_either_relay_llama4_mixes(relay, monkeypatch):
    monkeypatch.setattr(layer_relay, relay, frozenset())
    packed, alone, _, _ = packed_and_alone(llama4(), LENGTHS)
    assert worst(packed, alone) > 1e-4


def test_chunks_are_refused_under_context_parallel():
    """CP's kernels take no finer boundaries: refused at start from the config, and in the layer."""
    config = AutoConfig.for_model("llama4_text", **LLAMA4)
    needs = AttentionNeeds.of(config)
    assert needs.chunk == 4 and needs.context_parallel_refusal(1) is None
    assert needs.context_parallel_refusal(2) == (
        "parallel.cp=2 cannot honour llama4_text's chunked attention (attention_chunk_size=4): use parallel.cp=1"
    )
    for unchunked in ({"layer_types": ["full_attention"] * 4}, {"attention_chunk_size": 64}):  # none, or unbound
        assert AttentionNeeds.of(AutoConfig.for_model("llama4_text", **(LLAMA4 | unchunked))).chunk is None
    sinks = AttentionNeeds.of(AutoConfig.for_model("gpt_oss"))
    assert "parallel.cp=2 cannot honour gpt_oss's attention sinks (s_aux)" in sinks.context_parallel_refusal(2)
    model = llama4()
    ids = torch.randint(1, 97, (1, 8))
    with pytest.raises(AttentionBackendError, match="chunked attention .* not packed under parallel.cp"):
        model.model(input_ids=ids, position_ids=torch.arange(8)[None], cp_shard=object(), use_cache=False)


def test_context_parallel_attention_refuses_sinks():
    from trainer.parallel.cp_attention import cp_attention
    from trainer.parallel.cp_layout import plan_shards

    q = torch.zeros(1, 4, 3, 8)
    shard = dataclasses.replace(plan_shards([0, 4], 1, "contiguous")[0], kernel="sdpa_varlen")
    with pytest.raises(AttentionBackendError, match=r"sdpa_varlen under parallel.cp cannot honour .*sinks \(s_aux\)"):
        cp_attention(None, q, q, q, None, cp_shard=shard, s_aux=torch.zeros(4))


@pytest.mark.parametrize(
    "family,config",
    [
        (
            "llama4_text",
            dict(
                attention_chunk_size=16,
                floor_scale=32,
                num_hidden_layers=4,
                num_local_experts=4,
                intermediate_size_mlp=128,
                head_dim=16,
            ),
        ),
        ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16)),
    ],
)
def test_the_trainer_builds_and_self_checks_them(family, config, tokenizer, small_dataset, tmp_path, monkeypatch):
    """As ``python -m trainer.train model=qwen2_tiny model.family=F model.config_overrides=...``: resolve
    from the config, build (family table, config verdict, relays), self-check a packed micro-batch of the
    run's examples (longer than the chunk, the window and the temperature step)."""
    from trainer.collate import collate_packed
    from trainer.config import JobConfig, ModelConfig
    from trainer.model import build_model, measure
    from trainer.pipeline import resolve_attention

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    sizes = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    cfg = JobConfig(model=ModelConfig(family=family, random_init=sizes, config_overrides=config))
    model = build_model(cfg.model, tokenizer, resolve_attention(cfg, torch.device("cpu")), seed=0)
    batch = collate_packed(small_dataset, [3, 17, 42, 5], tokenizer.pad_token_id)
    assert batch.max_seqlen > 32
    result = measure(model, batch)
    assert result.ok, result.line()
