"""A verdict for the config a user actually runs: a tiny float64 replica of it, packed vs one by one.

The family table (``trainer.model.families``) was probed on each family's *default* config; a user's config
may add what that default lacks (short-convolution or linear-attention layers in ``layer_types``, a sliding
window the family keeps in its mask, chunked attention, another rope type, MoE routing). Before training,
``verify_config`` builds ``replica_config(config)``: the same ``model_type`` and every setting that shapes how
tokens mix, widths shrunk, one layer of each distinct per-layer pattern (``layer_types``, ``no_rope_layers``,
...), windows / chunks / rope thresholds shrunk below the probe's longest example so that examples cross
them. It runs a packed row of ``LENGTHS`` against the same examples alone through transformers' eager
attention, in float64, and compares logits and every parameter's gradient. A mismatch raises
``FamilyRefusedError`` in one line naming the family and the setting (found by switching each candidate
setting off in turn). Verdicts are cached by a hash of the config and the installed versions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import warnings
from pathlib import Path

import torch

from trainer import distributed
from trainer.model.families import FamilyRefusedError
from trainer.model.prepare import prepare_model
from trainer.model.family_probe import NO_DROPOUT, SHRINK, Diffs, differences, run_alone, run_packed

log = logging.getLogger(__name__)

LENGTHS = (21, 1, 14, 5, 11, 3, 9)
"""Every shrunk threshold (``SMALL``) is crossed by examples side by side; a 1-token example."""
SMALL = {"sliding_window": 6, "attention_chunk_size": 8, "window_size": 6, "chunk_size": 8, "mamba_chunk_size": 8}
"""Window / chunk sizes of the replica (the user's are far longer than any probe example)."""
ROPE_ORIGINAL = 16
"""The replica's rope threshold (``original_max_position_embeddings``): below the longest example."""
CONTEXT = 64
TOLERANCE = {torch.float64: (1e-6, 1e-5), torch.float32: (2e-5, 2e-5)}
"""(logits, gradients) per replica dtype; a leak between examples gives ~1e-4 and more (float32 steps inside
transformers' float64 models, rope among them, leave ~1e-7). float32 only where a kernel refuses float64
(grouped-GEMM MoE experts)."""
MAX_LAYERS = 6
VERSION = 4
"""Bump to invalidate cached verdicts when the replica changes."""


class Unbuildable(RuntimeError):
    """transformers cannot build the tiny replica of this config: no verdict from it."""


def _per_layer_fields(values: dict, layers: int) -> list[str]:
    return [k for k, v in values.items() if isinstance(v, (list, tuple)) and len(v) == layers and layers > 1]


def replica_config(config):
    """A tiny config of ``config``'s family with its token-mixing settings (see the module docstring)."""
    from transformers import AutoConfig

    values = config.to_dict()
    model_type = values.get("model_type") or config.model_type
    layers = int(values.get("num_hidden_layers") or values.get("n_layer") or 0)
    per_layer = _per_layer_fields(values, layers)
    # One layer of each distinct combination of per-layer settings, in order (at least two layers).
    keep, seen = [], set()
    for i in range(layers):
        key = json.dumps([values[k][i] for k in per_layer], default=str)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    keep = (keep + [i for i in range(layers) if i not in keep])[: max(2, min(len(keep), MAX_LAYERS))] if layers else []
    keep.sort()
    shrunk = {k: v for k, v in SHRINK.items() if k in values and k not in ("sliding_window",)}
    shrunk.update({k: 0.0 for k in NO_DROPOUT if k in values})
    if layers:
        for name in ("num_hidden_layers", "n_layer", "num_layers"):
            if name in values:
                shrunk[name] = len(keep)
        for name in per_layer:
            shrunk[name] = [values[name][i] for i in keep]
        if isinstance(values.get("max_window_layers"), int) and values["max_window_layers"] < layers:
            shrunk["max_window_layers"] = sum(1 for i in keep if i < values["max_window_layers"])
        for name, value in values.items():  # layer-index lists (Zamba2's hybrid_layer_ids): the kept layers' indices
            if name.endswith(("_layer_ids", "_layer_indices", "_idxs")) and isinstance(value, list) and all(isinstance(i, int) for i in value):
                shrunk[name] = [j for j, i in enumerate(keep) if i in value]
        for name, value in values.items():  # a layer pattern by period (Jamba: attention every 8th layer from the 4th)
            if name.endswith("_layer_period") and isinstance(value, int) and value > len(keep):
                shrunk[name], shrunk[name.replace("_period", "_offset")] = 2, 1  # keeps both kinds of layer
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
    if "qk_rope_head_dim" in values:
        shrunk["head_dim"] = SHRINK["qk_rope_head_dim"]
    if values.get("num_key_value_heads") == values.get("num_attention_heads") and "num_attention_heads" in shrunk:
        shrunk["num_key_value_heads"] = shrunk["num_attention_heads"]  # MHA stays MHA (Kimi's latent attention needs it)
    if "rotary_dim" in values:
        shrunk["rotary_dim"] = 8
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


def _finite(run) -> bool:
    return math.isfinite(run.loss) and all(bool(torch.isfinite(g).all()) for g in run.grads.values())


NOT_FINITE = (
    "its own gradients are not finite (NaN) on an input token whose embedding is zero (pad_token_id={pad}, "
    "the embedding's padding_idx: the pads of padded batches, a rank's filler micro-batch): a step with it trains nothing"
)


def compare(config) -> tuple[Diffs, torch.dtype]:
    """(max |logit|, |loss| and |grad diff|, dtype) of ``config`` packed vs one by one: float64, or float32
    where the model cannot run in float64."""
    try:
        return _compare(config, torch.float64), torch.float64
    except RuntimeError as e:
        if "Double" not in str(e) and "double" not in str(e):
            raise
        return _compare(config, torch.float32), torch.float32


def _compare(config, dtype: torch.dtype) -> Diffs:
    from transformers import AutoModelForCausalLM

    from trainer.model.attention import AttentionNeeds, resolve_backend

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
    if not _finite(alone):  # the model itself, one example at a time: no packing can fix it (Gemma 3n's AltUp)
        family = getattr(config, "model_type", "the model")
        reason = NOT_FINITE.format(pad=config.pad_token_id) if examples[0][0] == config.pad_token_id else "its own gradients are not finite (NaN)"
        raise FamilyRefusedError(f"model family {family!r} cannot be trained with this config: {reason}")
    return differences(run_packed(wrapped, examples), alone)


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
    return out


def _cache_file(config) -> Path | None:
    import transformers

    root = os.environ.get("PACKFSDP_CACHE")
    if not root:
        return None
    values = {k: v for k, v in config.to_dict().items() if k not in ("transformers_version", "_name_or_path", "architectures")}
    key = json.dumps([VERSION, transformers.__version__, torch.__version__, values], sort_keys=True, default=str)
    return Path(root).expanduser() / "verdicts" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def verify_config(config) -> str:
    """Refuse ``config`` (``FamilyRefusedError``, one line) when its replica mixes packed examples; returns
    ``exact``, ``unbuildable`` (no replica: the table and the self-check decide) or ``cached:...``.
    Under torchrun only rank 0 reads the cache or judges (seconds on a miss); every rank gets its verdict
    (one broadcast), so N ranks do not each build the replica and no rank can decide otherwise."""
    found: list[tuple[str, str]] = []
    distributed.on_rank0_then_all(lambda: found.append(_verdict(config)))  # rank 0's error is every rank's
    outcome, line = distributed.broadcast_object(found[0] if found else None)
    if outcome == "refused":
        raise FamilyRefusedError(line)
    return outcome


def _verdict(config) -> tuple[str, str]:
    """(outcome, refusal line) from the cache, or judged and cached."""
    family = getattr(config, "model_type", "the model")
    cache = _cache_file(config)
    if cache is not None and cache.is_file():
        found = json.loads(cache.read_text())
        return ("refused" if found["outcome"] == "refused" else f"cached:{found['outcome']}"), found["line"]
    outcome, line = _judge(config, family)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"outcome": outcome, "line": line}))
        tmp.replace(cache)
    return outcome, line


def _judge(config, family: str) -> tuple[str, str]:
    from trainer.errors import first_line
    from trainer.model.packed_layout import AttentionBackendError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            replica = replica_config(config)
            replica.use_cache = False
        except Exception as e:  # noqa: BLE001 - transformers cannot build the replica: no verdict from it
            log.warning("config verdict: no tiny replica of %s (%s): the family table and self-check decide", family, first_line(e))
            return "unbuildable", ""
        try:
            diffs = compare(replica)
        except AttentionBackendError as e:
            if "softcapping" not in str(e):
                return "refused", f"model family {family!r} cannot be trained packed exactly with this config: {first_line(e)}"
            replica.attn_logit_softcapping = None  # the kernel's softcap is the backend's check, not the config's
            return _judge_diffs(replica, family, None, config)
        except FamilyRefusedError as e:
            return "refused", str(e)
        except Unbuildable as e:
            log.warning("config verdict: no tiny replica of %s (%s): the family table and self-check decide", family, first_line(e))
            return "unbuildable", ""
        except Exception as e:  # noqa: BLE001 - the replica crashes packed or alone
            return "refused", f"model family {family!r} cannot be trained packed with this config: the tiny replica fails: {type(e).__name__}: {first_line(e)}"
        return _judge_diffs(replica, family, diffs, config)


def _judge_diffs(replica, family: str, found, user=None) -> tuple[str, str]:
    found = found if found is not None else compare(replica)
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
