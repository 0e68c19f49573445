"""Packing strategies: how examples are grouped into micro-batches.

Each strategy maps example lengths (and an RNG for tie-breaking and shuffling) to a list of bins, a bin
being the example indices of one micro-batch. Every example lands in exactly one bin.

- ``bfd``: best-fit decreasing over the whole dataset. Examples are taken longest first; each goes into
  the open bin with the *least* room that still fits it, or opens a new bin. Whole examples only.
- ``none``: the padded baseline. Shuffled examples, ``batch_size`` per micro-batch, padded to the longest.
"""

from __future__ import annotations

import numpy as np


def pack_best_fit_decreasing(
    lengths: np.ndarray,
    budget: int,
    max_examples_per_bin: int | None = None,
    rng: np.random.Generator | None = None,
) -> list[np.ndarray]:
    """Best-fit decreasing of ``lengths`` into bins of ``budget`` tokens.

    Open bins are indexed by their remaining room: ``room_mask`` has bit ``c`` set when some bin has exactly
    ``c`` tokens of room, so "the fullest bin that still fits ``s``" is the lowest set bit at or above ``s``
    (one shift and one lowest-bit on a ``budget``-bit integer). ``rng`` shuffles examples before the stable
    sort, so equal lengths are ordered by seed rather than by index.

    Args:
        lengths: tokens per example, each in ``[1, budget]``.
        budget: tokens per bin.
        max_examples_per_bin: a bin holding this many examples is closed.
        rng: optional tie-breaking RNG.

    Returns:
        bins, each an int64 array of example indices, in the order they were opened (fullest first).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > budget):
        raise ValueError(f"every length must be in [1, {budget}]; got [{lengths.min()}, {lengths.max()}]")
    cap = max_examples_per_bin or len(lengths) + 1
    base = rng.permutation(len(lengths)) if rng is not None else np.arange(len(lengths))
    order = base[np.argsort(-lengths[base], kind="stable")]

    bins: list[list[int]] = []
    by_room: list[list[int]] = [[] for _ in range(budget + 1)]  # bin ids with exactly that much room
    room_mask = 0
    for i, s in zip(order.tolist(), lengths[order].tolist()):
        fitting = room_mask >> s
        if fitting:
            room = s + (fitting & -fitting).bit_length() - 1
            b = by_room[room].pop()
            if not by_room[room]:
                room_mask &= ~(1 << room)
            bins[b].append(i)
        else:
            b, room = len(bins), budget
            bins.append([i])
        left = room - s
        if left > 0 and len(bins[b]) < cap:
            if not by_room[left]:
                room_mask |= 1 << left
            by_room[left].append(b)
    return [np.asarray(b, dtype=np.int64) for b in bins]


def batch_padded(n: int, batch_size: int, rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """The padded baseline: examples in (shuffled) order, ``batch_size`` per micro-batch."""
    order = rng.permutation(n) if rng is not None else np.arange(n)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]
