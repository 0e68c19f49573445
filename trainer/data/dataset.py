"""Tokenized examples with loss masks, stored flat (one token array, one mask array, offsets).

A record is a dialog (``turns``), a chat (``messages``, rendered with the chat template, loss on the
assistant's replies by default) or a plain document (``text``); see ``record_segments``. The mask is
aligned with ``input_ids`` (the model shifts), so a token's mask says "this token is predicted". The first
token of an example never carries loss: nothing before it belongs to the same example.

Bad input is never dropped silently: empty dialogs, over-long examples (truncated or dropped, by config)
and examples left with no loss token are counted in ``DatasetStats`` and logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from trainer.config import DataConfig
from trainer.data.bad_records import BadRecords
from trainer.data.chat import ChatTemplateError, Segment, chat_segments, check_messages, effective_template
from trainer.data.pretokenized import token_segments
from trainer.data.sources import Record
from trainer.distributed import on_rank0_then_all

log = logging.getLogger(__name__)

RENDER_VERSION = 2
"""Bumped whenever rendering changes, so stale cached datasets are never reused."""


@dataclass
class DatasetStats:
    records: int = 0
    examples: int = 0
    dropped_empty: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_no_labels: int = 0
    dropped_bad: int = 0
    """Malformed lines/records/files left out under ``data.on_bad_record=skip``."""
    tokens: int = 0
    label_tokens: int = 0

    def skipped(self) -> int:
        return self.dropped_empty + self.dropped_overlong + self.dropped_no_labels + self.dropped_bad


@dataclass
class TokenizedDataset:
    tokens: np.ndarray
    """All examples' token ids, concatenated (int32)."""
    loss_mask: np.ndarray
    """Per token: does it carry loss (bool, aligned with ``tokens``)."""
    offsets: np.ndarray
    """Example ``i`` is ``tokens[offsets[i]:offsets[i + 1]]`` (int64, length n + 1)."""
    stats: DatasetStats = field(default_factory=DatasetStats)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def label_counts(self) -> np.ndarray:
        """Loss-carrying tokens per example (the first token of each example never counts)."""
        cum = np.concatenate([[0], np.cumsum(self.loss_mask, dtype=np.int64)])
        starts = self.offsets[:-1]
        return cum[self.offsets[1:]] - cum[starts + 1]

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.tokens[lo:hi], self.loss_mask[lo:hi]


def record_segments(
    record: Record, tokenizer: PreTrainedTokenizerBase, loss_on: str, template: str, where: str
) -> list[Segment] | None:
    """The pieces of one record (``None`` when it has no content). Four kinds of record:

    - ``{"turns": [...]}`` (a dialog): ``BOS t1 EOS t2 EOS ...``; ``responses`` puts loss on turns 2, 4, ...
      and their EOS, ``all``/``auto`` on every turn;
    - ``{"messages": [...]}`` (a chat): rendered with the chat template (``trainer.data.chat``);
      ``auto``/``responses`` puts loss on the assistant messages only, ``all`` on everything;
    - ``{"text": "..."}`` (a plain document): ``BOS text EOS``, loss on every token;
    - ``{"input_ids": [...], "labels": [...]}`` (pre-tokenized, ``trainer.data.pretokenized``): the ids as
      they are, loss where the labels (or a ``loss_mask``) say.
    """
    if "input_ids" in record:
        return token_segments(record, len(tokenizer), loss_on, where)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    if "messages" in record:
        messages = check_messages(record["messages"], where)
        if not any(m["content"].strip() for m in messages):
            return None
        return chat_segments(messages, tokenizer, template, loss_on)
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: 'turns' must be a list of strings")
        if not any(t.strip() for t in turns):
            return None
        segments = [Segment([bos], False)]
        for k, turn in enumerate(turns):
            carries = loss_on != "responses" or k % 2 == 1
            segments += [Segment(turn, carries), Segment([eos], carries)]
        return segments
    if "text" in record:
        text = record["text"]
        if text is None or (isinstance(text, str) and not text.strip()):
            return None
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'text' must be a string, got {type(text).__name__}")
        return [Segment([bos], False), Segment(text, True), Segment([eos], True)]
    raise ValueError(
        f"{where}: a record needs 'messages', 'turns', 'text' or 'input_ids' (keys: {', '.join(map(str, record))})"
    )


def render_records(
    records: list[Record], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, max_length: int
) -> TokenizedDataset:
    """Tokenize records into examples with loss masks, applying the over-length and empty rules.

    Every text piece of every record is tokenized in one batched call (fast tokenizers parallelise it).
    """
    stats = DatasetStats(records=len(records))
    per_record, stats.dropped_bad = _record_segments_or_skip(records, tokenizer, cfg)
    texts = [s.text for segs in per_record if segs for s in segs if isinstance(s.text, str)]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    examples = []
    for segments in per_record:
        if segments is None:
            stats.dropped_empty += 1
            continue
        example = _fit_example(segments, encoded, cfg.overlong, max_length, stats)
        if example is not None:
            examples.append(example)
    return _flat_dataset(examples, stats)


def _record_segments_or_skip(
    records: list[Record], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig
) -> tuple[list[list[Segment] | None], int]:
    """Every good record's segments (``None``: no content) and the number of bad records skipped (under
    ``on_bad_record=skip``; ``error`` raises naming the record)."""
    template = effective_template(tokenizer)
    bad = BadRecords(cfg.on_bad_record, cfg.source)
    per_record = []
    for i, record in enumerate(records):
        where = getattr(record, "where", "") or f"data.source={cfg.source} record {i}"
        if not isinstance(record, dict):
            bad.bad(where, f"a {type(record).__name__}, not a dict")
            continue
        try:
            per_record.append(record_segments(record, tokenizer, cfg.loss_on, template, where))
        except ValueError as e:
            if isinstance(e, ChatTemplateError):  # the template, not the record, is wrong: always an error
                raise
            bad.bad(where, str(e).removeprefix(f"{where}: "))
    bad.finish([])
    return per_record, getattr(records, "skipped_bad", 0) + bad.skipped


def _fit_example(
    segments: list[Segment], encoded, overlong: str, max_length: int, stats: DatasetStats
) -> tuple[list[int], list[bool]] | None:
    """One example's tokens and loss mask (text segments take their ids from ``encoded`` in order),
    truncated to ``max_length`` or dropped per ``overlong``; ``None`` (counted) when dropped."""
    ids: list[int] = []
    mask: list[bool] = []
    for s in segments:
        piece = next(encoded) if isinstance(s.text, str) else s.text
        ids += piece
        mask += [s.loss] * len(piece)
    if len(ids) > max_length:
        if overlong == "drop":
            stats.dropped_overlong += 1
            return None
        stats.truncated += 1
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask[1:]):
        stats.dropped_no_labels += 1
        return None
    return ids, mask


def _flat_dataset(examples: list[tuple[list[int], list[bool]]], stats: DatasetStats) -> TokenizedDataset:
    """The examples stored flat, with the kept counts filled into ``stats``."""
    offsets = np.zeros(len(examples) + 1, dtype=np.int64)
    np.cumsum([len(ids) for ids, _ in examples], out=offsets[1:])
    ds = TokenizedDataset(
        tokens=np.concatenate([np.asarray(ids, dtype=np.int32) for ids, _ in examples] or [np.zeros(0, np.int32)]),
        loss_mask=np.concatenate([np.asarray(mask, dtype=bool) for _, mask in examples] or [np.zeros(0, bool)]),
        offsets=offsets,
        stats=stats,
    )
    stats.examples = len(ds)
    stats.tokens = int(offsets[-1])
    stats.label_tokens = int(ds.label_counts().sum()) if len(ds) else 0
    return ds


def log_dataset_stats(name: str, stats: DatasetStats) -> None:
    """Log what was kept and, loudly, what was skipped or truncated."""
    log.info(
        "data %s: %d records -> %d examples, %d tokens, %d label tokens",
        name, stats.records, stats.examples, stats.tokens, stats.label_tokens,
    )
    if stats.skipped() or stats.truncated:
        log.warning(
            "data %s: skipped %d empty, %d over-long, %d with no label token, %d bad; truncated %d over-long",
            name, stats.dropped_empty, stats.dropped_overlong, stats.dropped_no_labels, stats.dropped_bad,
            stats.truncated,
        )


def build_dataset(
    records_fn, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, max_length: int, cache_key: str
) -> TokenizedDataset:
    """Tokenize once (rank 0) into the cache (an ``.npz`` file), then every rank loads its own copy of the
    arrays from it (``np.load`` of an ``.npz`` reads them into memory; it does not memory-map).

    ``records_fn`` is called only when the cache misses; ``cache_key`` must name everything the result
    depends on besides ``cfg`` and ``max_length`` (the source's identity, the tokenizer).
    """
    key = json.dumps(
        [RENDER_VERSION, cache_key, asdict(cfg) | {"cache_dir": None}, max_length], sort_keys=True, default=str
    )
    path = Path(cfg.cache_dir) / "datasets" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.npz"

    def tokenize_into_cache() -> None:
        if path.is_file():
            log.info("data %s: tokenized dataset read from the cache %s", cfg.source, path)
            return
        log.info("data %s: tokenizing once into %s", cfg.source, path)
        ds = render_records(records_fn(), tokenizer, cfg, max_length)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=ds.tokens, loss_mask=ds.loss_mask, offsets=ds.offsets,
                 stats=np.array(json.dumps(asdict(ds.stats))))
        tmp.rename(path)

    on_rank0_then_all(tokenize_into_cache)
    with np.load(path) as z:
        stats = DatasetStats(**json.loads(str(z["stats"])))
        ds = TokenizedDataset(z["tokens"], z["loss_mask"], z["offsets"], stats)
    if len(ds) == 0:
        raise ValueError(
            f"data.source={cfg.source}: no usable example ({stats.records} records, {stats.dropped_empty} empty, "
            f"{stats.dropped_overlong} over-long, {stats.dropped_no_labels} without labels)"
        )
    return ds
