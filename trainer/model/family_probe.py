"""Probe a transformers causal-LM family: does a packed row train exactly what its examples train one by one?

``probe(model_type)`` builds a tiny random model of the family (2 layers of its distinct kinds, small width, a
sliding window of 6 where the family has one; ``shrunk_shapes`` / ``shrunk_layers`` keep what each config's
shape needs, and the config verdict's replica shrinks a user's config by the same rules), prepared as ``build_model`` prepares it (``prepare_model``: per-example rope,
the boundary relay) with the loss a run trains with by default (``LossConfig().impl``: the chunked loss,
through the decoder stack). A packed row of examples of lengths 9, 1, 14, 5, 11, 3 runs the trainer's step
through ``sdpa_varlen`` (``summed_token_loss`` / the label count, backward) and is compared with the same
examples run alone through transformers' own attention and full-logit cross-entropy: logits, the loss and
every parameter's gradient, fp32 (a near miss rerun in float64). An exact family then takes one optimizer
step (the trainer's default AdamW, clipping) and is compared again on the updated weights: it must not
crash, and stay exact.
``benchmarks/family_matrix.py`` runs it over every family of the installed transformers;
``tests/unit/test_family_matrix.py`` checks the verdicts of ``trainer.model.families`` against it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM

from trainer.collate import Batch
from trainer.config import LossConfig, OptimConfig
from trainer.data.examples import IGNORE_INDEX
from trainer.loss import summed_token_loss
from trainer.model.attention import AttentionNeeds, resolve_backend
from trainer.model.families import FamilyRefusedError, selected_keys, text_family
from trainer.model.packed_layout import AttentionBackendError
from trainer.model.prepare import prepare_model
from trainer.optim import build_optimizer

LENGTHS = (9, 1, 14, 5, 11, 3)
"""Longer and shorter than the window, a 1-token example."""
WINDOW = 6
VOCAB = 128
TOLERANCE = 1e-5
ROUNDING_SUSPECT = 1e-3
"""A difference under this in fp32 is rerun in float64 (``rounding_only``) before it is called wrong."""
FLOAT64_TOLERANCE = (1e-12, 1e-6)
"""(logits, gradients) in float64: logits must agree to rounding; gradients may keep the float32 steps some
families take inside (Gemma 4: ~1e-7), still 100x below what a leak between examples gives."""

SHRINK = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128, "ffn_hidden_size": 128,
    "n_inner": 128, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "num_attention_heads": 4,
    "n_head": 4, "num_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "sliding_window": WINDOW,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2, "decoder_start_token_id": 1, "use_cache": False, "tie_word_embeddings": False,
    "decoder_layers": 2, "encoder_layers": 1, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "decoder_ffn_dim": 128, "encoder_ffn_dim": 128, "n_embed": 64, "num_decoder_layers": 2,
    "n_layers": 2, "n_heads": 4, "max_seq_len": 64, "index_head_dim": 16, "index_n_heads": 2,
    "embedding_dim": 64, "num_blocks": 2, "expert_ffn_hidden_size": 32, "zero_expert_num": 2,
    "linear_head_dim": 16, "linear_num_heads": 4, "num_expert_group": 1, "attention_hidden_size": 128,
    "attention_head_dim": 32, "mamba_dt_rank": 8, "model_max_length": 64, "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16, "rotary_dim": 8, "num_experts_per_token": 2, "moe_topk": 2, "index_num_heads": 2,
    "hidden_size_global": 64, "encoder_hash_byte_group_vocab": VOCAB, "indexer_n_heads": 2, "indexer_head_dim": 16,
    # state-space / linear-attention mixers (trainer.model.mixers): heads x head dim = expand x hidden
    "expand": 1, "state_size": 16, "n_groups": 1, "mamba_n_heads": 8,
    "mamba_d_head": 16, "mamba_d_state": 16, "mamba_d_ssm": 128, "mamba_n_groups": 1, "mamba_chunk_size": 8,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_mamba_heads": 8, "mamba_headdim": 16,
}
"""Tiny values for the config fields a family has (a field the family lacks is left out), shrunk by
``shrunk_shapes``: never above the config's own value, the config's equalities kept."""
HEAD_COUNTS = (
    "num_attention_heads", "n_head", "num_heads", "n_heads", "num_key_value_heads", "decoder_attention_heads",
    "encoder_attention_heads", "index_n_heads", "index_num_heads", "indexer_n_heads", "linear_num_heads", "kv_n_heads",
)
"""Head counts: shrunk together, to 4, 2 or 1 in proportion to the largest, so counts equal in the config stay
equal (multi-head latent attention runs only with as many KV heads as heads) and each divides the larger."""
KEPT_EQUAL = (
    ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_head_dim", "linear_head_dim",
     "attention_head_dim", "rotary_dim", "indexer_head_dim"),
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
    "cohere_compass_text": {"rope_parameters": {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                                for kind in ("full_attention", "sliding_attention")}},
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 256, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},
}
"""What transformers' default config of these families lacks to build a model at all (its own validation
fails, or the model reads a setting the default leaves unset); the probe's tiny config starts from it."""
NO_DROPOUT = (
    "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob",
    "attention_probs_dropout_prob", "dropout", "activation_dropout", "embedding_dropout", "mlp_dropout",
)


@dataclass(frozen=True)
class ProbeResult:
    family: str
    outcome: str
    """``exact``, ``wrong`` (ran, disagrees), ``error`` (the packed run raised), ``refused`` (packfsdp refused
    it while building) or ``unbuildable`` (no tiny model: no verdict)."""
    detail: str = ""
    logit_diff: float = float("nan")
    grad_diff: float = float("nan")
    loss_diff: float = float("nan")

    def line(self) -> str:
        if self.outcome in ("exact", "wrong"):
            return (
                f"{self.family}: {self.outcome} ({self.detail}max |logit diff| {self.logit_diff:.2g}, "
                f"|loss diff| {self.loss_diff:.2g}, |grad diff| {self.grad_diff:.2g})"
            )
        return f"{self.family}: {self.outcome}: {self.detail}"


def tiny_config(model_type: str, **overrides):
    """The family's transformers config shrunk to a tiny model (``shrunk_shapes``; two layers, of both kinds
    where its layers differ, ``shrunk_layers``), a sliding window of ``WINDOW`` where it has the field,
    dropout off."""
    from transformers import AutoConfig

    fixes = DEFAULT_FIXES.get(model_type, {})
    default = AutoConfig.for_model(model_type, **fixes)
    values = own_values(default)
    fields = set(values) | set(vars(default))
    shrunk = shrunk_shapes(values) | {k: 0.0 for k in NO_DROPOUT if k in fields}
    if "sliding_window" in fields:
        shrunk["sliding_window"] = WINDOW
    for most in (2, 6):  # a family whose layer kinds need more (Gemma 3n's shared-KV layers reuse earlier ones)
        try:
            layers = shrunk_layers(values, most, shrunk)
            return AutoConfig.for_model(model_type, **(fixes | shrunk | layers | overrides))
        except (AttributeError, ValueError, KeyError, TypeError):  # a family that derives its layer types
            continue
    return AutoConfig.for_model(model_type, **(fixes | shrunk | overrides))


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
            own = {k: v for k, v in value.items() if k not in _base_fields() or k in SHRINK}  # 5.17's DBRX takes no others
            out[name] = own | shrunk_shapes(value)
            out[name] |= shrunk_layers(value, 2, out[name])
    return out


@functools.cache
def _base_fields() -> frozenset[str]:
    """The fields every transformers config has (``PreTrainedConfig``'s own), not a family's."""
    from transformers import PreTrainedConfig

    return frozenset(PreTrainedConfig().to_dict())


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
    lists = values | {k: v for k, v in (shapes or {}).items() if isinstance(v, list)}
    per_layer = [k for k, v in values.items()
                 if isinstance(v, (list, tuple)) and len(v) == layers and layers > 1 and k not in TOKEN_IDS]
    def is_ids(v) -> bool:
        return all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in v)

    sources = [k for k in per_layer if "layer" in k and is_ids(values[k])]
    per_layer = [k for k in per_layer if k not in sources]
    ids = [k for k, v in values.items() if "layer" in k and k not in per_layer + sources and isinstance(v, list)
           and v and is_ids(v)]
    keyed = [k for k, v in values.items() if "layer" in k and isinstance(v, dict) and v
             and all(str(i).isdigit() and int(i) < layers for i in v)]  # per-layer settings by layer index
    first = [k for k in FIRST_LAYERS if isinstance(values.get(k), int) and 0 < values[k] < layers]
    last = [k for k in LAST_LAYERS if isinstance(values.get(k), int) and 0 < values[k] < layers]
    sections = [k for k, v in values.items() if "layers" in k and k not in COUNT_NAMES + FIRST_LAYERS + LAST_LAYERS
                and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers]
    bounds = [sum(values[k] for k in sections[: j + 1]) for j in range(len(sections))]
    if len(sections) < 2 or bounds[-1] != layers:
        sections, bounds = [], []
    kinds = values.get("layer_types") if "layer_types" in per_layer else [None] * layers

    def traits(i: int) -> set:
        found = {(k, json.dumps(values[k][i], default=str)) for k in per_layer}
        found |= {(k, values[k][i] != i) for k in sources}
        found |= {(k, i in values[k]) for k in ids} | {(k, i < values[k]) for k in first}
        found |= {(k, json.dumps({int(j): v for j, v in values[k].items()}.get(i), default=str)) for k in keyed}
        found |= {(k, i >= layers - values[k]) for k in last}
        return found | ({("section", sum(i >= b for b in bounds))} if sections else set())

    def read_from(i: int) -> set:
        found = {values[k][i] for k in sources}
        for k in last:
            if i >= layers - values[k]:
                found |= {max((j for j in range(layers - values[k]) if kinds[j] == kinds[i]), default=i)}
        return found - {i}

    keep, seen, combos = [], set(), set()
    while len(keep) < min(most, layers):  # the layer adding the most unseen settings (then an unseen
        gain = max(((len(traits(i) - seen), frozenset(traits(i)) not in combos, -i) for i in range(layers)
                    if i not in keep))  # combination of them), the earliest on a tie
        if not any(gain[:2]) and len(keep) >= 2:
            break
        keep.append(-gain[2])
        seen |= traits(keep[-1])
        combos.add(frozenset(traits(keep[-1])))
    while missing := set().union(*map(read_from, keep)) - set(keep):
        keep += sorted(missing)
    keep.sort()
    out = {k: len(keep) for k in COUNT_NAMES if k in values}
    out |= {k: [lists[k][i] for i in keep] for k in per_layer}
    out |= {k: [keep.index(values[k][i]) for i in keep] for k in sources}
    out |= {k: [keep.index(i) for i in values[k] if i in keep] for k in ids}
    out |= {k: {keep.index(int(j)): v | shrunk_shapes(v) if isinstance(v, dict) else v
                for j, v in values[k].items() if int(j) in keep} for k in keyed}
    out |= {k: sum(i < values[k] for i in keep) for k in first}
    out |= {k: sum(i >= layers - values[k] for i in keep) for k in last}
    out |= {k: sum(lo <= i < hi for i in keep) for k, lo, hi in zip(sections, [0] + bounds, bounds)}
    if "attention_types" in values and "attention_layers" in out:  # GPT-Neo derives its layers from this
        out["attention_types"] = [[[kind], 1] for kind in out["attention_layers"]]
    for k, v in values.items():  # a layer pattern by period (Jamba: attention every 8th layer from the 4th)
        if k.endswith("_layer_period") and isinstance(v, int) and not isinstance(v, bool) and v > len(keep):
            out[k], out[k.replace("_period", "_offset")] = 2, 1  # keeps both kinds of layer
    return out


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:200]


def _token_loss_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


class Run(NamedTuple):
    """What a packed or one-by-one run of the probe's examples gives."""

    logits: list[torch.Tensor]
    """Each example's logits."""
    grads: dict[str, torch.Tensor]
    """Every parameter's gradient of the summed token loss."""
    loss: float
    """The summed token loss."""


class Diffs(NamedTuple):
    """Packed vs one by one, each relative to max(1, |one by one|)."""

    logits: float
    loss: float
    grads: float

    @property
    def worst(self) -> float:
        """The largest of the three; ``inf`` where one is not finite (a NaN never passes)."""
        return max(self) if all(math.isfinite(d) for d in self) else math.inf


def _grads(model, scale: float = 1.0) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() * scale for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def run_alone(model, examples: list[torch.Tensor]) -> Run:
    """Each example run alone through transformers' own attention (the model's padded path) and its full
    logits' cross-entropy: the reference, independent of the packed backend and of the run's loss."""
    model.zero_grad(set_to_none=True)
    logits, loss = [], 0.0
    for e in examples:
        out = model(input_ids=e[None], position_ids=torch.arange(len(e))[None], attention_mask=torch.ones_like(e)[None])[0]
        token_loss = _token_loss_sum(out, e)
        token_loss.backward()
        logits.append(out.detach())
        loss += float(token_loss.detach())
    return Run(logits, _grads(model), loss)


def packed_batch(examples: list[torch.Tensor]) -> Batch:
    """The examples as the trainer's collate lays out a packed row: one flat row, positions restarting,
    ``cu_seqlens``, and no label on each example's first token."""
    cu = torch.tensor([0] + [len(e) for e in examples]).cumsum(0).to(torch.int32)
    labels = torch.cat([torch.cat([torch.tensor([IGNORE_INDEX]), e[1:]]) for e in examples])[None]
    return Batch(
        input_ids=torch.cat(examples)[None], labels=labels,
        position_ids=torch.cat([torch.arange(len(e)) for e in examples])[None], cu_seqlens=cu,
        max_seqlen=max(len(e) for e in examples), num_examples=len(examples), num_tokens=int(cu[-1]),
        num_label_tokens=int((labels != IGNORE_INDEX).sum()), num_positions=int(cu[-1]),
    )


def run_packed(model, examples: list[torch.Tensor]) -> Run:
    """The examples in one packed row, as the trainer's step runs them: the loss the model is set to train
    with (``VarlenCausalLM.use_loss``: the chunked loss through the decoder and the boundary relay, by
    default) through ``summed_token_loss``, divided by the label count and backpropagated (``Trainer.
    forward_backward``); the gradients are scaled back to the summed loss's. The logits come from the same
    packed forward without labels."""
    model.zero_grad(set_to_none=True)
    batch = packed_batch(examples)
    with torch.no_grad():
        logits = model(**batch.model_inputs())[0]
    loss = summed_token_loss(model, batch)
    (loss / batch.num_label_tokens).backward()
    pieces = [logits[s:t] for s, t in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())]
    return Run(pieces, _grads(model, batch.num_label_tokens), float(loss.detach()))


def not_finite(run) -> str:
    """Where ``run`` (``family_probe.Run``) is not finite: its logits, its loss or the gradient of a parameter
    (the first by name); "" where all are finite."""
    if not all(bool(torch.isfinite(x).all()) for x in run.logits):
        return "the logits"
    if not math.isfinite(run.loss):
        return "the loss"
    return next((f"the gradient of {name}" for name, g in sorted(run.grads.items()) if not torch.isfinite(g).all()), "")


def differences(packed: Run, alone: Run) -> Diffs:
    """Max |logit diff|, |loss diff|, |grad diff| between two runs, each relative to max(1, |value|); a
    gradient present in one run only counts as infinite."""
    logit_diff = max(_max_rel_diff(p, a) for p, a in zip(packed.logits, alone.logits))
    loss_diff = abs(packed.loss - alone.loss) / max(1.0, abs(alone.loss))
    grad_diff = 0.0
    for name in packed.grads.keys() | alone.grads.keys():
        if name not in packed.grads or name not in alone.grads:
            return Diffs(logit_diff, loss_diff, float("inf"))
        grad_diff = max(grad_diff, _max_rel_diff(packed.grads[name], alone.grads[name]))
    return Diffs(logit_diff, loss_diff, grad_diff)


def optimizer_step(model, examples: list[torch.Tensor]) -> Diffs:
    """One training step on the packed row as the trainer takes it (the run's loss over the label count,
    gradient clipping, the default optimizer of ``trainer.optim.build_optimizer``), then packed vs one by
    one again on the updated weights; all ``inf`` where a weight is no longer finite."""
    cfg = OptimConfig()
    batch = packed_batch(examples)
    optimizer = build_optimizer(model, cfg)
    model.zero_grad(set_to_none=True)
    (summed_token_loss(model, batch) / batch.num_label_tokens).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], cfg.grad_clip, foreach=True)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return Diffs(math.inf, math.inf, math.inf)
    return differences(run_packed(model, examples), run_alone(model, examples))


def build_probe_model(model_type: str, backend: str = "sdpa_varlen", **overrides):
    """The tiny model of ``model_type`` behind ``backend`` as ``build_model`` prepares it (``prepare_model``),
    without the family table's verdict (the probe is what makes it). Raises what building raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = tiny_config(model_type, **overrides)
        if reason := selected_keys(config):  # the config-dependent refusals of check_family
            raise FamilyRefusedError(reason)
        resolved = resolve_backend(backend, torch.device("cpu"), torch.float32, AttentionNeeds.of(config))
        torch.manual_seed(0)
        model = prepare_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32), counted(resolved))
        model.use_loss(LossConfig().impl)  # the run's default loss (chunked), as the trainer sets it
        return model


def counted(backend):
    """``backend`` registered under its own name with a call counter (``backend.calls[0]``): a packed run
    that never calls it bypasses transformers' attention interface."""
    calls = [0]

    def fn(*args, **kwargs):
        calls[0] += 1
        return backend.fn(*args, **kwargs)

    probe_backend = dataclasses.replace(backend, name=f"{backend.name}_probe", fn=fn)
    AttentionInterface.register(probe_backend.hf_name, fn)
    object.__setattr__(probe_backend, "calls", calls)
    return probe_backend


def probe(model_type: str, backend: str = "sdpa_varlen", **overrides) -> ProbeResult:
    """Build a tiny ``model_type`` model as ``build_model`` prepares it and compare packed with one by one
    (a multimodal family: its language model's text family, ``families.text_family``). A family whose
    attention softcapping the CPU backends refuse is probed with softcapping off (the backends that honour
    it, flash_attn and flex, are checked in tests/unit/test_attention_softcap.py)."""
    if text := text_family(model_type):  # what packfsdp trains of a multimodal family: its language model
        result = probe(text, backend, **overrides)
        return dataclasses.replace(result, family=model_type, detail=f"as {text}: {result.detail}")
    note = ""
    try:
        try:
            model = build_probe_model(model_type, backend, **overrides)
        except AttentionBackendError as e:
            if "softcapping" not in str(e):
                return ProbeResult(model_type, "refused", _one_line(e))
            note = "softcap off; "
            model = build_probe_model(model_type, backend, **(overrides | {"attn_logit_softcapping": None}))
    except Exception as e:  # noqa: BLE001 - a refusal by packfsdp, or a tiny config transformers cannot build
        kind = "refused" if type(e).__name__ in ("FamilyRefusedError", "RopeError") else "unbuildable"
        return ProbeResult(model_type, kind, _one_line(e))
    g = torch.Generator().manual_seed(1)
    vocab = min(VOCAB, model.model.get_input_embeddings().num_embeddings)
    examples = [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]
    model.eval()  # gradients still flow; off: dropout and random routing (Phi-3.5-MoE's sparsemixer samples)
    try:
        alone = run_alone(model, examples)
    except Exception as e:  # noqa: BLE001 - transformers' own path fails on the tiny config: no verdict
        return ProbeResult(model_type, "unbuildable", "runs alone: " + _one_line(e))
    if where := not_finite(alone):  # the family's own NaN, not packing's: no verdict from it
        return ProbeResult(model_type, "unbuildable", f"runs alone: {where} is not finite (NaN)")
    try:
        packed = run_packed(model, examples)
    except Exception as e:  # noqa: BLE001 - a family that crashes when packed is refused, with this reason
        return ProbeResult(model_type, "error", _one_line(e))
    if where := not_finite(packed):
        return ProbeResult(model_type, "error", f"packed: {where} is not finite (NaN) where its examples alone are finite")
    if model.backend.calls[0] == 0:
        note += "the packed backend was never called; "
    diffs = differences(packed, alone)
    exact, note = within_tolerance(model, examples, diffs, note)
    if not exact:
        return ProbeResult(model_type, "wrong", note, diffs.logits, diffs.grads, diffs.loss)
    try:
        after = optimizer_step(model, examples)
    except Exception as e:  # noqa: BLE001 - a family whose packed step crashes in the optimizer or after it
        return ProbeResult(model_type, "error", "the optimizer step: " + _one_line(e))
    exact, after_note = within_tolerance(model, examples, after, "")
    if not exact:
        note += f"after one optimizer step: {after_note}|logit diff| {after.logits:.2g}, |loss diff| {after.loss:.2g}, |grad diff| {after.grads:.2g}; before: "
        return ProbeResult(model_type, "wrong", note, diffs.logits, diffs.grads, diffs.loss)
    return ProbeResult(model_type, "exact", note, diffs.logits, diffs.grads, diffs.loss)


def within_tolerance(model, examples: list[torch.Tensor], diffs: Diffs, note: str) -> tuple[bool, str]:
    """fp32 within ``TOLERANCE``, or a near miss that is rounding only (``rounding_only``). (exact, note)."""
    if diffs.worst <= TOLERANCE:
        return True, note
    if diffs.worst < ROUNDING_SUSPECT:
        return rounding_only(model, examples, note)
    return False, note


def rounding_only(model, examples: list[torch.Tensor], note: str) -> tuple[bool, str]:
    """Rerun a near miss in float64: a packing leak stays as large, fp32 rounding shrinks by orders of
    magnitude (a family with float32 steps inside keeps ~1e-7 on its gradients, the chunked loss's float32
    cross-entropy ~1e-8 on the loss). (exact, note)."""
    model.double()
    f64 = differences(run_packed(model, examples), run_alone(model, examples))
    model.float()
    exact = f64.worst < math.inf and f64.logits <= FLOAT64_TOLERANCE[0] and max(f64.loss, f64.grads) <= FLOAT64_TOLERANCE[1]
    note += f"float64: |logit diff| {f64.logits:.1g}, |loss diff| {f64.loss:.1g}, |grad diff| {f64.grads:.1g}; fp32: "
    return exact, note


__all__ = [
    "LENGTHS", "Diffs", "ProbeResult", "Run", "build_probe_model", "differences", "not_finite", "optimizer_step",
    "own_values", "packed_batch", "probe", "run_alone", "run_packed", "shrunk_layers", "shrunk_shapes", "tiny_config",
]
