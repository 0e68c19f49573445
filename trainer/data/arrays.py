"""The tokenized cache on disk: one ``.npy`` file per array, memory-mapped by every rank.

A prepared dataset is a folder::

    tokens.npy        int32, every example's token ids, concatenated
    loss_mask.npy     bool, aligned with tokens
    offsets.npy       int64, example i is tokens[offsets[i]:offsets[i + 1]]
    lengths.npy       int64, tokens per example (np.diff(offsets), stored so nothing reads tokens for it)
    label_counts.npy  int64, loss-carrying tokens per example (its first token never counts)
    pair_splits.npy   int64, a preference pair's second sequence starts here (0: not a pair; trainer.data.pairs)
    stats.json        DatasetStats

``np.load(mmap_mode="r")`` maps tokens and masks read-only: N ranks on a node share one copy in the page
cache, and a rank's resident memory holds only the pages its batches touch. ``ArrayWriter`` fills the
folder chunk by chunk, so preparing it never holds more than one chunk of examples in memory either.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from trainer.data.cache_integrity import stamps
from trainer.data.examples import DatasetStats, TokenizedDataset, label_counts

COLUMNS = {
    "tokens": np.int32,
    "loss_mask": np.bool_,
    "lengths": np.int64,
    "label_counts": np.int64,
    "pair_splits": np.int64,
}
"""The arrays written chunk by chunk (``offsets`` is derived from ``lengths`` at the end)."""
NPY_HEADER_BYTES = 128


class ArrayWriter:
    """Appends examples to a folder's arrays; ``finish`` turns them into ``.npy`` files."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.files = {name: open(folder / f"{name}.npy", "wb") for name in COLUMNS}
        for name, f in self.files.items():  # rewritten with the final length by ``finish``
            f.write(npy_header(COLUMNS[name], 0))
        self.sizes = dict.fromkeys(COLUMNS, 0)
        self.stats = DatasetStats()

    def add(
        self, tokens: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray, pair_splits: np.ndarray | None = None
    ) -> None:
        """Append examples given flat: their tokens and mask concatenated, each one's length and pair split."""
        lengths = np.asarray(lengths, dtype=np.int64)
        pair_splits = np.zeros(len(lengths), np.int64) if pair_splits is None else pair_splits
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        if offsets[-1] != len(tokens) or len(tokens) != len(loss_mask):
            raise AssertionError(f"{len(tokens)} tokens, {len(loss_mask)} mask values, lengths sum {offsets[-1]}")
        arrays = {
            "tokens": tokens,
            "loss_mask": loss_mask,
            "lengths": lengths,
            "label_counts": label_counts(np.asarray(loss_mask, dtype=bool), offsets),
            "pair_splits": pair_splits,
        }
        for name, values in arrays.items():
            np.ascontiguousarray(values, dtype=COLUMNS[name]).tofile(self.files[name])
            self.sizes[name] += len(values)

    def add_examples(self, examples: list[tuple[list[int], list[bool], int]]) -> None:
        """Append ``(ids, mask, pair_split)`` examples."""
        if examples:
            self.add(
                np.fromiter((t for ids, *_ in examples for t in ids), np.int32),
                np.fromiter((m for _, mask, *_ in examples for m in mask), np.bool_),
                np.fromiter((len(ids) for ids, *_ in examples), np.int64),
                np.fromiter((e[2] if len(e) > 2 else 0 for e in examples), np.int64),
            )

    def count(self, stats: DatasetStats) -> None:
        """Add a chunk's record counts to the totals."""
        self.stats.add(stats)

    def finish(self) -> DatasetStats:
        """Complete the ``.npy`` files, write ``offsets.npy`` and ``stats.json`` (the kept-token counts filled in
        from the arrays)."""
        for name, f in self.files.items():  # the data is in place: only the header learns the length
            f.seek(0)
            f.write(npy_header(COLUMNS[name], self.sizes[name]))
            f.close()
        lengths = np.load(self.folder / "lengths.npy")
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        np.save(self.folder / "offsets.npy", offsets)
        s = self.stats
        s.examples, s.tokens = len(lengths), int(offsets[-1])
        s.label_tokens = int(np.load(self.folder / "label_counts.npy").sum())
        (self.folder / "stats.json").write_text(json.dumps(asdict(s)))
        return s


def npy_header(dtype: type, length: int) -> bytes:
    """The ``.npy`` header of a 1-D array of ``length`` values: 128 bytes for any length (numpy pads it to a
    multiple of 64), so the files are written in place and the header last."""
    out = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (length,)}
    np.lib.format.write_array_header_1_0(out, header)
    if len(out.getvalue()) != NPY_HEADER_BYTES:
        raise AssertionError(f"a {len(out.getvalue())}-byte .npy header, not {NPY_HEADER_BYTES}")
    return out.getvalue()


def open_arrays(folder: Path) -> TokenizedDataset:
    """The dataset in ``folder``: tokens and mask memory-mapped, the per-example columns in memory."""
    stats = DatasetStats(**json.loads((folder / "stats.json").read_text()))
    mmap = "r" if stats.tokens else None  # an empty file cannot be mapped
    opened = stamps(folder)  # before mapping: a change from here on is caught (``TokenizedDataset.check_unchanged``)
    return TokenizedDataset(
        tokens=np.load(folder / "tokens.npy", mmap_mode=mmap),
        loss_mask=np.load(folder / "loss_mask.npy", mmap_mode=mmap),
        offsets=np.load(folder / "offsets.npy"),
        stats=stats,
        stored_lengths=np.load(folder / "lengths.npy"),
        stored_label_counts=np.load(folder / "label_counts.npy"),
        folder=folder,
        stored_pair_splits=pair_splits_or_none(np.load(folder / "pair_splits.npy")),
        opened=opened,
    )


def pair_splits_or_none(splits: np.ndarray) -> np.ndarray | None:
    """A dataset of preference pairs keeps its splits; any other dataset (all 0) keeps ``None``."""
    return splits if len(splits) and splits.all() else None
