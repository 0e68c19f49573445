"""The certification's table prior: which transformers causal-LM families pack exactly, which are refused, why.

Every ``model_type`` of transformers' causal-LM auto mapping was probed with ``benchmarks/family_matrix.py
--probe`` (the replica stage, ``trainer.model.certification.replica.probe``, on each family's default config:
a tiny replica, a packed row against its examples one by one, logits and every parameter's gradient, float64,
before and after one optimizer step). The verdicts:

- ``EXACT``: packed == one by one (``EXACT_IF``: under a condition the later stages check per config).
- ``REFUSED``: would be wrong or crash when packed; refused at build with one line and the reason.
- ``SKIPPED``: not a decoder-only causal LM (an encoder-decoder's decoder, a bidirectional encoder, a
  multimodal model without a separate language model); refused too, with that reason.
- anything else is *untested* (a family newer than ``TESTED_WITH``): the replica and the startup self-check
  decide (``trainer.model.certification``).

Besides the verdicts, the families whose layers keep a setting out of the attention call (``WINDOW_DROPPED``,
``CHUNK_DROPPED``, ``TEMPERATURE_BY_ROW``, ``RELAY_BOUNDARIES``): ``build_model`` hands it to them. One source
for the docs table too: ``benchmarks/family_matrix.py --markdown`` prints it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers
from packaging.version import Version
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
)

from trainer.config import ConfigError
from trainer.model_config import language_model_config

TESTED_WITH = "5.25.0"
"""The transformers version the table was probed with."""


class FamilyRefusedError(ConfigError):
    """A model family (or its rope type) that packfsdp cannot train packed exactly."""


# Reasons, one per kind of failure the matrix found.
NO_INTERFACE = (
    "its attention does not go through transformers' attention interface, so the example boundaries never reach it"
)
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
INDEXER = (
    "its attention attends to the keys a DSA indexer selects per query, through the attention mask: packed "
    "attention has no mask and no backend implements the selection (made over a packed row, it would pick "
    "other examples' keys)"
)
NOT_CAUSAL = "a bidirectional encoder: causal only as an encoder-decoder's decoder, not a decoder-only causal LM"
ENCODER_DECODER = "the decoder of an encoder-decoder model, not a decoder-only causal LM"
MULTIMODAL_ROUTE = (
    "a multimodal model: its language model trains as its text family (gemma3 as gemma3_text; a folder's text "
    "config decides) and takes that family's verdict; the vision/audio parts are frozen, written back by export"
)
MULTIMODAL_FLAT = "a multimodal model with one config for all its parts: no separate language model to train"
MULTIMODAL_NO_LM = "a multimodal model whose language model ({text}) is no causal-LM family of transformers"
NO_CAUSAL_LM = "transformers has no causal-LM class for it: not a decoder-only causal LM"
ASSISTANT = (
    "a speculative-decoding assistant: its layers read the keys and values of the model it drafts for, not a "
    "causal LM trained alone"
)

WINDOW_DROPPED = frozenset({"phimoe", "qwen2_moe"})
"""Families whose attention does not pass its sliding window on to the attention function (their padded path
applies it through the mask): ``build_model`` hands it to their sliding layers (``trainer.model.layer_relay``)."""
CHUNK_DROPPED = frozenset({"llama4_text"})
"""Families whose chunked-attention layers keep their chunks in the mask only: ``build_model`` hands those
layers boundaries cut at every chunk (``trainer.model.layer_relay``)."""
TEMPERATURE_BY_ROW = frozenset({"llama4_text"})
"""Families whose attention temperature (Llama 4's NoPE layers) reads a token's row index, not its
position: ``build_model`` makes it read the position (``trainer.model.layer_relay``)."""
SELECTING_LAYERS = {
    "indexed_attention": "attend to the keys a DSA indexer selects per query (index_topk={index_topk})",
    "minimax_m3_sparse": (
        "attend to the key blocks an indexer selects per query (index_block_size={index_block_size}, "
        "index_topk_blocks={index_topk_blocks} with index_local_blocks={index_local_blocks})"
    ),
    "compressed_sparse_attention": "attend to keys a compressor pools over blocks of tokens, selected by an indexer",
    "heavily_compressed_attention": "attend to keys a compressor pools over blocks of tokens",
}
"""Layer types whose attention sees keys an indexer selects or a compressor pools (from ``layer_types``),
with what they do: no packed backend implements that (made over a packed row, it would pick or pool other
examples' keys), so a config with one is refused at build."""

RELAY_BOUNDARIES = frozenset({"stablelm", "nemotron"})
"""Families whose decoder layers drop the attention keyword arguments: ``build_model`` hands the example
boundaries to their attention modules directly (``trainer.model.prepare.relay_boundaries``); then exact."""

EXACT: frozenset[str] = frozenset(
    {
        "afmoe",
        "apertus",
        "apertus1p5_text",
        "arcee",
        "aria_text",
        "axk1",
        "beam",
        "biogpt",
        "bitnet",
        "codegen",
        "cohere",
        "cohere2",
        "cohere2_moe",
        "ctrl",
        "cwm",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v4",
        "diffllama",
        "dory",
        "dots1",
        "ernie4_5",
        "ernie4_5_moe",
        "exaone",
        "exaone4",
        "exaone_moe",
        "flex_olmo",
        "flint",
        "gemma",
        "gemma2",
        "gemma3_text",
        "gemma4_text",
        "gemma4_unified_text",
        "glm",
        "glm4",
        "glm4_moe",
        "glm4_moe_lite",
        "gpt-sw3",
        "gpt2",
        "gpt_bigcode",
        "gpt_neox",
        "gpt_oss",
        "gptj",
        "granite",
        "granite_swa",
        "granitemoe",
        "granitemoe_swa",
        "granitemoeshared",
        "helium",
        "hrm_text",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "hy_v3",
        "hyperclovax",
        "internlm3",
        "iquestcoder",
        "jais2",
        "jetmoe",
        "kolibri1",
        "laguna",
        "lfm2",
        "llama",
        "llama4_text",
        "mellum",
        "mimo_v2_flash",
        "minicpm3",
        "minimax_m2",
        "minimax_m3_vl_text",
        "ministral",
        "ministral3",
        "mistral",
        "mixtral",
        "modernbert-decoder",
        "moshi",
        "nanochat",
        "nemotron",
        "olmo",
        "olmo2",
        "olmo3",
        "olmoe",
        "opt",
        "persimmon",
        "phi",
        "phi3",
        "phimoe",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "sarvam_mla",
        "sarvam_moe",
        "seed_oss",
        "smollm3",
        "solar_open",
        "stablelm",
        "starcoder2",
        "vaultgemma",
        "whisper",
        "youtu",
        # built by the tiny probe since its shrinking rules keep each config's constraints (transformers 5.25)
        "cohere_compass_text",
        "dbrx",
        "ergo",
        "gemma3n_text",
        "longcat_flash",
        "minicpm5_moe",
        "param2moe",
        # token mixers outside attention, kept per example (trainer.model.mixers)
        "bailing_hybrid",
        "bamba",
        "falcon_h1",
        "falcon_mamba",
        "granitemoehybrid",
        "jamba",
        "kimi_linear",
        "lara_mini",
        "lfm3",
        "mamba",
        "mamba2",
        "minimax",
        "nemotron_h",
        "olmo_hybrid",
        "qwen3_5_moe_text",
        "qwen3_5_text",
        "qwen3_next",
        "recurrent_gemma",
        "xlstm",
        "zamba",
        "zamba2",
        "lfm2_moe",
        "zaya",
    }
)
"""Probed exact (transformers ``TESTED_WITH``): the trainer's step on a tiny default config. Some only for
some configs (``EXACT_IF``)."""

EXACT_IF: dict[str, str] = {
    "gemma2": "with flash_attn or flex, which honour its attention softcapping (other backends are refused at start)",
    "llama4_text": (
        "with its chunked-attention layers cut at every chunk and its NoPE layers' attention temperature read from "
        "positions (trainer.model.layer_relay); a chunk shorter than an example is refused under parallel.cp"
    ),
    "phimoe": "with its sliding window handed to its layers (its attention does not pass it on: layer_relay)",
    "qwen2_moe": "with its sliding layers' window handed to them (its attention does not pass it on: layer_relay)",
    "minimax_m3_vl_text": (
        "while no layer is 'minimax_m3_sparse' (its default): an indexer's block-sparse layer is refused at build"
    ),
    "deepseek_v4": (
        "with attention sinks (every backend; not under parallel.cp) while every layer is 'sliding_attention': its "
        "compressed layers (its default and released configs) are refused at build"
    ),
    **dict.fromkeys(
        ("gpt_oss", "flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash"),
        "with attention sinks on every backend (trainer.model.sinks; torch_varlen where its varlen_attn returns the "
        "log-sum-exp), not under parallel.cp",
    ),
    **dict.fromkeys(
        ("dory", "gemma3n_text"),
        (
            "while no example starts with a token whose embedding row is zero: with a pad token (padding_idx, a zero "
            "row at random init) the replica refuses it, its own gradients are NaN there, packed or not"
        ),
    ),
}
"""Exact families whose verdict depends on the config: the condition (the certification's replica and
self-check stages, or its prior's ``selected_keys``, enforce it per config)."""

EXACT_FROM: dict[str, tuple[str, str]] = {
    "cohere_compass_text": ("5.25", "the tiny probe cannot build its 3-D rope on older transformers: not probed there"),
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
    **_reasons(NO_INTERFACE, "bloom", "cpmant", "falcon", "gpt_neo", "gpt_neox_japanese", "mpt", "openai-gpt", "xglm"),
    **_reasons(DROPS_KWARGS, "blt", "inkling2_text", "inkling2_loop_text"),
    **_reasons(HUB_KERNEL, "rwkv"),
    **_reasons(ROW_POSITIONS, "inkling_text"),
    **_reasons(
        INDEXER,
        "axk2",
        "deepseek_v32",
        "dots3_note_text",
        "glm_moe_dsa",
        "hy_v4",
        "hy_v4_vl",
        "kolibri1_1",
        "qwen4_exp_text",
    ),
    **_reasons(OWN_MASK, "doge"),
}
"""Would crash or train wrong when packed: ``build_model`` refuses them with the reason."""

SKIPPED: dict[str, str] = {
    **_reasons(
        NOT_CAUSAL,
        "bert",
        "bert-generation",
        "big_bird",
        "camembert",
        "data2vec-text",
        "electra",
        "ernie",
        "megatron-bert",
        "openai_privacy_filter",
        "reformer",
        "rembert",
        "roberta",
        "roberta-prelayernorm",
        "roc_bert",
        "roformer",
        "xlm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "xlnet",
        "xmod",
    ),
    **_reasons(
        ENCODER_DECODER,
        "bart",
        "bigbird_pegasus",
        "blenderbot",
        "blenderbot-small",
        "marian",
        "mbart",
        "musicgen",
        "musicgen_melody",
        "mvp",
        "pegasus",
        "plbart",
        "prophetnet",
        "trocr",
    ),
    **_reasons(ASSISTANT, "gemma4_assistant", "gemma4_unified_assistant"),
}
"""Not decoder-only causal LMs (refused the same way, with the reason). A multimodal family (transformers'
multimodal-LM mapping) takes its text family's verdict or is skipped, with why (``multimodal_verdict``)."""

NOT_PROBED: frozenset[str] = frozenset()
"""Families of ``TESTED_WITH`` the tiny probe could not build: untested, so the replica and the startup
self-check decide (none left; a family newer than the table is untested the same way)."""


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
    if (routed := multimodal_verdict(family)) is not None:
        return routed
    if family in NOT_PROBED:
        return Verdict(family, "untested", "the tiny probe could not build it: the replica and the self-check decide")
    return Verdict(family, "untested")


def multimodal_verdict(family: str) -> Verdict | None:
    """A multimodal family's verdict: its language model's text family's (``trainer.model.multimodal`` trains
    it as that family's causal LM; a folder's text config decides, the default config's is reported here),
    or skipped where it has none. ``None`` for a family outside transformers' multimodal-LM mapping."""
    if family not in MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES:
        return None
    if (text := text_family(family)) is not None:
        return Verdict(family, verdict(text).kind, MULTIMODAL_ROUTE)
    try:
        config = AutoConfig.for_model(family)
    except (ValueError, TypeError, KeyError) as e:  # one that needs its parts given (vision-encoder-decoder)
        return Verdict(family, "skipped", f"a multimodal model without a default config ({type(e).__name__})")
    if config.is_encoder_decoder:
        return Verdict(family, "skipped", ENCODER_DECODER)
    inner = config.get_text_config(decoder=True)
    return Verdict(
        family, "skipped", MULTIMODAL_FLAT if inner is config else MULTIMODAL_NO_LM.format(text=inner.model_type)
    )


def text_family(family: str) -> str | None:
    """The text family a multimodal family's language model trains as, in its default config (a folder's
    own text config decides for the folder), or ``None`` for any other family."""
    if family not in MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES:
        return None
    try:
        text = language_model_config(AutoConfig.for_model(family))
    except (ValueError, TypeError, KeyError):
        return None
    return text.model_type if text is not None else None


def has_causal_lm(config) -> bool:
    """transformers (or the model's own code, ``auto_map``) has a causal-LM class for ``config``."""
    auto_map = getattr(config, "auto_map", None) or {}
    return (
        getattr(config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or "AutoModelForCausalLM" in auto_map
    )


def _installed() -> str:
    return transformers.__version__


def _older_than(version: str) -> bool:
    """The installed transformers is older than ``version``."""
    return Version(_installed()) < Version(version)


def selected_keys(config) -> str | None:
    """Why ``config`` cannot be packed for a layer type of ``SELECTING_LAYERS`` in its ``layer_types`` (the
    keys an indexer selects or a compressor pools), or ``None``."""
    for kind in dict.fromkeys(getattr(config, "layer_types", None) or []):
        if kind in SELECTING_LAYERS:
            what = SELECTING_LAYERS[kind].format_map({k: getattr(config, k, "?") for k in _SELECTION_SIZES})
            return (
                f"its {kind!r} layers {what}: no packed backend implements that (made over a packed row, it "
                "would reach other examples' keys)"
            )
    return None


_SELECTION_SIZES = ("index_topk", "index_block_size", "index_topk_blocks", "index_local_blocks")


__all__ = [
    "EXACT",
    "EXACT_FROM",
    "EXACT_IF",
    "NOT_PROBED",
    "REFUSED",
    "SKIPPED",
    "TESTED_WITH",
    "FamilyRefusedError",
    "Verdict",
    "has_causal_lm",
    "selected_keys",
    "text_family",
    "verdict",
]
