"""Stage 1 of the data flow: sources -> tokenizer -> tokenized examples with loss masks."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from trainer.config import DataConfig, ModelConfig
from trainer.data.dataset import DatasetStats, TokenizedDataset, build_dataset, log_dataset_stats
from trainer.data.sources import SOURCES, load_records, register_source
from trainer.data.tokenizer import local_tokenizer, pretrained_tokenizer


def source_fingerprint(cfg: DataConfig) -> str:
    """What the records depend on: the config and, for local files, their size and modification time."""
    parts = asdict(cfg) | {"cache_dir": None}
    if cfg.path and Path(cfg.path).expanduser().exists():
        p = Path(cfg.path).expanduser()
        files = sorted(p.rglob("*")) if p.is_dir() else [p]
        parts["files"] = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return json.dumps(parts, sort_keys=True, default=str)


def load_tokenizer(model_cfg: ModelConfig, data_cfg: DataConfig) -> PreTrainedTokenizerBase:
    """The pretrained tokenizer named by the model config, or the local BPE trained on the data (cached)."""
    if model_cfg.tokenizer == "local_bpe":
        records = functools.cache(lambda: load_records(data_cfg))
        texts = lambda: [t for r in records() for t in r.get("turns", [])]  # noqa: E731
        return local_tokenizer(texts, model_cfg.tokenizer_vocab_size, data_cfg.cache_dir, source_fingerprint(data_cfg))
    name = model_cfg.tokenizer or model_cfg.name_or_path
    if name is None:
        raise ValueError("model.tokenizer is null and model.name_or_path is null: name a tokenizer")
    return pretrained_tokenizer(name, model_cfg.trust_remote_code)


def load_dataset(data_cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, max_length: int) -> TokenizedDataset:
    """The tokenized examples (cached; records are read only on a cache miss), with skips logged."""
    tokenizer_id = json.dumps([tokenizer.name_or_path, len(tokenizer)])
    dataset = build_dataset(
        lambda: load_records(data_cfg), tokenizer, data_cfg, max_length, source_fingerprint(data_cfg) + tokenizer_id
    )
    log_dataset_stats(data_cfg.source, dataset.stats)
    return dataset


__all__ = [
    "DatasetStats",
    "SOURCES",
    "TokenizedDataset",
    "load_dataset",
    "load_records",
    "load_tokenizer",
    "register_source",
    "source_fingerprint",
]
