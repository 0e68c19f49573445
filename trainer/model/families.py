"""Which transformers causal-LM families packfsdp trains packed exactly, which it refuses, and why.

Every ``model_type`` of transformers' causal-LM auto mapping was probed with ``benchmarks/family_matrix.py``
(``trainer.model.family_probe``: a tiny 2-layer model, a packed row of examples of lengths 9, 1, 14, 5, 11,
3 against the same examples one by one; logits and every parameter's gradient, fp32, 1e-5). The verdicts:

- ``EXACT``: packed == one by one.
- ``REFUSED``: would be wrong or crash when packed; ``build_model`` refuses it with one line and the reason.
- ``SKIPPED``: not a decoder-only causal LM (an encoder-decoder's decoder, a bidirectional encoder, a
  multimodal model); refused too, with that reason.
- anything else is *untested* (a family newer than ``TESTED_WITH``): it trains only behind the startup
  self-check (``trainer.model.selfcheck``, a worst-case batch), which stops it on a mismatch.

One source for the docs table too: ``benchmarks/family_matrix.py --markdown`` prints it from here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainer.config import ConfigError
from trainer.model.attention_needs import SINK_FAMILIES

log = logging.getLogger(__name__)

TESTED_WITH = "5.24.0"
"""The transformers version the table was probed with."""


class FamilyRefusedError(ConfigError):
    """A model family (or its rope type) that packfsdp cannot train packed exactly."""


# Reasons, one per kind of failure the matrix found.
NO_INTERFACE = "its attention does not go through transformers' attention interface, so the example boundaries never reach it"
DROPS_KWARGS = "its layers call the attention without the keyword arguments that carry the example boundaries"
HUB_KERNEL = (
    "on a GPU transformers builds its WKV attention by fetching a kernel from the Hugging Face Hub "
    "(kernels-community/rwkv), code packfsdp does not run"
)
ROW_POSITIONS = (
    "its attention adds learned relative-position logits and log-scaling computed from positions over the whole "
    "row (not position_ids), which the packed attention backends do not apply"
)
OWN_MASK = "its attention adds a learned dynamic mask through the attention mask, which packed attention has not"
SINKS = "attention sinks (s_aux): no packed backend implements them"
NOT_CAUSAL = "a bidirectional encoder: causal only as an encoder-decoder's decoder, not a decoder-only causal LM"
ENCODER_DECODER = "the decoder of an encoder-decoder model, not a decoder-only causal LM"
MULTIMODAL = "a multimodal model: packfsdp trains text-only causal LMs (use its text family)"

WINDOW_DROPPED = frozenset({"phimoe"})
"""Exact families whose attention does not pass the sliding window on to the attention function (their
padded path applies it through the mask): refused when the window is shorter than the context (Phi-3.5-MoE
ships a window as long as its context, which never binds)."""
WINDOW_DROPPED_REASON = "its attention does not pass its sliding window on to the attention function"
CHUNK_DROPPED = frozenset({"llama4_text"})
"""Exact families whose chunked-attention layers keep their chunks in the mask only (never passed on to the
attention function): refused when a chunked layer's chunk is shorter than the context."""
CHUNK_DROPPED_REASON = "its chunked-attention layers do not pass attention_chunk_size on to the attention function"

RELAY_BOUNDARIES = frozenset({"stablelm", "nemotron"})
"""Families whose decoder layers drop the attention keyword arguments: ``build_model`` hands the example
boundaries to their attention modules directly (``trainer.model.prepare.relay_boundaries``); then exact."""

EXACT: frozenset[str] = frozenset(
    {
        "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "beam", "biogpt", "bitnet",
        "codegen", "cohere", "cohere2", "cohere2_moe", "ctrl", "cwm", "deepseek_v2", "deepseek_v3", "diffllama",
        "dory", "dots1", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "flex_olmo", "gemma",
        "gemma2", "gemma3_text", "gemma4_text", "gemma4_unified_text", "glm", "glm4", "glm4_moe",
        "glm4_moe_lite", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "granite", "granitemoe",
        "granitemoeshared", "helium", "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax",
        "internlm3", "iquestcoder", "jais2", "jetmoe", "kolibri1", "laguna", "lfm2", "llama", "llama4_text",
        "mellum", "minicpm3", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral",
        "mixtral", "modernbert-decoder", "moshi", "nanochat", "nemotron", "olmo", "olmo2", "olmo3", "olmoe",
        "opt", "persimmon", "phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "sarvam_mla",
        "sarvam_moe", "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "vaultgemma", "whisper",
        "youtu",
        # token mixers outside attention, kept per example (trainer.model.mixers)
        "bailing_hybrid", "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "kimi_linear",
        "lara_mini", "lfm3", "mamba", "mamba2", "minimax", "nemotron_h", "olmo_hybrid", "qwen3_5_moe_text",
        "qwen3_5_text", "qwen3_next", "recurrent_gemma", "xlstm", "zamba", "zamba2",
    }
)
"""Probed exact (transformers ``TESTED_WITH``): the trainer's step on a tiny default config. Some only for
some configs (``EXACT_IF``)."""

EXACT_IF: dict[str, str] = {
    "gemma2": "with flash_attn or flex, which honour its attention softcapping (the other backends are refused at start)",
    "llama4_text": (
        "while no chunked-attention layer's chunk binds (attention_chunk_size at least the context): its "
        "default config and the released checkpoints (chunks of 8192) are refused, the chunks stay in the mask"
    ),
    "phimoe": "while its sliding window is at least its context (its attention does not pass a shorter window on: refused)",
    "qwen2_moe": (
        "while its layers are full attention (its default); sliding-window layers are refused by the config "
        "verdict (the window stays in the mask and never reaches the attention function)"
    ),
}
"""Exact families whose verdict depends on the config: the condition (the config verdict,
``trainer.model.config_verdict``, or ``check_family`` enforces it per config)."""

EXACT_FROM: dict[str, tuple[str, str]] = {
    "codegen": ("5.24", NO_INTERFACE),
    "gptj": ("5.24", NO_INTERFACE),
    "moshi": ("5.24", DROPS_KWARGS),
}
"""Exact families that probed wrong on an older transformers ``pyproject.toml`` accepts (5.17: GPT-J and
CodeGen bypass the attention interface, Moshi's layers drop the boundaries): (the oldest version probed
exact, the reason). Refused with an older installed transformers (versions between were not probed)."""


def _reasons(reason: str, *families: str) -> dict[str, str]:
    return dict.fromkeys(families, reason)


REFUSED: dict[str, str] = {
    **_reasons(NO_INTERFACE, "bloom", "cpmant", "falcon", "gpt_neox_japanese", "mpt", "openai-gpt", "xglm"),
    **_reasons(DROPS_KWARGS, "inkling2_text", "inkling2_loop_text"),
    **_reasons(HUB_KERNEL, "rwkv"),
    **_reasons(ROW_POSITIONS, "inkling_text"),
    **_reasons(OWN_MASK, "doge"),
    **_reasons(SINKS, *SINK_FAMILIES),
}
"""Would crash or train wrong when packed: ``build_model`` refuses them with the reason."""

SKIPPED: dict[str, str] = {
    **_reasons(
        NOT_CAUSAL, "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
        "megatron-bert", "reformer", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm",
        "xlm-roberta", "xlm-roberta-xl", "xlnet", "xmod",
    ),
    **_reasons(
        ENCODER_DECODER, "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart",
        "moss_transcribe_diarize", "musicgen", "musicgen_melody", "mvp", "pegasus", "plbart", "prophetnet", "trocr",
    ),
    **_reasons(
        MULTIMODAL, "dots3_note", "emu3", "fuyu", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "git",
        "got_ocr2", "llama4", "mllama", "phi4_multimodal", "qwen3_5", "qwen3_5_moe", "qwen4_exp",
    ),
}
"""Not decoder-only causal LMs (refused the same way, with the reason)."""

NOT_PROBED = frozenset(
    {
        "axk2", "blt", "cohere_compass_text", "dbrx", "deepseek_v32", "dots3_note_text",
        "gemma3n_text", "gemma4_assistant", "gemma4_unified_assistant", "glm_moe_dsa", "gpt_neo", "lfm2_moe",
        "longcat_flash", "qwen4_exp_text", "zaya",
    }
)
"""Families of ``TESTED_WITH`` the tiny probe could not build (sub-configs it does not shrink, head-dim rules,
no result in time): untested, so they train only behind the startup self-check. LFM2-MoE (its default config
has no ``layer_types``) and ZAYA (one expert per token) probe exact on hand-made tiny configs (float64,
transformers 5.25 and 5.17), their short convolutions kept per example."""


@dataclass(frozen=True)
class Verdict:
    family: str
    kind: str
    """``exact``, ``refused``, ``skipped`` or ``untested``."""
    reason: str = ""
    """Why refused or skipped; for an exact family, the condition it is exact under (``EXACT_IF``), if any."""


def verdict(family: str) -> Verdict:
    """What the table says about ``family`` (a transformers ``model_type``)."""
    if family in EXACT:
        if family in EXACT_FROM and _older_than(EXACT_FROM[family][0]):
            since, reason = EXACT_FROM[family]
            return Verdict(family, "refused", f"{reason} (transformers {_installed()}; exact from {since})")
        return Verdict(family, "exact", EXACT_IF.get(family, ""))
    if family in REFUSED:
        return Verdict(family, "refused", REFUSED[family])
    if family in SKIPPED:
        return Verdict(family, "skipped", SKIPPED[family])
    if family in NOT_PROBED:
        return Verdict(family, "untested", "the tiny probe could not build it: trains only behind the startup self-check")
    return Verdict(family, "untested")


def _installed() -> str:
    import transformers

    return transformers.__version__


def _older_than(version: str) -> bool:
    """The installed transformers is older than ``version``."""
    from packaging.version import Version

    return Version(_installed()) < Version(version)


def refusal_line(family: str, reason: str) -> str:
    return f"model family {family!r} cannot be trained packed exactly: {reason}"


def binding_window_dropped(config) -> str | None:
    """Why a family of ``WINDOW_DROPPED`` / ``CHUNK_DROPPED`` cannot be packed with this config (a sliding
    window or an attention chunk shorter than its context, which its attention would lose), or ``None``."""
    family = getattr(config, "model_type", None)
    window = getattr(config, "sliding_window", None)
    context = getattr(config, "max_position_embeddings", None)
    if family in WINDOW_DROPPED and window and (context is None or window < context):
        return f"{WINDOW_DROPPED_REASON} (sliding_window={window} is shorter than the context {context})"
    chunk = getattr(config, "attention_chunk_size", None)
    chunked = "chunked_attention" in (getattr(config, "layer_types", None) or ["chunked_attention"])
    if family in CHUNK_DROPPED and chunk and chunked and (context is None or chunk < context):
        return f"{CHUNK_DROPPED_REASON} (attention_chunk_size={chunk} is shorter than the context {context})"
    return None


def check_family(config, self_check: bool = True) -> Verdict:
    """Raise ``FamilyRefusedError`` (one line: the family and the reason) for a refused or skipped family,
    an exact family whose config asks for what it cannot pack (``binding_window_dropped``), and an untested
    one when the startup self-check is off (it is then the only guard)."""
    family = getattr(config, "model_type", None) or "the model"
    found = verdict(family)
    if found.kind in ("refused", "skipped"):
        raise FamilyRefusedError(refusal_line(family, found.reason))
    if reason := binding_window_dropped(config):
        raise FamilyRefusedError(refusal_line(family, reason))
    if found.kind == "untested":
        if not self_check:
            raise FamilyRefusedError(
                f"model family {family!r} is untested with packing (not in packfsdp's table for transformers "
                f"{TESTED_WITH}); keep model.self_check=true so the startup self-check can vouch for it"
            )
        log.warning(
            "model family %r is untested with packing (table of transformers %s): the startup self-check decides",
            family, TESTED_WITH,
        )
    return found


__all__ = ["EXACT", "EXACT_FROM", "EXACT_IF", "NOT_PROBED", "REFUSED", "SKIPPED", "TESTED_WITH", "FamilyRefusedError", "Verdict", "check_family", "verdict"]
