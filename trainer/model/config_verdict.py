"""A verdict for the config a user actually runs: a tiny float64 replica of it, packed vs one by one.

The family table (``trainer.model.families``) was probed on each family's *default* config; a user's config
may add what that default lacks (short-convolution or linear-attention layers in ``layer_types``, a sliding
window the family keeps in its mask, chunked attention, another rope type, MoE routing). Before training,
``verify_config`` builds ``replica_config(config)``: the same ``model_type`` and every setting that shapes how
tokens mix, widths shrunk keeping what the config's shape needs (``family_probe.shrunk_shapes``: KV heads =
heads for multi-head latent attention, head-count ratios, equal head dims and vocabularies), one layer of each
distinct per-layer pattern (``layer_types``, ``no_rope_layers``, ..., ``family_probe.shrunk_layers``), windows /
chunks / rope thresholds shrunk below the probe's longest example so that examples cross them. It runs a
packed row of ``LENGTHS`` against the same examples alone through transformers' eager attention, in float64
(float32 where the model cannot run in float64), and compares logits and every parameter's gradient. A
mismatch raises ``FamilyRefusedError`` in one line naming the family and the setting (found by switching each
candidate setting off in turn); so does a NaN, saying where (the examples alone: the family's own; packed).
A replica that cannot be built or run is no verdict on the user's model: the larger replica (the config's own
widths, ``larger_replica``) is tried, then the startup self-check decides. Verdicts are cached, keyed by everything
they depend on and checksummed (``trainer.model.verdict_cache``: an entry that does not verify is judged again).
"""

from __future__ import annotations

import json
import logging
import math
import warnings

import torch
from transformers import AutoModelForCausalLM

from trainer import distributed
from trainer.errors import first_line
from trainer.model.attention import AttentionNeeds, resolve_backend
from trainer.model.families import FamilyRefusedError
from trainer.model.packed_layout import AttentionBackendError
from trainer.model.prepare import prepare_model
from trainer.model.family_probe import (
    NO_DROPOUT, SHRINK, Diffs, differences, not_finite, own_values, run_alone, run_packed, shrunk_layers,
    shrunk_shapes,
)
import trainer.model.verdict_cache as verdict_cache

log = logging.getLogger(__name__)

LENGTHS = (21, 1, 14, 5, 11, 3, 9)
"""Every shrunk threshold (``SMALL``) is crossed by examples side by side; a 1-token example."""
SMALL = {
    "sliding_window": 6, "attention_chunk_size": 8, "window_size": 6, "chunk_size": 8, "floor_scale": 8,
    "index_topk": 8, "index_block_size": 4, "index_topk_blocks": 2, "sliding_window_size": 6,
    "attention_window_size": 6, "local_attention_window_len": 6,
    "mamba_chunk_size": 8,
}
"""Window / chunk sizes of the replica, under each name a family gives them (the user's are far longer than any
probe example); Llama 4's attention temperature steps every ``floor_scale`` positions; an indexer selects
``index_topk`` keys, or ``index_topk_blocks`` blocks of ``index_block_size`` (8 keys, below the longest
example, so it binds); a Mamba-2 scan runs in chunks of ``mamba_chunk_size``."""
ROPE_ORIGINAL = 16
"""The replica's rope threshold (``original_max_position_embeddings``): below the longest example."""
CONTEXT = 64
TOLERANCE = {torch.float64: (1e-6, 1e-5), torch.float32: (2e-5, 2e-5)}
"""(logits, gradients) per replica dtype; a leak between examples gives ~1e-4 and more (float32 steps inside
transformers' float64 models, rope among them, leave ~1e-7). float32 only where the model cannot run in
float64 (grouped-GEMM MoE experts; GPT-2's ``reorder_and_upcast_attn`` asserts float32 attention weights)."""
MAX_LAYERS = 6
VERSION = 4
"""Bump to invalidate cached verdicts when the replica changes."""


class Unbuildable(RuntimeError):
    """transformers cannot build the tiny replica of this config: no verdict from it."""


def replica_config(config, own_shapes: bool = False):
    """A tiny config of ``config``'s family with its token-mixing settings (see the module docstring); with
    ``own_shapes``, the larger replica: the config's own widths, heads and vocabulary, only its layers,
    windows and context shrunk."""
    from transformers import AutoConfig

    values = own_values(config)
    model_type = values.get("model_type") or config.model_type
    # One layer of each distinct combination of per-layer settings, in order (at least two layers); shapes
    # shrunk keeping what the config's shape needs (family_probe.shrunk_shapes: MLA's KV heads = heads, ...).
    shapes = {} if own_shapes else shrunk_shapes(values)
    shrunk = {k: v for k, v in shapes.items() if k not in ("sliding_window",)}
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


def _examples(model) -> list[torch.Tensor]:
    """Random tokens of ``LENGTHS``; the longest starts with the pad token where the config has one: real
    inputs hold it (the pads of padded batches, a rank's one-token filler micro-batch, tokenizers whose bos /
    eos is the pad) and its embedding row is all zeros (``padding_idx``)."""
    g = torch.Generator().manual_seed(1)
    vocab = min(SHRINK["vocab_size"], model.model.get_input_embeddings().num_embeddings)
    examples = [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]
    pad = getattr(model.config, "pad_token_id", None)
    if isinstance(pad, int) and 0 <= pad < vocab:
        examples[0][0] = pad
    return examples


OWN_NAN = "{where} is not finite (NaN) with its examples run one by one, unpacked (the family's own, not packing's)"
PAD_NAN = (
    ": its first example starts with pad_token_id={pad}, whose embedding row is zero (the embedding's padding_idx; real "
    "inputs hold it: the pads of padded batches, a rank's filler micro-batch); a step with it trains nothing"
)
PACKED_NAN = "packed, {where} is not finite (NaN) where its examples run one by one are finite"


class ReplicaNaN(RuntimeError):
    """The replica gives NaN: the family's own (its examples alone) or packing's (packed only)."""


def compare(config) -> tuple[Diffs, torch.dtype]:
    """(max |logit|, |loss| and |grad diff|, dtype) of ``config`` packed vs one by one: float64, or float32
    where the model cannot run in float64 (grouped-GEMM MoE kernels; GPT-2's ``reorder_and_upcast_attn``
    asserts float32 attention weights, exact at ~2e-7 in float32). Raises ``ReplicaNaN`` on a NaN, what
    building or running the replica raises otherwise (the float64 error where float32 fails too)."""
    try:
        return _compare(config, torch.float64), torch.float64
    except (ReplicaNaN, FamilyRefusedError, AttentionBackendError):
        raise
    except Exception as e:  # noqa: BLE001 - a model that runs only in float32
        try:
            found = _compare(config, torch.float32), torch.float32
        except Exception:  # noqa: BLE001 - not a float64 matter: the float64 error says what fails
            raise e from None
        log.info("config verdict: the float64 replica fails (%s): judged in float32", first_line(e))
        return found


def _compare(config, dtype: torch.dtype) -> Diffs:
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    except Exception as e:  # noqa: BLE001 - transformers cannot build the tiny replica
        raise Unbuildable(f"{type(e).__name__}: {e}") from e
    needs = AttentionNeeds.of(config)
    backend = resolve_backend("sdpa_varlen", torch.device("cpu"), dtype, needs)
    wrapped = prepare_model(model, backend)
    wrapped.padded_attention = "eager"  # the reference honours softcap, sinks and windows
    wrapped.use_loss("chunked")  # the packed side's gradients through the decoder stack, as a run's step takes them
    wrapped.eval()  # gradients still flow; no dropout, no sampled routing
    examples = _examples(wrapped)
    alone = run_alone(wrapped, examples)
    if where := not_finite(alone):  # the model itself, one example at a time: no packing can fix it
        pad = config.pad_token_id if examples[0][0] == config.pad_token_id else None
        raise ReplicaNaN(OWN_NAN.format(where=where) + (PAD_NAN.format(pad=pad) if pad is not None else ""))
    packed = run_packed(wrapped, examples)
    if where := not_finite(packed):
        raise ReplicaNaN(PACKED_NAN.format(where=where))
    return differences(packed, alone)


def _exact(found: tuple[Diffs, torch.dtype]) -> bool:
    diffs, dtype = found
    logits, grads = TOLERANCE[dtype]
    return diffs.worst < float("inf") and diffs.logits <= logits and max(diffs.loss, diffs.grads) <= grads


def candidate_settings(config, user=None) -> list[tuple[str, dict]]:
    """(setting named in a refusal, overrides that switch it off) for the token-mixing settings ``config`` has;
    sizes in the names are the ``user`` config's (the replica's are shrunk)."""
    values = config.to_dict()
    shown = values | ({k: v for k, v in user.to_dict().items() if k in SMALL} if user is not None else {})
    out = []
    kinds = list(dict.fromkeys(values.get("layer_types") or []))
    for kind in kinds:
        if "attention" not in str(kind):
            other = next((k for k in kinds if "attention" in str(k)), "full_attention")
            out.append((f"layer_types contains {kind!r}", {"layer_types": [other if k == kind else k for k in values["layer_types"]]}))
    for kind in kinds:  # windowed / chunked attention layers, full otherwise
        if "attention" in str(kind) and kind != "full_attention":
            size = next((f" ({n}={shown[n]})" for n in ("sliding_window", "attention_chunk_size") if values.get(n) and n.split("_")[0][:5] in kind), "")
            out.append((f"layer_types {kind!r}{size}", {"layer_types": ["full_attention" if k == kind else k for k in values["layer_types"]]}))
    for name in ("sliding_window", "attention_chunk_size", "window_size", "chunk_size"):
        if values.get(name):
            off = {name: None} | ({"use_sliding_window": False} if name == "sliding_window" and "use_sliding_window" in values else {})
            label = f"{name}={shown[name]}" + (" (use_sliding_window=true)" if values.get("use_sliding_window") else "")
            out.append((label, off))
    for name in ("rope_parameters", "rope_scaling"):
        rope = values.get(name)
        if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
            out.append((f"rope_type {rope['rope_type']!r}", {name: {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}}))
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if values.get(name):
            out.append((f"MoE routing ({name}={values[name]})", {name: 0} if name != "num_local_experts" else {name: 1}))
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if values.get(name):
            out.append((f"{name}={values[name]}", {name: None}))
    if values.get("attn_temperature_tuning") and values.get("floor_scale"):
        out.append((f"attn_temperature_tuning (floor_scale={shown['floor_scale']})", {"attn_temperature_tuning": False}))
    return out


def verify_config(config, self_check: bool = True) -> str:
    """Refuse ``config`` (``FamilyRefusedError``, one line) when its replica mixes packed examples; returns
    ``exact``, ``unbuildable`` (no replica: the table and the self-check decide; refused when ``self_check``
    is off, which would leave nothing to vouch for it) or ``cached:...``.
    Under torchrun only rank 0 reads the cache or judges (seconds on a miss); every rank gets its verdict
    (one broadcast), so N ranks do not each build the replica and no rank can decide otherwise."""
    found: list[tuple[str, str]] = []
    distributed.on_rank0_then_all(lambda: found.append(_verdict(config)))  # rank 0's error is every rank's
    outcome, line = distributed.broadcast_object(found[0] if found else None)
    if outcome == "refused":
        raise FamilyRefusedError(line)
    if outcome.endswith("unbuildable") and not self_check:
        raise FamilyRefusedError(
            f"model family {getattr(config, 'model_type', 'the model')!r}: no replica of this config runs, so the "
            "config verdict has none; keep model.self_check=true so the startup self-check can vouch for it"
        )
    return outcome


def _verdict(config) -> tuple[str, str]:
    """(outcome, refusal line) from the cache, or judged and cached."""
    family = getattr(config, "model_type", "the model")
    key = verdict_cache.verdict_key(config, VERSION)
    cache = verdict_cache.cache_file(key)
    if (found := verdict_cache.read(cache, key)) is not None:  # only an entry that verifies (verdict_cache)
        outcome, line = found
        return ("refused" if outcome == "refused" else f"cached:{outcome}"), line
    outcome, line = _judge(config, family)
    verdict_cache.write(cache, key, outcome, line)
    return outcome, line


REPLICA_MAX_PARAMETERS = 20_000_000
"""The larger replica (the config's own widths) runs only up to this many parameters (float64: 160 MB of
weights, as much of gradients); beyond it there is no replica, and the startup self-check decides."""


def larger_replica(config):
    """The replica tried where the tiny one cannot be built or run: the config's own shapes, fewer layers
    (``replica_config(config, own_shapes=True)``); ``Unbuildable`` past ``REPLICA_MAX_PARAMETERS``."""
    from transformers import AutoModelForCausalLM

    larger = replica_config(config, own_shapes=True)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(larger).parameters())
    if size > REPLICA_MAX_PARAMETERS:
        raise Unbuildable(f"{size:,} parameters, over {REPLICA_MAX_PARAMETERS:,}")
    return larger


def _judge(config, family: str) -> tuple[str, str]:
    """(outcome, refusal line): ``refused`` only on what a replica measures (packed examples that mix, a NaN,
    a packing refusal); a replica that cannot be built or run gives no verdict: the next one (the tiny
    replica, then the larger), then ``unbuildable`` (the startup self-check decides), said in one warning."""
    failed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, build in (("tiny replica", replica_config), ("larger replica", larger_replica)):
            try:
                replica = build(config)
                replica.use_cache = False
                diffs = _measure(replica)
            except AttentionBackendError as e:
                return "refused", f"model family {family!r} cannot be trained packed exactly with this config: {first_line(e)}"
            except ReplicaNaN as e:
                return "refused", f"model family {family!r} cannot be trained with this config: {e}"
            except FamilyRefusedError as e:
                return "refused", str(e)
            except Exception as e:  # noqa: BLE001 - the replica itself fails: no verdict from it
                failed.append(f"{name}: {type(e).__name__}: {first_line(e)}")
                continue
            return _judge_diffs(replica, family, diffs, config)
    log.warning("config verdict: no replica of %s runs (%s): the startup self-check decides", family, "; ".join(failed))
    return "unbuildable", ""


def _measure(replica) -> tuple[Diffs, torch.dtype]:
    """``compare(replica)``; where the CPU backend refuses its attention softcapping, with softcapping off (the
    kernel's softcap is the backend's check at start, not the config's)."""
    try:
        return compare(replica)
    except AttentionBackendError as e:
        if "softcapping" not in str(e):
            raise
        replica.attn_logit_softcapping = None
        return compare(replica)


def _judge_diffs(replica, family: str, found: tuple[Diffs, torch.dtype], user=None) -> tuple[str, str]:
    diffs, dtype = found
    if _exact(found):
        log.info("config verdict: %s exact for this config (%s replica: |logit diff| %.1g, |grad diff| %.1g)", family, dtype, diffs.logits, diffs.grads)
        return "exact", ""
    setting = "a setting of this config"
    for label, off in candidate_settings(replica, user):
        try:
            trial = type(replica).from_dict(replica.to_dict() | off)
            if _exact(compare(trial)):
                setting = label
                break
        except Exception:  # noqa: BLE001 - switching this setting off does not build: not the culprit we can name
            continue
    return "refused", (
        f"model family {family!r} cannot be trained packed exactly with {setting}: examples of a packed row mix "
        f"({str(dtype).split('.')[-1]} replica: |logit diff| {diffs.logits:.2g}, |grad diff| {diffs.grads:.2g})"
    )


__all__ = ["LENGTHS", "candidate_settings", "compare", "replica_config", "verify_config"]
