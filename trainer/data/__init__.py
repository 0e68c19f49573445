"""Stage 1 of the data flow: a source's records -> tokenized examples with loss masks, by one route.

    data.source ──► parts.py      the one dispatcher: the source's parts (a table file per part through
                                  ``datasets``, the line readers of tables.py / sources.py as its fallback,
                                  ``hf``, or any registered source, plugins included)
                ──► tables.py     rows -> records (column mapping)
                ──► render.py     chunks of records -> rendered examples with their outcomes (chat.py,
                                  pretokenized.py); ``stats_of`` counts the outcomes, the one place
                ──► cache.py      sink 1: memory-mapped arrays (arrays.py), built once, mapped by every rank
                 or stream.py     sink 2: rendered on the fly, packed online (``trainer.packing.online``)
                ──► holdout.py    the held-out split, the same on both sinks; mixture.py mixes sources

``examples.py`` holds what comes out (``TokenizedDataset``, ``DatasetStats``); ``tokenizer.py`` the tokenizer,
trained on a sample read through the same dispatcher; ``sources.py`` the registry of sources and their
fingerprint (the cache key); ``bad_records.py`` the error-or-counted-skip of every bad row.
"""

from __future__ import annotations

import json
import logging

from transformers import PreTrainedTokenizerBase

from trainer.config import DataConfig
from trainer.data.cache import build_dataset
from trainer.data.chat import DEFAULT_CHAT_TEMPLATE, template_fingerprint
from trainer.data.examples import DatasetStats, TokenizedDataset, log_dataset_stats
from trainer.data.mixture import component_name, mix, mix_components
from trainer.data.sources import SOURCES, load_records, register_source, source_fingerprint
from trainer.data.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def load_dataset(data_cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, max_length: int) -> TokenizedDataset:
    """The tokenized examples, memory-mapped from the cache (sources are read only on a cache miss; see
    ``trainer.data.cache``), with skips logged; with ``data.mixture.sources``, the mixture of its sources."""
    tokenizer_id = json.dumps([tokenizer.name_or_path, len(tokenizer), template_fingerprint(tokenizer)])
    components = mix_components(data_cfg)
    datasets = []
    for cfg, _ in components:
        datasets.append(build_dataset(tokenizer, cfg, max_length, source_fingerprint(cfg) + tokenizer_id))
        log_dataset_stats(component_name(cfg) if data_cfg.mixture.sources else cfg.source, datasets[-1].stats)
    if not data_cfg.mixture.sources:
        return datasets[0]
    mixture = mix(
        datasets,
        [w for _, w in components],
        data_cfg.mixture.by,
        data_cfg.seed,
        [component_name(c) for c, _ in components],
    )
    for share in mixture.shares():
        log.info(
            "data mix: %s: %d examples (%d unique), %.1f%% of examples, %.1f%% of tokens",
            share["source"],
            share["examples"],
            share["unique_examples"],
            100 * share["example_share"],
            100 * share["token_share"],
        )
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
