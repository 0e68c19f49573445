"""The replica stage: a tiny replica of the config a user actually runs, packed vs one by one, in float64.

The family table (``trainer.model.families``) was probed on each family's *default* config; a user's config
may add what that default lacks (short-convolution or linear-attention layers in ``layer_types``, a sliding
window the family keeps in its mask, chunked attention, another rope type, MoE routing). ``judge(config)``
builds ``replica_config(config)`` (``certification.shrink``: the same family and every setting that shapes
how tokens mix, widths and layers shrunk, windows below the longest example), prepared as ``build_model``
prepares it, and measures a packed row of examples of ``LENGTHS`` (the longest starting with the pad token,
as real inputs do) against the same examples alone through transformers' eager attention (``engine.measure``,
every parameter's gradient), in float64 (float32 where the model cannot run in float64); an exact replica
then takes one optimizer step (the trainer's default AdamW, clipping) and is measured again.

Its outcome (``Stage``): ``exact``; ``wrong`` (examples mix, the setting named by switching each candidate
off in turn; only the packed side is not finite; or the packed backend refuses the row, its boundaries lost);
``refused`` (packfsdp refuses it while building, or its examples alone are not finite: the model's own NaN).
A replica that cannot be built or run, or whose packed run raises, is no verdict on the user's model: the
larger replica (the config's own widths, ``larger_replica``) is tried, then the startup self-check decides
(``unbuildable``).

``probe(family)`` is the same stage on a family's default config: ``benchmarks/family_matrix.py --probe``.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from transformers import AutoModelForCausalLM

from trainer.config import LossConfig, OptimConfig
from trainer.errors import AttentionBackendError, ConfigError, first_line
from trainer.loss import summed_token_loss
from trainer.model.attention import AttentionNeeds, resolve_backend
from trainer.model.certification.cache import cache_file, read_verdict, verdict_key, write_verdict
from trainer.model.certification.certificate import REPLICA, Stage
from trainer.model.certification.engine import Measurement, TokenLossCheck, measure, nan_line, packed_batch
from trainer.model.certification.shrink import SHRINK, SMALL, default_config, replica_config
from trainer.model.families import selected_keys, text_family
from trainer.model.prepare import prepare_model
from trainer.optim import build_optimizer

LENGTHS = (21, 1, 14, 5, 11, 3, 9)
"""Every shrunk threshold (``SMALL``) is crossed by examples side by side; a 1-token example."""
VERSION = 5
"""Bump to invalidate cached verdicts when the replica changes."""
REPLICA_MAX_PARAMETERS = 20_000_000
"""The larger replica (the config's own widths) runs only up to this many parameters (float64: 160 MB of
weights, as much of gradients); beyond it there is no replica, and the startup self-check decides."""
PAD_NAN = (
    "; its first example starts with pad_token_id={pad}, whose embedding row is zero (the embedding's padding_idx; "
    "real inputs hold it: the pads of padded batches, a rank's filler micro-batch)"
)


def _named(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_line(e, 200)}"


def build_replica(config, dtype: torch.dtype):
    """``config`` built in ``dtype`` with transformers' eager attention (the reference honours softcap, sinks
    and windows), prepared as ``build_model`` prepares it behind ``sdpa_varlen``, with the run's default loss
    (``LossConfig().impl``: the chunked loss through the decoder stack, as a step takes it)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    model.config.use_cache = False
    backend = resolve_backend("sdpa_varlen", torch.device("cpu"), dtype, AttentionNeeds.of(config))
    wrapped = prepare_model(model, backend)
    wrapped.padded_attention = "eager"
    wrapped.use_loss(LossConfig().impl)
    return wrapped


def replica_examples(model) -> list[torch.Tensor]:
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


def optimizer_step(model, batch) -> bool:
    """One step on the packed row as the trainer takes it (the run's loss over the label count, clipping, the
    default optimizer of ``trainer.optim.build_optimizer``); whether every weight is still finite."""
    cfg = OptimConfig()
    optimizer = build_optimizer(model, cfg)
    model.zero_grad(set_to_none=True)
    (summed_token_loss(model, batch) / batch.num_label_tokens).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], cfg.grad_clip, foreach=True)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _judged(m: Measurement, pad: int | None, after: str = "") -> Stage:
    """The stage a replica's measurement gives (``pad``: the token its first example starts with, if the pad)."""
    if m.alone_nan:  # the model itself, one example at a time: no packing can fix it
        pad_note = PAD_NAN.format(pad=pad) if pad is not None else ""
        return Stage(REPLICA, "refused", after + nan_line(m, alone=True) + pad_note, m)
    if m.packed_nan:
        return Stage(REPLICA, "wrong", after + nan_line(m, alone=False), m)
    if not m.ok:
        return Stage(REPLICA, "wrong", f"{after}examples of a packed row mix ({m.short()})", m)
    return Stage(REPLICA, "exact", m.short(), m)


def _in_dtype(config, dtype: torch.dtype) -> Stage:
    """One replica of ``config`` in ``dtype``: built, its examples run alone once (or no verdict), measured, and
    an exact one measured again after one optimizer step."""
    try:
        model = build_replica(config, dtype)
    except (ConfigError, AttentionBackendError) as e:  # packfsdp refuses it while building
        return Stage(REPLICA, "refused", first_line(e))
    except Exception as e:  # noqa: BLE001 - transformers cannot build the tiny replica: no verdict
        return Stage(REPLICA, "unbuildable", _named(e))
    examples = replica_examples(model)
    pad = int(examples[0][0]) if examples[0][0] == getattr(model.config, "pad_token_id", None) else None
    try:
        with torch.no_grad():
            model(
                input_ids=examples[0][None],
                position_ids=torch.arange(len(examples[0]))[None],
                attention_mask=torch.ones_like(examples[0])[None],
            )
    except Exception as e:  # noqa: BLE001 - transformers' own path fails on the replica: no verdict
        return Stage(REPLICA, "unbuildable", "runs alone: " + _named(e))
    batch, summed = packed_batch(examples), TokenLossCheck(per_label=False)
    try:
        found = _judged(measure(model, batch, summed, full=True), pad)
        if found.outcome != "exact":
            return found
        if not optimizer_step(model, batch):
            return Stage(REPLICA, "wrong", "after one optimizer step: a weight is not finite", found.measurement)
        after = _judged(measure(model, batch, summed, full=True), pad, "after one optimizer step: ")
    except AttentionBackendError as e:  # the backend cannot keep this packed row's examples apart, and says so
        return Stage(REPLICA, "wrong", first_line(e))
    except ConfigError as e:
        return Stage(REPLICA, "refused", first_line(e))
    except Exception as e:  # noqa: BLE001 - the packed run raises where its examples alone run
        return Stage(REPLICA, "error", _named(e))
    return found if after.outcome == "exact" else after


def run_replica(config) -> Stage:
    """``config``'s replica in float64, or float32 where the model cannot run in float64 (grouped-GEMM MoE
    kernels; GPT-2's ``reorder_and_upcast_attn`` asserts float32 attention weights); with softcapping off where
    the CPU backend refuses it (the kernels' softcap is the backend's check at start, not the config's)."""
    found = _in_dtype(config, torch.float64)
    if found.outcome in ("unbuildable", "error"):
        fallback = _in_dtype(config, torch.float32)
        if fallback.outcome not in ("unbuildable", "error"):
            return dataclasses.replace(fallback, detail=f"{fallback.detail} (float64 fails: {found.detail})")
    if found.outcome == "refused" and "softcapping" in found.detail and getattr(config, "attn_logit_softcapping", None):
        config.attn_logit_softcapping = None
        found = run_replica(config)
        found.detail = f"softcapping off: {found.detail}"
    return found


def larger_replica(config):
    """The replica tried where the tiny one gives no verdict: the config's own shapes, fewer layers
    (``replica_config(config, own_shapes=True)``); none past ``REPLICA_MAX_PARAMETERS``."""
    larger = replica_config(config, own_shapes=True)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(larger).parameters())
    if size > REPLICA_MAX_PARAMETERS:
        raise ValueError(f"{size:,} parameters, over {REPLICA_MAX_PARAMETERS:,}")
    return larger


def judge(config) -> Stage:
    """The replica stage's verdict on ``config``: the tiny replica's, or where it gives none the larger's (a
    wrong one names the setting); ``unbuildable``, with why, where neither runs."""
    failed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, build in (("tiny replica", replica_config), ("larger replica", larger_replica)):
            try:
                replica = build(config)
            except Exception as e:  # noqa: BLE001 - no replica of this config: no verdict from it
                failed.append(f"{name}: {_named(e)}")
                continue
            found = run_replica(replica)
            if found.outcome == "wrong" and found.measurement is not None and not found.measurement.packed_nan:
                return name_the_setting(replica, found, config)
            if found.outcome in ("exact", "refused", "wrong"):
                return found
            failed.append(f"{name}: {found.detail}")
    return Stage(REPLICA, "unbuildable", f"no replica runs ({'; '.join(failed)})")


def name_the_setting(replica, found: Stage, user) -> Stage:
    """``found`` (examples mix) with the setting that makes them mix: the first candidate (``candidate_settings``)
    whose switching off makes the replica exact."""
    setting = "a setting of this config"
    for label, off in candidate_settings(replica, user):
        try:
            trial = type(replica).from_dict(replica.to_dict() | off)
        except Exception:  # noqa: BLE001 - switching this setting off does not build: not the culprit we can name
            continue
        if run_replica(trial).outcome == "exact":
            setting = label
            break
    return dataclasses.replace(found, detail=f"with {setting}, {found.detail}")


def candidate_settings(config, user=None) -> list[tuple[str, dict]]:
    """(setting named in a refusal, overrides that switch it off) for the token-mixing settings ``config`` has;
    sizes in the names are the ``user`` config's (the replica's are shrunk)."""
    values = config.to_dict()
    shown = values | ({k: v for k, v in user.to_dict().items() if k in SMALL} if user is not None else {})
    out = []
    layer_types = values.get("layer_types") or []
    kinds = list(dict.fromkeys(layer_types))

    def replaced(kind, by) -> dict:
        return {"layer_types": [by if k == kind else k for k in layer_types]}

    for kind in kinds:
        if "attention" not in str(kind):
            out.append(
                (
                    f"layer_types contains {kind!r}",
                    replaced(kind, next((k for k in kinds if "attention" in str(k)), "full_attention")),
                )
            )
    for kind in kinds:  # windowed / chunked attention layers, full otherwise
        if "attention" in str(kind) and kind != "full_attention":
            size = next(
                (
                    f" ({n}={shown[n]})"
                    for n in ("sliding_window", "attention_chunk_size")
                    if values.get(n) and n.split("_")[0][:5] in kind
                ),
                "",
            )
            out.append((f"layer_types {kind!r}{size}", replaced(kind, "full_attention")))
    for name in ("sliding_window", "attention_chunk_size", "window_size", "chunk_size"):
        if values.get(name):
            sliding = name == "sliding_window" and "use_sliding_window" in values
            label = f"{name}={shown[name]}" + (" (use_sliding_window=true)" if values.get("use_sliding_window") else "")
            out.append((label, {name: None} | ({"use_sliding_window": False} if sliding else {})))
    for name in ("rope_parameters", "rope_scaling"):
        rope = values.get(name)
        if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
            default = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
            out.append((f"rope_type {rope['rope_type']!r}", {name: default}))
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if values.get(name):  # Mixtral's num_local_experts=1: one expert, no routing
            out.append((f"MoE routing ({name}={values[name]})", {name: int(name == "num_local_experts")}))
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if values.get(name):
            out.append((f"{name}={values[name]}", {name: None}))
    if values.get("attn_temperature_tuning") and values.get("floor_scale"):
        label = f"attn_temperature_tuning (floor_scale={shown['floor_scale']})"
        out.append((label, {"attn_temperature_tuning": False}))
    return out


def probe(family: str, **overrides) -> Stage:
    """The replica stage on ``family``'s default config (``shrink.default_config``, ``overrides`` on top), as
    ``benchmarks/family_matrix.py --probe`` runs it over every family; a multimodal family is probed as its
    language model's text family (``families.text_family``)."""
    if text := text_family(family):  # what packfsdp trains of a multimodal family: its language model
        found = probe(text, **overrides)
        return dataclasses.replace(found, detail=f"as {text}: {found.detail}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = default_config(family, **overrides)
            if reason := selected_keys(config):  # the prior's refusal of a config's layers
                return Stage(REPLICA, "refused", reason)
            replica = replica_config(config)
        except Exception as e:  # noqa: BLE001 - transformers cannot build the family's tiny config: no verdict
            return Stage(REPLICA, "unbuildable", _named(e))
        return run_replica(replica)


def cached_judge(config) -> Stage:
    """``judge(config)``, kept in the verdict cache (``certification.cache``: used only when its entry verifies)."""
    key = verdict_key(config, VERSION)
    path = cache_file(key)
    if (entry := read_verdict(path, key)) is not None:
        return Stage(REPLICA, *entry, cached=True)
    found = judge(config)
    write_verdict(path, key, found.outcome, found.detail)
    return found


__all__ = [
    "LENGTHS",
    "build_replica",
    "cached_judge",
    "candidate_settings",
    "judge",
    "probe",
    "replica_config",
    "run_replica",
]
