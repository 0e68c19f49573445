"""The replica's config: a tiny config of the same family with every setting that shapes how tokens mix.

``replica_config(config)`` keeps the ``model_type`` and every token-mixing setting of a user's config (layer
types, windows, chunks, rope type, MoE routing, softcapping, ...) and shrinks the rest:

- widths (``SHRINK``), never above the config's own, keeping what its shape needs (``shrunk_shapes``: head
  counts in proportion, so multi-head latent attention keeps as many KV heads as heads; equal head dims,
  vocabularies and expert counts stay equal; experts per token within the experts);
- layers: one of each distinct per-layer pattern, at least two (``shrunk_layers``: ``layer_types``,
  per-layer lists, lists of layer ids, dense-first / shared-last counts, sections, layer periods);
- windows, chunks, selections and rope thresholds below the replica's longest example (``SMALL``,
  ``ROPE_ORIGINAL``), so that examples cross them side by side; a window as long as the context stays so.

``default_config(family)`` is what the family matrix's probe starts from: the family's default config
(``DEFAULT_FIXES`` where transformers' default cannot build a model), a sliding window where it has one.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from transformers import AutoConfig, PreTrainedConfig

VOCAB = 128
SHRINK = {
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "n_inner": 128,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "n_ctx": 64,
    "sliding_window": 6,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "use_cache": False,
    "tie_word_embeddings": False,
    "decoder_layers": 2,
    "encoder_layers": 1,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "n_embed": 64,
    "num_decoder_layers": 2,
    "n_layers": 2,
    "n_heads": 4,
    "max_seq_len": 64,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "embedding_dim": 64,
    "num_blocks": 2,
    "expert_ffn_hidden_size": 32,
    "zero_expert_num": 2,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "num_expert_group": 1,
    "attention_hidden_size": 128,
    "attention_head_dim": 32,
    "mamba_dt_rank": 8,
    "model_max_length": 64,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    "rotary_dim": 8,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "index_num_heads": 2,
    "hidden_size_global": 64,
    "encoder_hash_byte_group_vocab": VOCAB,
    "indexer_n_heads": 2,
    "indexer_head_dim": 16,
    # state-space / linear-attention mixers (trainer.model.mixers): heads x head dim = expand x hidden
    "expand": 1,
    "state_size": 16,
    "n_groups": 1,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_d_ssm": 128,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 8,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_mamba_heads": 8,
    "mamba_headdim": 16,
}
"""Tiny values for the config fields a family has (a field the family lacks is left out), shrunk by
``shrunk_shapes``: never above the config's own value, the config's equalities kept."""
HEAD_COUNTS = (
    "num_attention_heads",
    "n_head",
    "num_heads",
    "n_heads",
    "num_key_value_heads",
    "decoder_attention_heads",
    "encoder_attention_heads",
    "index_n_heads",
    "index_num_heads",
    "indexer_n_heads",
    "linear_num_heads",
    "kv_n_heads",
)
"""Head counts: shrunk together, to 4, 2 or 1 in proportion to the largest, so counts equal in the config stay
equal (multi-head latent attention runs only with as many KV heads as heads) and each divides the larger."""
KEPT_EQUAL = (
    (
        "head_dim",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "index_head_dim",
        "linear_head_dim",
        "attention_head_dim",
        "rotary_dim",
        "indexer_head_dim",
    ),
    ("vocab_size", "vocab_size_per_layer_input"),
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
)
"""Fields that stay equal where the config has them equal (each takes the smallest tiny value among them): head
dims (MLA's ``head_dim`` is its rope head dim), vocabularies (Gemma 3n's per-layer input), expert counts."""
EXPERT_COUNTS = KEPT_EQUAL[2]
TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk")
"""Experts per token: at most the tiny expert count."""
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
UNSET_KEPT = (*TOKEN_IDS, "q_lora_rank")
"""Fields whose ``None`` means "none" (no pad token: no zero embedding row; no query LoRA), kept unset; any
other ``None`` (a size the config derives) takes the tiny value."""
FIRST_LAYERS = ("first_k_dense_replace", "num_dense_layers", "max_window_layers")
"""Counts of the config's first layers that differ (dense before MoE, windowed before full)."""
LAST_LAYERS = ("num_kv_shared_layers",)
"""Counts of the config's last layers that differ (Gemma 3n's layers reusing an earlier layer's keys)."""
COUNT_NAMES = ("num_hidden_layers", "n_layer", "num_layers")
MAMBA_WIDTHS = (("mamba_n_heads", "mamba_d_head", "mamba_d_ssm"),)
"""(heads, head dim, inner width) of a Mamba-2 mixer whose config sets all three (Falcon-H1): shrunk, the inner
width follows the other two, as the config validates."""
DEFAULT_FIXES = {
    "cohere_compass_text": {
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in ("full_attention", "sliding_attention")
        }
    },
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2},
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 256,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
}
"""What transformers' default config of these families lacks to build a model at all (its own validation
fails, or the model reads a setting the default leaves unset); the probe's tiny config starts from it."""
NO_DROPOUT = (
    "attention_dropout",
    "hidden_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dropout",
    "activation_dropout",
    "embedding_dropout",
    "mlp_dropout",
)


def own_values(config) -> dict:
    """``config.to_dict()`` with the layer fields as the config holds them (Dory serializes each layer as
    two blocks, attention and MLP, doubling its counts and ``layer_types``)."""
    values = config.to_dict()
    for name, value in values.items():
        if "layer" in name and isinstance(value, (int, list)) and not isinstance(value, bool):
            try:
                held = getattr(config, name, value)
            except RuntimeError:  # a per-layer field of a heterogeneous config: its serialized form stands
                continue
            if type(held) is type(value) and held != value:
                values[name] = held
    return values


def shrunk_shapes(values: dict) -> dict:
    """Tiny values (``SHRINK``) for the shape fields of a config's ``values`` (sub-configs too), each at most
    the config's own (Zaya's one expert per token, a zero-width per-layer input stay) and keeping what the
    config's shape needs: ``HEAD_COUNTS`` in proportion, ``KEPT_EQUAL`` equalities, ``TOP_K`` within the
    experts; ``UNSET_KEPT`` fields the config leaves unset stay unset."""
    out = {}
    for name, tiny in SHRINK.items():
        value = values.get(name)
        if name not in values or (value is None and name in UNSET_KEPT):
            continue
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and name not in TOKEN_IDS
        if isinstance(value, list) and name not in TOKEN_IDS and all(isinstance(v, int) for v in value):
            out[name] = [min(v, tiny) for v in value]  # per layer (Gemma 3n's intermediate sizes)
        else:
            out[name] = min(value, tiny) if numeric else tiny
    counts = {k: values[k] for k in HEAD_COUNTS if k in out and isinstance(values[k], int) and values[k] > 0}
    for name, count in counts.items():
        share = max(1, 4 * count // max(counts.values()))
        out[name] = min(count, 1 << (share.bit_length() - 1))  # 4, 2 or 1: each divides the larger
    for group in KEPT_EQUAL:
        present = [k for k in group if k in out and isinstance(values[k], int)]
        for value in {values[k] for k in present}:
            same = [k for k in present if values[k] == value]
            low = min(out[k] for k in same)
            out.update(dict.fromkeys(same, low))
    experts = [out[k] for k in EXPERT_COUNTS if k in out]
    for name in TOP_K:
        if name in out and experts:
            out[name] = min(out[name], min(experts))
    for heads, head, inner in MAMBA_WIDTHS:  # a Mamba-2 scan's inner width is its heads x head dim (validated)
        if {heads, head, inner} <= out.keys() and isinstance(values.get(inner), int):
            out[inner] = out[heads] * out[head]
    for name, value in values.items():  # sub-configs (DBRX's attention and FFN, BLT's encoder / decoder)
        if isinstance(value, dict) and name not in ("rope_parameters", "rope_scaling") and value.keys() & SHRINK.keys():
            # 5.17's DBRX takes no others
            own = {k: v for k, v in value.items() if k not in _base_fields() or k in SHRINK}
            out[name] = own | shrunk_shapes(value)
            out[name] |= shrunk_layers(value, 2, out[name])
    return out


@functools.cache
def _base_fields() -> frozenset[str]:
    """The fields every transformers config has (``PreTrainedConfig``'s own), not a family's."""
    return frozenset(PreTrainedConfig().to_dict())


@dataclass(frozen=True)
class LayerFields:
    """A config's fields that differ by layer, by how they name its layers (``layer_fields``)."""

    layers: int
    """The config's layer count."""
    per_layer: tuple[str, ...]
    """Lists of one setting per layer (``layer_types``, Gemma 3n's intermediate sizes)."""
    sources: tuple[str, ...]
    """Per-layer lists of the layer each reads keys from (Kolibri's ``kv_source_layers``)."""
    ids: tuple[str, ...]
    """Lists of layer ids (the layers of one kind)."""
    keyed: tuple[str, ...]
    """Per-layer settings by layer index (a dict keyed by the index)."""
    first: tuple[str, ...]
    """``FIRST_LAYERS`` counts below the layer count."""
    last: tuple[str, ...]
    """``LAST_LAYERS`` counts below the layer count."""
    sections: tuple[str, ...]
    """Layer counts of sections that sum to the total (Dory's input / recurrent / output), in order."""
    bounds: tuple[int, ...]
    """The layer each section ends before."""
    kinds: tuple
    """Each layer's ``layer_types`` entry (``None`` where the config has no per-layer ``layer_types``)."""

    def traits(self, values: dict, i: int) -> set:
        """Layer ``i``'s per-layer settings in ``values``, as (field, setting) pairs."""
        found = {(k, json.dumps(values[k][i], default=str)) for k in self.per_layer}
        found |= {(k, values[k][i] != i) for k in self.sources}
        found |= {(k, i in values[k]) for k in self.ids} | {(k, i < values[k]) for k in self.first}
        found |= {(k, json.dumps({int(j): v for j, v in values[k].items()}.get(i), default=str)) for k in self.keyed}
        found |= {(k, i >= self.layers - values[k]) for k in self.last}
        return found | ({("section", sum(i >= b for b in self.bounds))} if self.sections else set())

    def read_from(self, values: dict, i: int) -> set:
        """The other layers layer ``i`` reads keys from (Gemma 3n's shared layers: the last unshared layer of
        their type)."""
        found = {values[k][i] for k in self.sources}
        for k in self.last:
            if i >= self.layers - values[k]:
                found |= {max((j for j in range(self.layers - values[k]) if self.kinds[j] == self.kinds[i]), default=i)}
        return found - {i}


def layer_fields(values: dict, layers: int) -> LayerFields:
    """The fields of a config's ``values`` that differ by layer, for its ``layers`` layers."""

    def is_ids(v) -> bool:
        return all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in v)

    per_layer = [
        k
        for k, v in values.items()
        if isinstance(v, (list, tuple)) and len(v) == layers and layers > 1 and k not in TOKEN_IDS
    ]
    sources = [k for k in per_layer if "layer" in k and is_ids(values[k])]
    per_layer = [k for k in per_layer if k not in sources]
    ids = [
        k
        for k, v in values.items()
        if "layer" in k and k not in per_layer + sources and isinstance(v, list) and v and is_ids(v)
    ]
    keyed = [
        k
        for k, v in values.items()
        if "layer" in k and isinstance(v, dict) and v and all(str(i).isdigit() and int(i) < layers for i in v)
    ]
    sections = [
        k
        for k, v in values.items()
        if "layers" in k
        and k not in COUNT_NAMES + FIRST_LAYERS + LAST_LAYERS
        and isinstance(v, int)
        and not isinstance(v, bool)
        and 0 <= v < layers
    ]
    bounds = [sum(values[k] for k in sections[: j + 1]) for j in range(len(sections))]
    if len(sections) < 2 or bounds[-1] != layers:
        sections, bounds = [], []
    return LayerFields(
        layers=layers,
        per_layer=tuple(per_layer),
        sources=tuple(sources),
        ids=tuple(ids),
        keyed=tuple(keyed),
        first=tuple(k for k in FIRST_LAYERS if isinstance(values.get(k), int) and 0 < values[k] < layers),
        last=tuple(k for k in LAST_LAYERS if isinstance(values.get(k), int) and 0 < values[k] < layers),
        sections=tuple(sections),
        bounds=tuple(bounds),
        kinds=tuple(values["layer_types"]) if "layer_types" in per_layer else (None,) * layers,
    )


def kept_layers(values: dict, fields: LayerFields, most: int) -> list[int]:
    """The layers a replica keeps, ascending: about ``most`` (at least two) chosen one at a time, each the layer
    adding the most unseen settings (then an unseen combination of them), the earliest on a tie; then the
    layers those read keys from."""
    keep, seen, combos = [], set(), set()
    while len(keep) < min(most, fields.layers):
        gain = max(
            (len(fields.traits(values, i) - seen), frozenset(fields.traits(values, i)) not in combos, -i)
            for i in range(fields.layers)
            if i not in keep
        )
        if not any(gain[:2]) and len(keep) >= 2:
            break
        keep.append(-gain[2])
        seen |= fields.traits(values, keep[-1])
        combos.add(frozenset(fields.traits(values, keep[-1])))
    while missing := set().union(*(fields.read_from(values, i) for i in keep)) - set(keep):
        keep += sorted(missing)
    return sorted(keep)


def layer_overrides(values: dict, fields: LayerFields, keep: list[int], lists: dict) -> dict:
    """Overrides that cut a config's ``values`` to the ``keep`` layers: its layer counts, every per-layer field
    (the per-layer lists taken from ``lists``), the layer ids renumbered."""
    layers = fields.layers
    out = {k: len(keep) for k in COUNT_NAMES if k in values}
    out |= {k: [lists[k][i] for i in keep] for k in fields.per_layer}
    out |= {k: [keep.index(values[k][i]) for i in keep] for k in fields.sources}
    out |= {k: [keep.index(i) for i in values[k] if i in keep] for k in fields.ids}
    out |= {
        k: {
            keep.index(int(j)): v | shrunk_shapes(v) if isinstance(v, dict) else v
            for j, v in values[k].items()
            if int(j) in keep
        }
        for k in fields.keyed
    }
    out |= {k: sum(i < values[k] for i in keep) for k in fields.first}
    out |= {k: sum(i >= layers - values[k] for i in keep) for k in fields.last}
    out |= {
        k: sum(lo <= i < hi for i in keep)
        for k, lo, hi in zip(fields.sections, [0, *fields.bounds], fields.bounds, strict=False)
    }
    if "attention_types" in values and "attention_layers" in out:  # GPT-Neo derives its layers from this
        out["attention_types"] = [[[kind], 1] for kind in out["attention_layers"]]
    for k, v in values.items():  # a layer pattern by period (Jamba: attention every 8th layer from the 4th)
        if k.endswith("_layer_period") and isinstance(v, int) and not isinstance(v, bool) and v > len(keep):
            out[k], out[k.replace("_period", "_offset")] = 2, 1  # keeps both kinds of layer
    return out


def shrunk_layers(values: dict, most: int, shapes: dict | None = None) -> dict:
    """Overrides that keep at least two of a config's layers and about ``most``, covering as many of its
    per-layer settings as fit (``layer_types``, per-layer lists, lists of layer ids, ``FIRST_LAYERS`` /
    ``LAST_LAYERS`` counts, sections whose layer counts sum to the total: Dory's input / recurrent / output)
    and the layers those read keys from (per-layer lists of layer ids: Kolibri's ``kv_source_layers``;
    Gemma 3n's shared layers reuse the last unshared layer of their type), every per-layer field cut to the
    kept layers (per-layer widths as ``shapes`` shrunk them)."""
    layers = next((values[k] for k in COUNT_NAMES if isinstance(values.get(k), int)), 0)
    if not layers:
        return {}
    fields = layer_fields(values, layers)
    keep = kept_layers(values, fields, most)
    lists = values | {k: v for k, v in (shapes or {}).items() if isinstance(v, list)}
    return layer_overrides(values, fields, keep, lists)


SMALL = {
    "sliding_window": 6,
    "attention_chunk_size": 8,
    "window_size": 6,
    "chunk_size": 8,
    "floor_scale": 8,
    "index_topk": 8,
    "index_block_size": 4,
    "index_topk_blocks": 2,
    "sliding_window_size": 6,
    "attention_window_size": 6,
    "local_attention_window_len": 6,
    "mamba_chunk_size": 8,
}
"""Window / chunk sizes of the replica, under each name a family gives them (the user's are far longer than any
replica example); Llama 4's attention temperature steps every ``floor_scale`` positions; an indexer selects
``index_topk`` keys, or ``index_topk_blocks`` blocks of ``index_block_size`` (8 keys, below the longest
example, so it binds); a Mamba-2 scan runs in chunks of ``mamba_chunk_size``."""
ROPE_ORIGINAL = 16
"""The replica's rope threshold (``original_max_position_embeddings``): below the longest example."""
CONTEXT = 64
MAX_LAYERS = 6


def replica_config(config, own_shapes: bool = False):
    """A tiny config of ``config``'s family with its token-mixing settings (see the module docstring); with
    ``own_shapes``, the larger replica: the config's own widths, heads and vocabulary, only its layers,
    windows and context shrunk."""
    values = own_values(config)
    model_type = values.get("model_type") or config.model_type
    shapes = {} if own_shapes else shrunk_shapes(values)
    shrunk = {k: v for k, v in shapes.items() if k != "sliding_window"}
    shrunk.update({k: 0.0 for k in NO_DROPOUT if k in values})
    shrunk.update(shrunk_layers(values, MAX_LAYERS, shrunk))
    context = values.get("max_position_embeddings") or values.get("n_positions")
    for name, small in SMALL.items():
        if isinstance(values.get(name), int) and values[name] > small:
            # a window / chunk that never binds (at least the context) stays so: as long as the replica's context
            shrunk[name] = CONTEXT if isinstance(context, int) and values[name] >= context else small
    for name in ("rope_parameters", "rope_scaling"):
        rope = values.get(name)
        if isinstance(rope, dict):
            rope = dict(rope)
            if "original_max_position_embeddings" in rope:
                rope["original_max_position_embeddings"] = ROPE_ORIGINAL
            shrunk[name] = rope
    for name in ("max_position_embeddings", "n_positions"):
        if name in values:
            shrunk[name] = CONTEXT
    values = {k: v for k, v in values.items() if k not in ("model_type", "transformers_version", "architectures")}
    return AutoConfig.for_model(model_type, **(values | shrunk))


def default_config(model_type: str, **overrides):
    """The family matrix's start: the family's default transformers config (with ``DEFAULT_FIXES``) built
    again from its shape fields shrunk (``shrunk_shapes``; two layers, of each kind where they differ,
    ``shrunk_layers``), so the sizes it derives from them follow; a sliding window of ``SMALL`` where it has
    the field; ``overrides`` last."""
    fixes = DEFAULT_FIXES.get(model_type, {})
    default = AutoConfig.for_model(model_type, **fixes)
    values = own_values(default)
    shrunk = shrunk_shapes(values)
    if "sliding_window" in set(values) | set(vars(default)):
        shrunk["sliding_window"] = SMALL["sliding_window"]
    for most in (2, MAX_LAYERS):  # a family whose layer kinds need more (Gemma 3n's shared-KV layers)
        try:
            layers = shrunk_layers(values, most, shrunk)
            return AutoConfig.for_model(model_type, **(fixes | shrunk | layers | overrides))
        except (AttributeError, ValueError, KeyError, TypeError):  # a family that derives its layer types
            continue
    return AutoConfig.for_model(model_type, **(fixes | shrunk | overrides))


__all__ = ["SMALL", "default_config", "own_values", "replica_config", "shrunk_layers", "shrunk_shapes"]
