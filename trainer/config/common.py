"""What every config section shares: the choice lists that validation reads without importing torch, the
error every bad value raises, and the two checks most fields use (``ConfigError`` itself lives in the leaf
``trainer.errors``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError  # the leaf every stage imports; re-exported by trainer.config

ATTENTION_BACKENDS = ("flash_attn", "torch_varlen", "flex", "sdpa_varlen", "sdpa_block_mask")
"""The packed attention backends ``model.attention`` may name besides ``auto``, in the order ``auto`` tries
them (fastest first). ``trainer.model.attention.BACKENDS`` registers exactly these; the names live here so
that validating a config never imports torch."""

CODE_OPTIONS = {"data.plugins": "PACKFSDP_PLUGINS", "model.trust_remote_code": "PACKFSDP_TRUST_REMOTE_CODE"}
"""Options that import user or remote code, and the environment variable that may set each instead of the
command line (a config file may not: ``trainer.cli.check_code_sources``). ``PACKFSDP_PLUGINS`` is a
comma-separated list added to ``data.plugins``; ``PACKFSDP_TRUST_REMOTE_CODE=1`` sets the flag."""

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The dtypes ``model.dtype`` and ``parallel.*_dtype`` may name (``trainer.model.loading.DTYPES`` maps them to
torch's; the names live here so that validating a config never imports torch)."""

LOSS_IMPLS = ("chunked", "naive")
"""``loss.impl`` choices (``trainer.loss``): the LM head fused with the cross-entropy in chunks of tokens, or
the model's full logits then cross-entropy."""


@dataclass(frozen=True)
class StrategyKind:
    """What a packing strategy's micro-batches are, as config validation and every stage need to know it."""

    padded: bool = False
    """Micro-batches are padded rectangles (``collate_padded``) rather than flat varlen rows."""
    splits: bool = False
    """May cut an example into pieces (needs ``budget >= 2``; never drops over-long examples)."""

    @property
    def min_budget(self) -> int:
        """The smallest token budget it can pack into: a piece needs a labelled token besides its overlap token."""
        return 2 if self.splits else 1


PACKING_STRATEGIES = {
    "none": StrategyKind(padded=True),
    "sorted": StrategyKind(padded=True),
    "ffd": StrategyKind(),
    "bfd": StrategyKind(),
    "bfd_split": StrategyKind(splits=True),
    "wrapped": StrategyKind(splits=True),
}
"""``packing.strategy`` choices and what each packs (``trainer.packing.strategies`` implements exactly these)."""

WORK_MEASURES = ("flops", "tokens", "attention")
"""``packing.balance`` choices: what ranks can be balanced on (``trainer.packing.balance.work_measure``): the work
of each sequence from its length: model FLOPs (``TokenCost``), tokens, or attention (length^2)."""

CP_SPLITS = ("contiguous", "balanced")
"""``parallel.cp_split`` choices: how a row is cut over a context-parallel group (``trainer.parallel.cp_layout``
implements exactly these; the names live here so that validating a config never imports torch)."""

CONTEXT_KEYS = ("n_positions", "max_position_embeddings")
"""Where a transformers config states the model's context length (GPT-2 names it ``n_positions``)."""


def stated_context(config: Any) -> int | None:
    """The context length a transformers config states, or ``None``. ``config`` is a transformers config
    (of a built model, or read without weights) or a plain dict of its fields (``ModelConfig.init_fields``)."""
    for key in CONTEXT_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value:
            return int(value)
    return None


LOCAL_PATH_PREFIXES = ("/", "./", "../", "~")
"""A ``name_or_path`` starting so is a local folder (a hub id never does), checked to exist at once."""


GENERATED_SOURCES = ("dailydialog_synthetic", "chat_synthetic", "reasoning_synthetic", "preference_synthetic")
"""The sources ``trainer.data.sources`` generates offline (``generated_source`` registers exactly these; small:
the local BPE may train on them even when they are streamed)."""


RENAMED_KEYS: dict[str, str] = {
    "data.num_dialogs": "data.num_records",  # it sizes the generated chats as well as the dialogs
    "data.streaming": "data.stream.enabled",
    "data.stream_buffer": "data.stream.buffer",
    "data.stream_eval_records": "data.stream.eval_records",
    "data.mix": "data.mixture.sources",
    "data.mix_by": "data.mixture.by",
}
"""Keys that were renamed: old -> new. The old name is refused in one line naming the new one, and a
checkpoint's saved config is read under the new names (``trainer.checkpoint.config_check``)."""

REMOVED_KEYS: dict[str, str] = {
    "packing.oversize": "training never let it act (every example is cut to data.max_length and a strategy "
    "that packs whole examples needs packing.token_budget >= data.max_length, checked at build); drop the key "
    "(data.overlong decides what happens to a long example)",
}
"""Keys that were removed, each with why and what to do instead."""


def retired_key(key: str) -> str | None:
    """The one line for a key the schema no longer has (renamed or removed), ``None`` for one it never had."""
    key = key.lstrip("+~")
    if key in RENAMED_KEYS:
        return f"{key} is now {RENAMED_KEYS[key]}; set that instead"
    return f"{key}: removed: {REMOVED_KEYS[key]}" if key in REMOVED_KEYS else None


def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(choices)}")


def check_positive(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{key} must be a positive number, got {value!r}")


def check_folder(key: str, value: str) -> None:
    """``value`` is a folder, or can become one: neither it nor a parent is a file (``NotADirectoryError``
    deep inside the tokenizer or data cache, otherwise)."""
    path = Path(value).expanduser()
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == path else f"is inside {p}, a file"
                raise ConfigError(f"{key}={value} {what}, not a folder: point it at a folder (or at none yet)")
            return


MAX_SETTING = 1e15
"""No number a setting takes is larger (seconds, minutes, rates, sizes): a bigger one is a typo or an attack,
and breaks a timer, an allocation or a float cast far from the config."""


def check_finite_settings(settings: Any, key: str = "") -> None:
    """Every number under a config (dataclass fields, and the dicts and lists inside them: optimizer kwargs,
    ``config_overrides``) is finite and at most ``MAX_SETTING`` in size; refused in one line naming the key.
    Generic on purpose: a new float field is covered without being listed."""
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        items = [(f.name, getattr(settings, f.name)) for f in dataclasses.fields(settings)]
    elif isinstance(settings, dict):
        items = list(settings.items())
    elif isinstance(settings, (list, tuple)):
        items = list(enumerate(settings))
    else:
        if isinstance(settings, (int, float)) and not isinstance(settings, bool):
            if not math.isfinite(settings):
                raise ConfigError(f"{key}={settings} is not a finite number; give a finite value")
            if abs(settings) > MAX_SETTING:
                raise ConfigError(f"{key}={settings} is out of range (at most {MAX_SETTING:g} in size)")
        return
    for name, value in items:
        check_finite_settings(value, f"{key}.{name}" if key else str(name))
