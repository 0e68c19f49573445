"""Bin-packing kernels over the whole dataset: best-fit and first-fit decreasing, whole items only.

Both take item sizes already in ``[1, budget]`` and return, for every item, the bin it lands in. They are
exact (the same bins a textbook one-item-at-a-time implementation gives for the same item order) and run
in O(n log n) for the sort plus a near-linear pass, so 1M items pack in well under a second:

- ``best_fit_decreasing``: items of equal size are placed as one group, tightest bins first (a group of
  equal items fills the fitting bins in increasing order of room).
- ``first_fit_decreasing``: items of equal size are placed as one group. First fit puts an item into the
  *leftmost* bin with room; with equal sizes that bin keeps taking items until it has no room for another,
  then the next one does. So a group fills the candidate bins left to right, ``room // s`` items each,
  which numpy does in one pass per distinct size (there are at most ``budget`` of them).
"""

from __future__ import annotations

import bisect

import numpy as np

from trainer.packing.bins import Bins


def decreasing_order(sizes: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """Items by size, largest first; equal sizes in an order drawn from ``rng`` (index order without one)."""
    base = rng.permutation(len(sizes)) if rng is not None else np.arange(len(sizes))
    keys = sizes[base]
    top = int(keys.max()) if len(keys) else 0
    # Sizes below 2**16 sort as uint16 keys, which numpy's stable sort handles by radix sort (O(n)).
    keys = (top - keys).astype(np.uint16) if top < 2**16 else -keys
    return base[np.argsort(keys, kind="stable")]


def best_fit_decreasing(
    sizes: np.ndarray, budget: int, cap: int | None = None, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Best-fit decreasing. Returns the bin id of every item (bins numbered in the order they open).

    Items of equal size are placed as one group: best fit puts an item into the open bin with the least
    room that fits it; that bin's room shrinks, so it stays the best fit until it cannot take another item
    of this size, then the next-tightest bin takes over. A group therefore fills bins in increasing order
    of room, ``room // s`` items each; bins with equal room are interchangeable. Bins are kept in one stack
    per room value, and a group touches only the rooms it fills (at most one per item), so the pass is
    near-linear with most of the work in numpy.

    Args:
        sizes: item sizes, each in ``[1, budget]`` (int64).
        budget: bin capacity.
        cap: a bin holding this many items is closed (``None``: no cap).
        rng: tie-breaking among equal sizes.
    """
    n = len(sizes)
    if cap is not None and cap <= n:
        return _best_fit_decreasing_capped(sizes, budget, cap, rng)
    order = decreasing_order(sizes, rng)
    sorted_sizes = sizes[order]
    bin_of = np.empty(n, dtype=np.int64)
    bins = _OpenBinsByRoom(budget)
    for lo, hi in _groups(sorted_sizes):
        s, need = int(sorted_sizes[lo]), hi - lo
        parts, need = bins.fill_tightest(s, need)
        if need:
            parts.append(bins.open_new(s, need))
        bin_of[order[lo:hi]] = np.concatenate(parts)
    return bin_of


class _OpenBinsByRoom:
    """``best_fit_decreasing``'s open bins: one stack of bin ids per remaining room value that some open bin
    has, and those rooms sorted. Both grow with the number of bins, never with the budget (a budget of
    ``1e12`` tokens costs nothing here)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.stacks: dict[int, list[int]] = {}  # open bin ids by remaining room
        self.rooms: list[int] = []  # the keys of ``stacks``, increasing
        self.n_bins = 0

    def put(self, ids: list[int], room: int) -> None:
        if room <= 0 or not ids:
            return
        if room not in self.stacks:
            self.stacks[room] = []
            bisect.insort(self.rooms, room)
        self.stacks[room].extend(ids)

    def _take(self, room: int, used: int) -> list[int]:
        """The last ``used`` bins of room ``room`` (all of them when ``used`` is their number)."""
        stack = self.stacks[room]
        ids = stack[-used:]
        del stack[-used:]
        if not stack:
            del self.stacks[room]
            del self.rooms[bisect.bisect_left(self.rooms, room)]
        return ids

    def fill_tightest(self, s: int, need: int) -> tuple[list[np.ndarray], int]:
        """Place up to ``need`` items of size ``s`` into open bins, tightest fitting room first. Returns the
        bin id of each placed item (in parts, in placement order) and how many items are left. A bin it
        fills is left with ``room % s < s``, so it never comes back into this group's range."""
        parts: list[np.ndarray] = []
        while need:
            i = bisect.bisect_left(self.rooms, s)
            if i == len(self.rooms):
                break
            room = self.rooms[i]
            t, held = room // s, len(self.stacks[room])
            if t * held <= need:  # the whole room is used up
                ids = self._take(room, held)
                parts.append(np.repeat(np.asarray(ids, dtype=np.int64), t))
                need -= t * held
                self.put(ids, room - t * s)
                continue
            used = -(-need // t)  # the room where the group ends: some of its bins
            ids = self._take(room, used)
            last = need - t * (used - 1)
            parts.append(np.repeat(np.asarray(ids, dtype=np.int64), [t] * (used - 1) + [last]))
            self.put(ids[:-1], room - t * s)
            self.put(ids[-1:], room - last * s)
            need = 0
        return parts, need

    def open_new(self, s: int, need: int) -> np.ndarray:
        """Open new bins for ``need`` items of size ``s``, ``budget // s`` each; their bin ids."""
        t = self.budget // s
        new = -(-need // t)
        ids = list(range(self.n_bins, self.n_bins + new))
        last = need - t * (new - 1)
        self.put(ids[:-1], self.budget - t * s)
        self.put(ids[-1:], self.budget - last * s)
        self.n_bins += new
        return np.repeat(np.asarray(ids, dtype=np.int64), [t] * (new - 1) + [last])  # never t x new items


def _best_fit_decreasing_capped(
    sizes: np.ndarray, budget: int, cap: int, rng: np.random.Generator | None
) -> np.ndarray:
    """Best-fit decreasing one item at a time, for a cap on items per bin (rooms alone no longer decide).

    Open bins are kept by their remaining room (a stack per room some bin has, the rooms sorted), so "the
    fullest bin that still fits ``s``" is the first room at or above ``s``: memory grows with the bins.
    """
    order = decreasing_order(sizes, rng)
    bin_of = [0] * len(sizes)
    counts: list[int] = []
    by_room: dict[int, list[int]] = {}
    rooms: list[int] = []
    for i, s in zip(order.tolist(), sizes[order].tolist(), strict=True):
        j = bisect.bisect_left(rooms, s)
        if j < len(rooms):
            room = rooms[j]
            b = by_room[room].pop()
            if not by_room[room]:
                del by_room[room], rooms[j]
            counts[b] += 1
        else:
            b, room = len(counts), budget
            counts.append(1)
        bin_of[i] = b
        left = room - s
        if left > 0 and counts[b] < cap:
            if left not in by_room:
                by_room[left] = []
                bisect.insort(rooms, left)
            by_room[left].append(b)
    return np.asarray(bin_of, dtype=np.int64)


def _groups(sorted_sizes: np.ndarray) -> list[tuple[int, int]]:
    """``(lo, hi)`` of each run of equal sizes."""
    n = len(sorted_sizes)
    if n == 0:
        return []
    starts = np.flatnonzero(np.r_[True, sorted_sizes[1:] != sorted_sizes[:-1]])
    return list(zip(starts.tolist(), np.r_[starts[1:], n].tolist(), strict=True))


def first_fit_decreasing(
    sizes: np.ndarray, budget: int, cap: int | None = None, rng: np.random.Generator | None = None
) -> np.ndarray:
    """First-fit decreasing, one numpy pass per distinct size (see the module docstring).

    Args and return value as ``best_fit_decreasing``.
    """
    n = len(sizes)
    cap = cap or n + 1
    order = decreasing_order(sizes, rng)
    sorted_sizes = sizes[order]
    bin_of = np.empty(n, dtype=np.int64)
    # Open bins, in opening order; a bin leaves these arrays (compaction) once nothing can enter it.
    ids = np.zeros(0, dtype=np.int64)
    room = np.zeros(0, dtype=np.int64)
    count = np.zeros(0, dtype=np.int64)
    n_bins = 0
    smallest = int(sorted_sizes[-1]) if n else 0
    for lo, hi in _groups(sorted_sizes):
        s, need = int(sorted_sizes[lo]), hi - lo
        targets = []
        cand = np.flatnonzero(room >= s)
        if len(cand):
            take = np.minimum(room[cand] // s, cap - count[cand])
            filled = np.cumsum(take)
            last = int(np.searchsorted(filled, need))  # the first bin that completes the group
            if last < len(cand):
                take[last] -= filled[last] - need
                cand, take = cand[: last + 1], take[: last + 1]
            placed = np.repeat(cand, take)
            targets.append(ids[placed])
            room[cand] -= take * s
            count[cand] += take
            need -= len(placed)
        if need:
            per_bin = min(budget // s, cap)
            new = -(-need // per_bin)
            new_ids = np.arange(n_bins, n_bins + new)
            new_count = np.full(new, per_bin, dtype=np.int64)
            new_count[-1] = need - per_bin * (new - 1)
            targets.append(np.repeat(new_ids, new_count))  # never per_bin x new items (a budget of 1e12)
            ids, room, count = np.r_[ids, new_ids], np.r_[room, budget - new_count * s], np.r_[count, new_count]
            n_bins += new
        bin_of[order[lo:hi]] = np.concatenate(targets)
        alive = (room >= smallest) & (count < cap)  # a bin no remaining item fits leaves the scan
        if not alive.all():
            ids, room, count = ids[alive], room[alive], count[alive]
    return bin_of


def group_by_bin(bin_of: np.ndarray, rows: np.ndarray | None = None) -> Bins:
    """Per bin (in id order), the item indices, or ``rows[item]`` when ``rows`` is given. The order of items
    inside a bin is deterministic but unspecified (an unstable sort is 4x faster and nothing depends on it)."""
    order = np.argsort(bin_of)
    items = order if rows is None else rows[order]
    return Bins.from_counts(items, np.bincount(bin_of) if len(bin_of) else np.zeros(0, dtype=np.int64))
