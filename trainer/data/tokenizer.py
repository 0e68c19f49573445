"""Tokenizers: a byte-level BPE trained locally (the offline default) or any pretrained one (``load_tokenizer``).

The local tokenizer is trained once with ``tokenizers`` on the source's text, saved in the
``save_pretrained`` layout under the cache directory keyed by a hash of what it was trained on, and loaded
from there afterwards. It uses GPT-2's conventions: byte-level pre-tokenisation and one special token,
``<|endoftext|>``, which serves as BOS, EOS, turn separator and pad.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from trainer.config import ConfigError, DataConfig, ModelConfig
from trainer.data.bad_records import BadRecords, record_bytes
from trainer.data.cache_integrity import build_lock, intact, seal_folder
from trainer.data.chat import CHATML_SPECIAL_TOKENS, apply_template_setting
from trainer.data.mixture import mix_components
from trainer.data.parts import is_table, source_parts
from trainer.data.sources import source_fingerprint
from trainer.data.tables import Row, mapped_columns_only, rows_to_records
from trainer.distributed import on_rank0_then_all
from trainer.library_log import library_load

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, extra_special_tokens: list[str] | None = None
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (``extra_special_tokens``: e.g. ChatML's markers)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, *(extra_special_tokens or [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        additional_special_tokens=list(extra_special_tokens or []),
    )


def local_tokenizer(
    texts: Callable[[], Iterable[str]],
    vocab_size: int,
    cache_dir: str | Path,
    cache_key: str,
    extra_special_tokens: list[str] | None = None,
) -> PreTrainedTokenizerBase:
    """Load the cached local tokenizer for ``cache_key``, training (on rank 0) and caching it first if needed.

    ``texts`` is called only on a cache miss and may be an iterator (the texts are streamed into the
    trainer, never held together); ``cache_key`` names what the texts are (source, seed, size, sample) and,
    with the vocab size, selects the cache entry.
    """
    key = [cache_key, vocab_size] + ([extra_special_tokens] if extra_special_tokens else [])
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    path = Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{digest}"

    def train_into_cache() -> None:
        with build_lock(path):  # two jobs at once: one trains, the other waits and reuses it
            if intact(path, "tokenizer"):  # its files as its training wrote them, nothing added
                return
            log.info("training a byte-level BPE tokenizer (vocab %d)", vocab_size)
            tokenizer = train_bpe_tokenizer(texts(), vocab_size, extra_special_tokens)
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tokenizer.save_pretrained(tmp)
            seal_folder(tmp)
            shutil.rmtree(path, ignore_errors=True)  # an incomplete or damaged one
            tmp.rename(path)  # atomic: a half-written tokenizer is never picked up

    on_rank0_then_all(train_into_cache)  # a bad data path fails on every rank, not only on rank 0
    return AutoTokenizer.from_pretrained(path)


def pretrained_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A pretrained tokenizer from the hub or a local directory; gives it a pad token if it has none."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no EOS token; packfsdp needs one as turn separator")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def record_texts(record: dict) -> list[str]:
    """The raw text of a record of any kind (what the local BPE tokenizer is trained on)."""
    if "chosen" in record:  # a preference pair: each field a string or a list of messages
        return [t for f in ("prompt", "chosen", "rejected") for t in record_texts(_as_record(record.get(f)))]
    if "messages" in record:
        messages = [m for m in record["messages"] or [] if isinstance(m, dict)]
        return [str(m.get(k) or "") for m in messages for k in ("role", "content")]
    if "turns" in record:
        return [t for t in record["turns"] or [] if isinstance(t, str)]
    text = record.get("text")
    return [text] if isinstance(text, str) else []


def _as_record(value) -> dict:
    return {"text": value} if isinstance(value, str) else {"messages": value if isinstance(value, list) else []}


def pretokenized_refused(records: list[dict]) -> list[dict]:
    """``records``, unless they are pre-tokenized: their ids belong to the tokenizer that made them, and a
    tokenizer trained here would read them as other tokens."""
    if records and isinstance(records[0], dict) and ("input_ids" in records[0] or "chosen_input_ids" in records[0]):
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
    """The records the local BPE is trained on; pre-tokenized data is refused (see ``pretokenized_refused``),
    a record over ``data.max_record_bytes`` left out (counted in the log; the data cache counts it again)."""
    oversized = 0
    for k, record in enumerate(sample_records(cfg, BPE_SAMPLE_RECORDS)):
        if k == 0:
            pretokenized_refused([record])
        if record_bytes(record) > cfg.max_record_bytes:
            oversized += 1
            continue
        yield record
    if oversized:
        log.warning(
            "data %s: %d record(s) over data.max_record_bytes=%d left out of the tokenizer's sample",
            cfg.source,
            oversized,
            cfg.max_record_bytes,
        )


def load_tokenizer(model_cfg: ModelConfig, data_cfg: DataConfig) -> PreTrainedTokenizerBase:
    """The pretrained tokenizer named by the model config, or the local BPE trained on the data (cached).

    ``model.chat_template``, when set, replaces the tokenizer's chat template.
    """
    name = model_cfg.tokenizer_name()
    if name == "local_bpe":
        components = [c for c, _ in mix_components(data_cfg)]

        def texts():
            return (t for c in components for r in bpe_sample(c) for t in record_texts(r))

        extra = CHATML_SPECIAL_TOKENS if model_cfg.chat_template == "chatml" else []
        key = "".join(source_fingerprint(c) for c in components) + f"|sample {BPE_SAMPLE_RECORDS}"
        tokenizer = local_tokenizer(texts, model_cfg.tokenizer_vocab_size, data_cfg.cache_dir, key, extra)
    else:
        with library_load(f"the tokenizer {name}"):
            tokenizer = pretrained_tokenizer(name, model_cfg.trust_remote_code)
    apply_template_setting(tokenizer, model_cfg.chat_template)
    return tokenizer


def sample_records(cfg: DataConfig, n: int) -> Iterator[dict]:
    """Up to ``n`` records spread evenly over the source (its first ``data.limit``), in order: what the local
    BPE tokenizer is trained on, through the one dispatcher. Table files are read through ``datasets``
    (memory-mapped; the cache's ``map`` reuses that copy), so only the sampled rows become Python records."""
    bad = BadRecords(cfg.on_bad_record, cfg.source)
    parts = [(p, p.open()) for p in source_parts(cfg, bad)]
    parts = [(p, opened) for p, opened in parts if opened is not None]
    sizes = np.array([len(opened) for _, opened in parts], dtype=np.int64)
    if cfg.limit is not None:  # the first ``limit`` records of the parts, in order
        sizes = np.diff(np.minimum(np.concatenate([[0], np.cumsum(sizes)]), cfg.limit))
    total = int(sizes.sum())
    picked = np.unique(np.linspace(0, total - 1, min(n, total)).astype(np.int64)) if total else np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for k, (_, part) in enumerate(parts):
        rows = (picked[(picked >= starts[k]) & (picked < starts[k + 1])] - starts[k]).tolist()
        if not rows:
            continue
        if is_table(part):
            ds = mapped_columns_only(part, cfg).select(rows)
            yield from rows_to_records([Row(r) for r in ds], cfg, bad)
        else:
            yield from (part[i] for i in rows)
