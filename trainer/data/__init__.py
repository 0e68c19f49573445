"""Stage 1 of the data flow: sources -> tokenizer -> tokenized examples with loss masks."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from trainer.config import ConfigError, DataConfig, ModelConfig
from trainer.data.dataset import DatasetStats, TokenizedDataset, log_dataset_stats
from trainer.data.engine import build_dataset
from trainer.data.mixture import component_name, mix, mix_components
from trainer.data.chat import CHATML_SPECIAL_TOKENS, DEFAULT_CHAT_TEMPLATE, apply_template_setting, template_fingerprint
from trainer.data.sources import SOURCES, check_source, load_records, plugin_path, register_source
from trainer.data.tokenizer import local_tokenizer, pretrained_tokenizer
from trainer.library_errors import library_load

log = logging.getLogger(__name__)

STREAM_SETTINGS = ("streaming", "stream_buffer", "stream_eval_records")
"""``DataConfig`` fields that say how records are read (``trainer.data.streaming``), not which."""


def source_fingerprint(cfg: DataConfig) -> str:
    """What the records depend on: the config and, for local files and plugin modules, their size and
    modification time (an edited file or source function re-tokenizes)."""
    check_source(cfg)
    parts = asdict(cfg) | {"cache_dir": None, "num_proc": None}  # neither changes the records
    for key in STREAM_SETTINGS:  # how the records are read, not which: cached datasets keep their key
        parts.pop(key)
    files: list[Path] = [plugin_path(p) for p in cfg.plugins]
    if cfg.path and Path(cfg.path).expanduser().exists():
        p = Path(cfg.path).expanduser()
        files += sorted(p.rglob("*")) if p.is_dir() else [p]
    parts["files"] = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return json.dumps(parts, sort_keys=True, default=str)


def record_texts(record: dict) -> list[str]:
    """The raw text of a record of any kind (what the local BPE tokenizer is trained on)."""
    if "messages" in record:
        messages = [m for m in record["messages"] or [] if isinstance(m, dict)]
        return [str(m.get(k) or "") for m in messages for k in ("role", "content")]
    if "turns" in record:
        return [t for t in record["turns"] or [] if isinstance(t, str)]
    text = record.get("text")
    return [text] if isinstance(text, str) else []


def pretokenized_refused(records: list[dict]) -> list[dict]:
    """``records``, unless they are pre-tokenized: their ids belong to the tokenizer that made them, and a
    tokenizer trained here would read them as other tokens."""
    if records and isinstance(records[0], dict) and "input_ids" in records[0]:
        raise ConfigError(
            "the data is pre-tokenized (input_ids) but model.tokenizer=local_bpe would train a new tokenizer; "
            "name the tokenizer the ids came from: model.tokenizer=DIR_OR_HUB_ID (or load its model: model=hf "
            "model.name_or_path=...)"
        )
    return records


BPE_SAMPLE_RECORDS = 100_000
"""The local BPE is trained on at most this many records per source, spread evenly over it (``sample_records``):
enough for a small vocabulary, and preparing 1M records never holds them all."""


def bpe_sample(cfg: DataConfig) -> Iterator[dict]:
    """The records the local BPE is trained on; pre-tokenized data is refused (see ``pretokenized_refused``)."""
    from trainer.data.sources_arrow import sample_records

    records = sample_records(cfg, BPE_SAMPLE_RECORDS)
    first = next(records, None)
    if first is not None:
        pretokenized_refused([first])
        yield first
        yield from records


def load_tokenizer(model_cfg: ModelConfig, data_cfg: DataConfig) -> PreTrainedTokenizerBase:
    """The pretrained tokenizer named by the model config, or the local BPE trained on the data (cached).

    ``model.chat_template``, when set, replaces the tokenizer's chat template.
    """
    name = model_cfg.tokenizer_name()
    if name == "local_bpe":
        components = [c for c, _ in mix_components(data_cfg)]
        texts = lambda: (t for c in components for r in bpe_sample(c) for t in record_texts(r))  # noqa: E731
        extra = CHATML_SPECIAL_TOKENS if model_cfg.chat_template == "chatml" else []
        key = "".join(source_fingerprint(c) for c in components) + f"|sample {BPE_SAMPLE_RECORDS}"
        tokenizer = local_tokenizer(texts, model_cfg.tokenizer_vocab_size, data_cfg.cache_dir, key, extra)
    else:
        with library_load(f"the tokenizer {name}"):
            tokenizer = pretrained_tokenizer(name, model_cfg.trust_remote_code)
    apply_template_setting(tokenizer, model_cfg.chat_template)
    return tokenizer


def load_dataset(data_cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, max_length: int) -> TokenizedDataset:
    """The tokenized examples, memory-mapped from the cache (sources are read only on a cache miss; see
    ``trainer.data.engine``), with skips logged; with ``data.mix``, the mixture of its sources."""
    tokenizer_id = json.dumps([tokenizer.name_or_path, len(tokenizer), template_fingerprint(tokenizer)])
    components = mix_components(data_cfg)
    datasets = []
    for cfg, _ in components:
        datasets.append(build_dataset(tokenizer, cfg, max_length, source_fingerprint(cfg) + tokenizer_id))
        log_dataset_stats(component_name(cfg) if data_cfg.mix else cfg.source, datasets[-1].stats)
    if not data_cfg.mix:
        return datasets[0]
    mixture = mix(datasets, [w for _, w in components], data_cfg.mix_by, data_cfg.seed,
                  [component_name(c) for c, _ in components])
    for share in mixture.shares():
        log.info("data mix: %s: %d examples (%d unique), %.1f%% of examples, %.1f%% of tokens", share["source"],
                 share["examples"], share["unique_examples"], 100 * share["example_share"], 100 * share["token_share"])
    return mixture


__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "DatasetStats",
    "SOURCES",
    "TokenizedDataset",
    "load_dataset",
    "load_records",
    "load_tokenizer",
    "register_source",
    "source_fingerprint",
]
