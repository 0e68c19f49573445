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
import logging
from dataclasses import dataclass, field, fields
from enum import IntEnum
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from trainer.config import DataConfig
from trainer.data.bad_records import BadRecords
from trainer.data.chat import ChatTemplateError, Segment, chat_segments_batch, check_messages, effective_template
from trainer.data.pretokenized import token_segments
from trainer.data.sources import Record

log = logging.getLogger(__name__)

RENDER_VERSION = 3
"""Bumped whenever rendering changes, so stale cached datasets are never reused (3: a chat is tokenized
whole, its mask taken from character spans, no longer piece by piece)."""


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

    def add(self, other: DatasetStats) -> None:
        """Add ``other``'s counts to these (chunks of one source, sources of a mixture)."""
        for f in fields(DatasetStats):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class TokenizedDataset:
    tokens: np.ndarray
    """All examples' token ids, concatenated (int32; a read-only memory map when read from the cache)."""
    loss_mask: np.ndarray
    """Per token: does it carry loss (bool, aligned with ``tokens``)."""
    offsets: np.ndarray
    """Base example ``j`` is ``tokens[offsets[j]:offsets[j + 1]]`` (int64)."""
    stats: DatasetStats = field(default_factory=DatasetStats)
    rows: np.ndarray | None = None
    """The base examples this dataset holds, in order (``None``: all of them); ``select`` sets it, so a
    subset is a view of the same (memory-mapped) arrays, never a copy of its tokens."""
    stored_lengths: np.ndarray | None = None
    """Tokens per base example, precomputed (the cache stores it, so lengths never read the tokens)."""
    stored_label_counts: np.ndarray | None = None
    """Loss-carrying tokens per base example, precomputed likewise."""
    folder: Path | None = None
    """The cache folder the arrays were mapped from (per-example hashes are kept there); ``None``: in memory."""
    hashes: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    """``content_hashes`` of the base examples, by seed (shared with every view)."""

    def __len__(self) -> int:
        return len(self.offsets) - 1 if self.rows is None else len(self.rows)

    def _base(self, per_base_example: np.ndarray) -> np.ndarray:
        return per_base_example if self.rows is None else per_base_example[self.rows]

    @property
    def lengths(self) -> np.ndarray:
        if self.stored_lengths is None:
            self.stored_lengths = np.diff(self.offsets)
        return self._base(self.stored_lengths)

    def label_counts(self) -> np.ndarray:
        """Loss-carrying tokens per example (the first token of each example never counts)."""
        if self.stored_label_counts is None:
            self.stored_label_counts = label_counts(self.loss_mask, self.offsets)
        return self._base(self.stored_label_counts)

    def content_hashes(self, seed: int) -> np.ndarray:
        """Per example: ``blake2b`` of its tokens keyed by ``seed``, as uint64 (the held-out split's draw,
        ``trainer.evaluate``). Computed once per cache folder and seed, then read from there."""
        from trainer.data.cache_integrity import load_hashes, save_hashes  # it imports this module

        if seed not in self.hashes:
            path = self.folder / f"content_hashes_{seed}.npy" if self.folder else None
            if path is not None and (saved := load_hashes(path)) is not None and len(saved) == len(self.offsets) - 1:
                self.hashes[seed] = saved
            else:  # none yet, or one that fails its checksum: computed (again)
                self.hashes[seed] = example_hashes(self.tokens, self.offsets, seed)
                if path is not None:
                    save_hashes(path, self.hashes[seed])
        return self._base(self.hashes[seed])

    def example_span(self, i: int) -> tuple[int, int]:
        """Where example ``i`` lies in ``tokens``: ``(start, end)``."""
        j = i if self.rows is None else int(self.rows[i])
        return int(self.offsets[j]), int(self.offsets[j + 1])

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.example_span(i)
        return self.tokens[lo:hi], self.loss_mask[lo:hi]

    def select(self, indices: np.ndarray) -> TokenizedDataset:
        """The examples ``indices`` (in that order) as a view of the same arrays; stats carried over."""
        indices = np.asarray(indices, dtype=np.int64)
        rows = indices if self.rows is None else self.rows[indices]
        self.label_counts(), self.lengths  # noqa: B018 (computed once on the base, shared by every view)
        return TokenizedDataset(self.tokens, self.loss_mask, self.offsets, self.stats, rows,
                                self.stored_lengths, self.stored_label_counts, self.folder, self.hashes)


def example_hashes(tokens: np.ndarray, offsets: np.ndarray, seed: int) -> np.ndarray:
    """``blake2b(key=seed)`` of each example's tokens (``offsets``), the first 8 bytes as a little-endian uint64."""
    keyed = hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little", signed=True))
    # byte views of one buffer and copies of one keyed state: a per-example array slice or key set-up
    # costs more than the hash itself
    data = memoryview(np.ascontiguousarray(tokens, dtype=np.int32)).cast("B")
    bounds = (np.asarray(offsets, dtype=np.int64) * 4).tolist()
    digests = bytearray()
    for lo, hi in zip(bounds, bounds[1:]):
        h = keyed.copy()
        h.update(data[lo:hi])
        digests += h.digest()
    return np.frombuffer(bytes(digests), dtype="<u8").astype(np.uint64)


def label_counts(loss_mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per example of ``offsets``: its loss-carrying tokens, its first token left out."""
    cum = np.concatenate([[0], np.cumsum(loss_mask, dtype=np.int64)])
    return cum[offsets[1:]] - cum[np.minimum(offsets[:-1] + 1, offsets[1:])]


@dataclass
class ChatToRender:
    """A validated chat whose segments ``_record_segments`` renders together with the others of its batch."""

    messages: list[dict]


def record_segments(
    record: Record, tokenizer: PreTrainedTokenizerBase, loss_on: str, template: str, where: str
) -> list[Segment] | ChatToRender | None:
    """The pieces of one record (``None`` when it has no content; a chat is rendered later, in a batch).
    Four kinds of record:

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
    if "messages" in record:
        messages = check_messages(record["messages"], where)
        if not any(m["content"].strip() for m in messages):
            return None
        return ChatToRender(messages)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
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


class Outcome(IntEnum):
    """What became of one record (the ``status`` column of the Arrow path, counted into ``DatasetStats``)."""

    KEPT = 0
    TRUNCATED = 1
    EMPTY = 2
    OVERLONG = 3
    NO_LABELS = 4
    BAD = 5


Rendered = tuple[list[int], list[bool], Outcome]
"""A record's tokens, loss mask and outcome (empty lists when it was left out)."""


def render_outcomes(
    records: list[Record], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, max_length: int, bad: BadRecords
) -> list[Rendered]:
    """Every record rendered and tokenized, or the reason it was left out; bad records go to ``bad``.

    Every text piece of every record is tokenized in one batched call (fast tokenizers parallelise it).
    """
    per_record = _record_segments(records, tokenizer, cfg, bad)
    texts = [s.text for segs in per_record if isinstance(segs, list) for s in segs if isinstance(s.text, str)]
    encoded = iter(encode_pieces(tokenizer, texts))
    return [_fit_example(segs, encoded, cfg.overlong, max_length) if isinstance(segs, list) else ([], [], segs)
            for segs in per_record]


def encode_pieces(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added. A fast tokenizer's backend is called directly: the
    ``tokenizer(...)`` wrapper builds a dict per text, which costs a third of the encoding itself."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]


def stats_of(outcomes: np.ndarray) -> DatasetStats:
    """The record counts of an array of ``Outcome`` codes (the kept-token counts are filled in later)."""
    n = np.bincount(np.asarray(outcomes, dtype=np.int64), minlength=len(Outcome))
    return DatasetStats(
        records=len(outcomes), examples=int(n[Outcome.KEPT] + n[Outcome.TRUNCATED]), truncated=int(n[Outcome.TRUNCATED]),
        dropped_empty=int(n[Outcome.EMPTY]), dropped_overlong=int(n[Outcome.OVERLONG]),
        dropped_no_labels=int(n[Outcome.NO_LABELS]), dropped_bad=int(n[Outcome.BAD]),
    )


def render_records(
    records: list[Record], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, max_length: int
) -> TokenizedDataset:
    """Tokenize records into examples with loss masks, applying the over-length and empty rules (in memory:
    the cached path is ``trainer.data.engine``)."""
    bad = BadRecords(cfg.on_bad_record, cfg.source)
    rendered = render_outcomes(records, tokenizer, cfg, max_length, bad)
    bad.finish([])
    stats = stats_of(np.array([outcome for _, _, outcome in rendered], dtype=np.int8))
    stats.dropped_bad += getattr(records, "skipped_bad", 0)
    kept = [(ids, mask) for ids, mask, outcome in rendered if outcome <= Outcome.TRUNCATED]
    return _flat_dataset(kept, stats)


def _record_segments(
    records: list[Record], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, bad: BadRecords
) -> list[list[Segment] | Outcome]:
    """Every record's segments, or ``EMPTY`` (no content) or ``BAD`` (reported to ``bad``: an error naming
    the record under ``on_bad_record=error``, a counted skip under ``skip``)."""
    template = effective_template(tokenizer)
    per_record: list[list[Segment] | Outcome] = []
    for i, record in enumerate(records):
        where = getattr(record, "where", "") or f"data.source={cfg.source} record {i}"
        if not isinstance(record, dict):
            bad.bad(where, f"a {type(record).__name__}, not a dict")
            per_record.append(Outcome.BAD)
            continue
        try:
            segments = record_segments(record, tokenizer, cfg.loss_on, template, where)
        except ValueError as e:
            if isinstance(e, ChatTemplateError):  # the template, not the record, is wrong: always an error
                raise
            bad.bad(where, str(e).removeprefix(f"{where}: "))
            segments = Outcome.BAD
        per_record.append(Outcome.EMPTY if segments is None else segments)
    chats = [p for p in per_record if isinstance(p, ChatToRender)]
    rendered = iter(chat_segments_batch([c.messages for c in chats], tokenizer, template, cfg.loss_on))
    return [next(rendered) if isinstance(p, ChatToRender) else p for p in per_record]


def _fit_example(segments: list[Segment], encoded, overlong: str, max_length: int) -> Rendered:
    """One example's tokens and loss mask (text segments take their ids from ``encoded`` in order),
    truncated to ``max_length`` or dropped per ``overlong``."""
    ids: list[int] = []
    mask: list[bool] = []
    for s in segments:
        piece = next(encoded) if isinstance(s.text, str) else s.text
        ids += piece
        mask += [s.loss] * len(piece)
    outcome = Outcome.KEPT
    if len(ids) > max_length:
        if overlong == "drop":
            return [], [], Outcome.OVERLONG
        outcome, ids, mask = Outcome.TRUNCATED, ids[:max_length], mask[:max_length]
    if not any(mask[1:]):
        return [], [], Outcome.NO_LABELS
    return ids, mask, outcome


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
