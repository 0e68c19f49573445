"""``Bins``: many bins in three numpy arrays, so an epoch plan over 1M examples never builds 100k+ arrays.

A bin is a 1-D int64 array of example indices or a 2-D ``(k, 3)`` array of pieces (see ``strategies``).
``Bins`` keeps every bin as a slice ``items[starts[i]:ends[i]]`` of one flat table; ``bins[i]`` is that
slice (a view), built only when asked for (the loader asks for one micro-batch at a time). Selecting or
reordering bins (``take``) moves no item.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Bins(Sequence):
    """A sequence of bins stored as slices of one table: bin ``i`` is ``items[starts[i]:ends[i]]``."""

    items: np.ndarray
    """Example indices (1-D) or pieces ``(example, start, end)`` (2-D), int64."""
    starts: np.ndarray
    ends: np.ndarray

    @classmethod
    def from_counts(cls, items: np.ndarray, counts: np.ndarray) -> Bins:
        """Bins lying back to back in ``items``, ``counts[i]`` items each."""
        ends = np.cumsum(counts, dtype=np.int64)
        return cls(items, ends - counts, ends)

    @classmethod
    def of(cls, bins: Sequence[np.ndarray]) -> Bins:
        """``bins`` as ``Bins`` (itself when it already is)."""
        if isinstance(bins, Bins):
            return bins
        counts = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
        items = np.concatenate(bins).astype(np.int64, copy=False) if len(bins) else np.zeros(0, dtype=np.int64)
        return cls.from_counts(items, counts)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Bins(self.items, self.starts[i], self.ends[i])
        return self.items[self.starts[i] : self.ends[i]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return map(self.items.__getitem__, map(slice, self.starts.tolist(), self.ends.tolist()))

    @property
    def counts(self) -> np.ndarray:
        """Items per bin."""
        return self.ends - self.starts

    @property
    def pieces(self) -> bool:
        """Items are pieces ``(example, start, end)`` rather than whole examples."""
        return self.items.ndim == 2

    def take(self, which: np.ndarray) -> Bins:
        """The bins ``which`` (indices), in that order."""
        return Bins(self.items, self.starts[which], self.ends[which])

    def segment_sums(self, per_item: np.ndarray) -> np.ndarray:
        """Per bin, the sum of ``per_item`` (one number per item of ``items``) over its items: int64 for
        integer work, float64 for FLOPs (an epoch's running sum of FLOPs would overflow int64)."""
        dtype = np.float64 if np.issubdtype(np.asarray(per_item).dtype, np.floating) else np.int64
        running = np.zeros(len(per_item) + 1, dtype=dtype)
        np.cumsum(per_item, dtype=dtype, out=running[1:])
        return running[self.ends] - running[self.starts]

    def segment_max(self, per_item: np.ndarray) -> np.ndarray:
        """Per bin, the largest of ``per_item`` over its items (0 for an empty bin). Bins may lie anywhere in
        ``items`` (``take``, a split bin's halves), so the non-empty ones are gathered back to back first."""
        out = np.zeros(len(self), dtype=np.asarray(per_item).dtype)
        full = np.flatnonzero(self.counts > 0)
        if len(full):
            counts, starts = self.counts[full], self.starts[full]
            firsts = np.cumsum(counts) - counts
            gathered = np.arange(int(counts.sum())) - np.repeat(firsts - starts, counts)
            out[full] = np.maximum.reduceat(np.asarray(per_item)[gathered], firsts)
        return out
