"""Tokenized examples with loss masks, stored flat (one token array, one mask array, offsets), and their counts.

The mask is aligned with ``input_ids`` (the model shifts), so a token's mask says "this token is predicted".
The first token of an example never carries loss: nothing before it belongs to the same example. A
``TokenizedDataset`` is memory-mapped from the cache (``trainer.data.cache``) or built in memory from a list
of examples (``from_examples``: the stream's eval and probe sets).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, fields
from itertools import pairwise
from pathlib import Path

import numpy as np

from trainer.data.cache_integrity import check_unchanged, load_hashes, save_hashes

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""The label of a token that carries no loss (PyTorch's cross-entropy ``ignore_index``; pre-tokenized rows
mark such tokens so too)."""

Example = tuple[np.ndarray, np.ndarray]
"""One example: its token ids (int32) and loss mask (bool)."""


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
    dropped_oversize: int = 0
    """Records over ``data.max_record_bytes``, left out before tokenizing (``trainer.data.bad_records``)."""

    def skipped(self) -> int:
        return (
            self.dropped_empty
            + self.dropped_overlong
            + self.dropped_no_labels
            + self.dropped_bad
            + self.dropped_oversize
        )

    def left_out(self) -> str:
        """Every reason a record was left out, with its count (the one wording of logs and errors)."""
        return (
            f"{self.dropped_empty} empty, {self.dropped_overlong} over-long, {self.dropped_no_labels} with no "
            f"label token, {self.dropped_bad} bad, {self.dropped_oversize} over data.max_record_bytes"
        )

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
    stored_pair_splits: np.ndarray | None = None
    """Preference pairs (``trainer.data.pairs``): per base example, where its second sequence starts;
    ``None``: the examples are not pairs."""
    stored_ref_logps: np.ndarray | None = None
    """``dpo.reference=precompute``: per base example, the reference's summed reply log-probs
    ``[chosen, rejected]`` (float64, ``trainer.objectives.reference``)."""
    opened: dict | None = None
    """The mapped cache files as they were when opened (``cache_integrity.stamps``); ``None``: in memory."""

    @property
    def is_pairs(self) -> bool:
        return self.stored_pair_splits is not None

    @property
    def pair_splits(self) -> np.ndarray | None:
        """Per example of this dataset, where its second sequence starts (``None``: not pairs); the sampler
        costs a pair as its two sequences (``trainer.packing.item_work``)."""
        return None if self.stored_pair_splits is None else self._base(self.stored_pair_splits)

    def base_index(self, i: int) -> int:
        """Example ``i``'s index among the base examples (the cache folder's)."""
        return i if self.rows is None else int(self.rows[i])

    def pair(self, i: int) -> tuple[Example, Example]:
        """Pair ``i``'s two sequences, chosen then rejected, each ``(ids, mask)``."""
        tok, mask = self.example(i)
        split = int(self.stored_pair_splits[self.base_index(i)])
        return (tok[:split], mask[:split]), (tok[split:], mask[split:])

    def ref_logps(self, i: int) -> np.ndarray | None:
        """Pair ``i``'s precomputed reference log-probs ``[chosen, rejected]``, if any."""
        return None if self.stored_ref_logps is None else self.stored_ref_logps[self.base_index(i)]

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

    def check_unchanged(self) -> None:
        """Raise ``CacheChanged`` when a cache file this dataset maps changed since it was opened: the loop asks
        after reading each step's batches, so nothing that changed is trained on."""
        if self.folder is not None and self.opened:
            check_unchanged(self.folder, self.opened)

    def label_token_counts(self, examples_per_chunk: int = 65536) -> np.ndarray:
        """How often each token id is a label in these examples (an example's first token never is; an
        example a view holds twice counts twice), read a chunk of examples at a time."""
        base = len(self.offsets) - 1
        copies = np.ones(base, np.int64) if self.rows is None else np.bincount(self.rows, minlength=base)
        counts = np.zeros(0, np.int64)
        for a in range(0, base, examples_per_chunk):
            b = min(base, a + examples_per_chunk)
            lo, hi = int(self.offsets[a]), int(self.offsets[b])
            lengths = np.diff(self.offsets[a : b + 1])
            weight = np.repeat(copies[a:b], lengths) * np.asarray(self.loss_mask[lo:hi], dtype=np.int64)
            weight[self.offsets[a:b][lengths > 0] - lo] = 0  # the first token of each example
            chunk = np.bincount(self.tokens[lo:hi], weights=weight).astype(np.int64)
            counts = np.pad(counts, (0, max(0, len(chunk) - len(counts))))
            counts[: len(chunk)] += chunk
        return counts

    def select(self, indices: np.ndarray) -> TokenizedDataset:
        """The examples ``indices`` (in that order) as a view of the same arrays; stats carried over."""
        indices = np.asarray(indices, dtype=np.int64)
        rows = indices if self.rows is None else self.rows[indices]
        self.label_counts(), self.lengths  # computed once on the base, shared by every view
        return TokenizedDataset(
            self.tokens,
            self.loss_mask,
            self.offsets,
            self.stats,
            rows,
            self.stored_lengths,
            self.stored_label_counts,
            self.folder,
            self.hashes,
            self.stored_pair_splits,
            self.stored_ref_logps,
            self.opened,
        )


def holds_pairs(dataset) -> bool:
    """Are ``dataset``'s examples preference pairs (any example container: a mixture or a stream's never are)."""
    return bool(getattr(dataset, "is_pairs", False))


def pair_splits_of(dataset) -> np.ndarray | None:
    """``TokenizedDataset.pair_splits`` of any example container (``None`` where it holds no pairs)."""
    return dataset.pair_splits if holds_pairs(dataset) else None


def example_hashes(tokens: np.ndarray, offsets: np.ndarray, seed: int) -> np.ndarray:
    """``blake2b(key=seed)`` of each example's tokens (``offsets``), the first 8 bytes as a little-endian uint64."""
    keyed = hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little", signed=True))
    # byte views of one buffer and copies of one keyed state: a per-example array slice or key set-up
    # costs more than the hash itself
    data = memoryview(np.ascontiguousarray(tokens, dtype=np.int32)).cast("B")
    bounds = (np.asarray(offsets, dtype=np.int64) * 4).tolist()
    digests = bytearray()
    for lo, hi in pairwise(bounds):
        h = keyed.copy()
        h.update(data[lo:hi])
        digests += h.digest()
    return np.frombuffer(bytes(digests), dtype="<u8").astype(np.uint64)


def unigram_entropy(token_counts: np.ndarray) -> float:
    """The entropy in nats of a token distribution given by its counts (``label_token_counts``): the loss of
    the best model that predicts every token by its frequency alone, which any learning from context beats."""
    p = token_counts[token_counts > 0] / token_counts.sum() if token_counts.sum() else np.zeros(0)
    return float(-(p * np.log(p)).sum()) if len(p) else float("nan")


def label_counts(loss_mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per example of ``offsets``: its loss-carrying tokens, its first token left out."""
    cum = np.concatenate([[0], np.cumsum(loss_mask, dtype=np.int64)])
    return cum[offsets[1:]] - cum[np.minimum(offsets[:-1] + 1, offsets[1:])]


def from_examples(examples: list, stats: DatasetStats | None = None) -> TokenizedDataset:
    """Examples (token ids and loss masks, lists or arrays) stored flat in memory; ``stats``, when given, gets
    the kept counts (examples, tokens, label tokens) filled in."""
    offsets = np.zeros(len(examples) + 1, dtype=np.int64)
    np.cumsum([len(ids) for ids, _ in examples], out=offsets[1:])
    ds = TokenizedDataset(
        tokens=np.concatenate([np.asarray(ids, dtype=np.int32) for ids, _ in examples] or [np.zeros(0, np.int32)]),
        loss_mask=np.concatenate([np.asarray(mask, dtype=bool) for _, mask in examples] or [np.zeros(0, bool)]),
        offsets=offsets,
    )
    if stats is not None:
        ds.stats = count_kept(stats, examples)
    return ds


def count_kept(stats: DatasetStats, examples: list) -> DatasetStats:
    """``stats`` with the counts of the examples kept filled in: examples, tokens and label tokens (an
    example's first token never counts). The record counts come from ``trainer.data.render.stats_of``; the
    cache sink takes the same counts from its arrays (``trainer.data.arrays``)."""
    stats.examples = len(examples)
    stats.tokens = sum(len(ids) for ids, _ in examples)
    stats.label_tokens = sum(int(np.count_nonzero(np.asarray(mask, dtype=bool)[1:])) for _, mask in examples)
    return stats


def log_dataset_stats(name: str, stats: DatasetStats) -> None:
    """Log what was kept and what was skipped or truncated: loudly when records were skipped; truncation
    alone, what ``data.overlong=truncate`` asks for, as information."""
    log.info(
        "data %s: %d records -> %d examples, %d tokens, %d label tokens",
        name,
        stats.records,
        stats.examples,
        stats.tokens,
        stats.label_tokens,
    )
    if stats.skipped() or stats.truncated:
        log.log(
            logging.WARNING if stats.skipped() else logging.INFO,
            "data %s: skipped %s; truncated %d over-long",
            name,
            stats.left_out(),
            stats.truncated,
        )
