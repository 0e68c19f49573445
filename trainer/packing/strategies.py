"""Packing strategies: how examples are grouped into micro-batches, all behind one function, ``pack``.

A **bin** is one micro-batch. It is either a 1-D int64 array of example indices (whole examples) or, for
strategies that cut examples, a 2-D ``(k, 3)`` int64 array of **pieces** ``(example, start, end)``: the
tokens ``[start, end)`` of that example. ``trainer.collate.collate_packed`` takes either. A strategy returns
all its bins as one ``Bins`` (slices of one table, ``trainer.packing.bins``).

| strategy    | bins                                                    | whole examples | budget respected |
|-------------|---------------------------------------------------------|----------------|------------------|
| ``none``    | shuffled, ``batch_size`` per micro-batch, padded         | yes            | n/a (padded)     |
| ``sorted``  | length-grouped padded (HF ``group_by_length``)           | yes            | n/a (padded)     |
| ``ffd``     | first-fit decreasing over the whole dataset              | yes            | yes              |
| ``bfd``     | best-fit decreasing over the whole dataset               | yes            | yes              |
| ``bfd_split``| bfd; longer examples cut into pieces across bins        | no             | yes              |
| ``wrapped`` | concatenate (shuffled) then chunk at the budget          | no             | yes              |

**Split semantics** (``bfd_split``, ``wrapped``). An example cut into pieces keeps its true positions: a
piece ``(i, start, end)`` has ``position_ids`` ``start .. end - 1``, and it is its own attention segment
(its own ``cu_seqlens`` entry), so a piece never attends to another example or to another piece. Pieces of
one example overlap by one token: the next piece starts at the previous piece's ``end - 1``. The first
token of every piece carries no label, so every label of the example (tokens ``1 .. L - 1``) is predicted
exactly once over its pieces, and is predicted from the same token at the same position as in the whole
example. What a piece cannot see is the context before its start: tokens of the first piece get exactly
the loss they get in the whole example; later pieces see a context truncated at their start (as in
chunked long-document training). The trainer keeps examples up to the model's context under these
strategies (positions beyond it do not exist), so "the loss over the pieces equals the loss over the
example" holds wherever the model's context allows the whole example to be seen at once, which is the
first ``budget`` tokens. In ``bfd_split`` an example longer than the budget becomes full pieces of exactly
``budget`` tokens (each a bin of its own) and a tail piece packed by best fit with everything else.

**Bad input** is never silently lost: zero-length examples are skipped and counted; under ``bfd``/``ffd``
an example longer than the budget raises (``oversize="error"``) or is dropped and counted
(``oversize="drop"``). Every count is in ``PackStats``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from trainer.config.common import PACKING_STRATEGIES, StrategyKind
from trainer.packing.bins import Bins
from trainer.packing.fit import best_fit_decreasing, first_fit_decreasing, group_by_bin


# ------------------------------------------------------------------------------------------ bins and pieces
def item_lengths(bin_: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Tokens of every item (example or piece) of a bin."""
    return bin_[:, 2] - bin_[:, 1] if bin_.ndim == 2 else lengths[bin_]


def bin_tokens(bin_: np.ndarray, lengths: np.ndarray) -> int:
    return int(item_lengths(bin_, lengths).sum())


def item_sequences(items: np.ndarray, lengths: np.ndarray, pair_splits: np.ndarray | None = None) -> np.ndarray:
    """The sequences each item of a bin runs as, ``(k, 2)`` lengths: ``[split, length - split]`` for a
    preference pair (``pair_splits``: where each example's second sequence starts, 0 for an example that is
    not a pair; ``trainer.data.pairs``), ``[0, length]`` for anything else. The collate runs a pair's two
    sequences as two segments (or two padded rows), so what an item costs is what its sequences cost."""
    sizes = item_lengths(items, lengths)
    first = np.zeros_like(sizes)
    if pair_splits is not None:
        if items.ndim == 2:
            raise ValueError("preference pairs are packed whole; pieces cannot hold a pair")
        first = np.asarray(pair_splits, dtype=np.int64)[items]
    return np.stack([first, sizes - first], axis=-1)


def padded_positions(bins: Bins, lengths: np.ndarray, pair_splits: np.ndarray | None = None) -> np.ndarray:
    """Positions each bin computes as a padded micro-batch (``collate_padded``): its rows x its widest row,
    where a row is an example, or each sequence of a preference pair (two rows, padded to the widest
    sequence of the micro-batch, not to the widest pair). ``pack``'s ``positions``, ``packfsdp analyze`` and
    the trainer's padded counterfactual (``trainer.collate.sequence_counts``: a micro-batch's segments as one
    bin) all take it from here."""
    bins = Bins.of(bins)
    sequences = item_sequences(bins.items, lengths, pair_splits)
    rows = bins.segment_sums((sequences > 0).sum(axis=1))
    return rows * bins.segment_max(sequences.max(axis=1))


def piece_starts(bin_: np.ndarray) -> list[int] | None:
    """First position of every item of a bin of pieces (where its ``position_ids`` start); ``None`` for
    whole examples (each starts at 0)."""
    return [int(start) for start in bin_[:, 1]] if bin_.ndim == 2 else None


def split_into_pieces(length: int, budget: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``[0, length)`` in pieces of at most ``budget`` tokens, consecutive
    pieces overlapping by one token (see the module docstring)."""
    pieces, start = [], 0
    while True:
        end = min(start + budget, length)
        pieces.append((start, end))
        if end == length:
            return pieces
        start = end - 1


# ---------------------------------------------------------------------------------------------- interface
OVERSIZE_RULES = ("error", "drop")
"""What a whole-example strategy may do with an example longer than the budget (``PackParams.oversize``).
Not a config key: training's examples always fit one micro-batch (``JobConfig.validate_budget``); tools
such as ``packfsdp analyze`` pack arbitrary lengths and drop."""


@dataclass(frozen=True)
class PackParams:
    budget: int
    """Tokens per packed micro-batch."""
    max_examples_per_bin: int | None = None
    """Items (examples or pieces) per bin at most; ``None``: no cap."""
    oversize: str = "error"
    """Whole-example strategies: an example longer than ``budget`` is an ``error`` or is ``drop``-ped (counted);
    one of ``OVERSIZE_RULES``."""
    batch_size: int = 1
    """Padded strategies: examples per micro-batch."""
    megabatch_factor: int = 50
    """``sorted``: examples are sorted by length inside random groups of ``megabatch_factor * batch_size``."""


@dataclass
class PackStats:
    """What a packing did with the input. Nothing leaves ``pack`` without being counted here."""

    strategy: str
    budget: int
    examples: int = 0
    """Examples given (including skipped ones)."""
    tokens: int = 0
    """Tokens of the examples that were packed (whole or split)."""
    skipped_empty: int = 0
    dropped_oversize: int = 0
    dropped_oversize_tokens: int = 0
    split_examples: int = 0
    """Examples cut into more than one piece."""
    pieces: int = 0
    """Pieces the split examples became."""
    bins: int = 0
    bin_tokens: int = 0
    """Tokens placed in bins: ``tokens`` plus one overlap token per cut."""
    positions: int = 0
    """Positions the model computes: ``bin_tokens`` packed; rows x longest row summed when padded
    (``padded_positions``: a preference pair is two rows)."""

    @property
    def lower_bound(self) -> int:
        """No packing of whole tokens can use fewer bins than ``ceil(tokens / budget)``."""
        return math.ceil(self.tokens / self.budget) if self.tokens else 0

    @property
    def fill(self) -> float:
        """Share of the bins' token budget holding real tokens."""
        return self.bin_tokens / (self.bins * self.budget) if self.bins else 1.0

    @property
    def efficiency(self) -> float:
        """``lower_bound / bins``: 1.0 is optimal."""
        return self.lower_bound / self.bins if self.bins else 1.0

    @property
    def padding_overhead(self) -> float:
        """Extra positions computed per real token (0 for packed bins)."""
        return self.positions / self.bin_tokens - 1 if self.bin_tokens else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {
            "lower_bound": self.lower_bound,
            "fill": self.fill,
            "efficiency": self.efficiency,
            "padding_overhead": self.padding_overhead,
        }


@dataclass
class PackResult:
    bins: Bins
    stats: PackStats


BuildFn = Callable[[np.ndarray, PackParams, "np.random.Generator | None"], "Bins | list[np.ndarray]"]


@dataclass(frozen=True)
class Strategy:
    name: str
    build: BuildFn
    """``(sizes in [1, ...], params, rng) -> bins`` over positions of ``sizes``: ``Bins`` lying back to back
    (``Bins.from_counts``) or a list of arrays."""
    kind: StrategyKind
    """What it packs (``trainer.config.PACKING_STRATEGIES[name]``): padded rectangles, pieces of examples."""
    description: str

    @property
    def padded(self) -> bool:
        return self.kind.padded

    @property
    def splits(self) -> bool:
        return self.kind.splits

    @property
    def min_budget(self) -> int:
        return self.kind.min_budget


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(name: str, description: str = ""):
    """Register ``fn`` as strategy ``name``, one of ``trainer.config.PACKING_STRATEGIES`` (what it packs: padded
    rectangles, pieces of examples)."""
    kind = PACKING_STRATEGIES[name]

    def wrap(fn: BuildFn) -> BuildFn:
        STRATEGIES[name] = Strategy(name, fn, kind, description or (fn.__doc__ or "").split("\n")[0])
        return fn

    return wrap


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ValueError(f"unknown packing strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def check_params(strategy: Strategy, params: PackParams) -> None:
    """Raise ``ValueError`` on settings no strategy can honour (``PackingConfig.validate`` says it first)."""
    if params.budget < strategy.min_budget:
        raise ValueError(f"token budget must be >= {strategy.min_budget} for {strategy.name}, got {params.budget}")
    if params.max_examples_per_bin is not None and params.max_examples_per_bin < 1:
        raise ValueError(f"max examples per bin must be >= 1, got {params.max_examples_per_bin}")
    if params.batch_size < 1 or params.megabatch_factor < 1:
        raise ValueError("batch size and megabatch factor must be >= 1")
    if params.oversize not in OVERSIZE_RULES:
        raise ValueError(f"oversize must be one of {', '.join(OVERSIZE_RULES)}, got {params.oversize!r}")


def pack(
    lengths: np.ndarray,
    strategy: str,
    params: PackParams,
    rng: np.random.Generator | None = None,
    pair_splits: np.ndarray | None = None,
) -> PackResult:
    """Group examples of ``lengths`` tokens into bins with ``strategy``; skips and drops are counted.

    Args:
        lengths: tokens per example (>= 0).
        strategy: a name in ``STRATEGIES``.
        params: budget, caps, what to do with over-long examples, padded batch size.
        rng: per-epoch randomness (tie-breaking, shuffles); ``None`` is deterministic by index.
        pair_splits: preference pairs, where each one's second sequence starts (``item_sequences``): the
            bins are the same, a padded strategy's ``positions`` count each sequence as its own row.

    Raises:
        ValueError: bad parameters, negative lengths, or an over-long example under ``oversize="error"``.
    """
    strat = get_strategy(strategy)
    check_params(strat, params)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if len(lengths) and lengths.min() < 0:
        raise ValueError(f"negative example length at index {int(np.argmin(lengths))}")
    stats = PackStats(strategy, params.budget, examples=len(lengths))
    keep = lengths > 0
    stats.skipped_empty = int((~keep).sum())
    if not strat.padded and not strat.splits:
        over = lengths > params.budget
        if over.any():
            first = int(np.flatnonzero(over)[0])
            if params.oversize == "error":
                raise ValueError(
                    f"{int(over.sum())} example(s) longer than the token budget {params.budget} under {strategy} "
                    f"(first: index {first}, {int(lengths[first])} tokens); raise the budget, truncate the data, "
                    f"pack with oversize='drop', or use packing=bfd_split"
                )
            stats.dropped_oversize = int(over.sum())
            stats.dropped_oversize_tokens = int(lengths[over].sum())
            keep &= ~over
    idx = np.flatnonzero(keep)
    bins = Bins.of(strat.build(lengths[idx], params, rng) if len(idx) else [])
    if len(idx) < len(lengths):
        bins = _to_global(bins, idx)  # positions -> indices

    stats.tokens = int(lengths[idx].sum())
    stats.bins = len(bins)
    if len(bins):
        flat = bins.items  # every bin, back to back
        sizes = item_lengths(flat, lengths)
        stats.bin_tokens = int(sizes.sum())
        stats.positions = stats.bin_tokens
        if strat.padded:
            stats.positions = int(padded_positions(bins, lengths, pair_splits).sum())
        if strat.splits:
            per_example = np.bincount(flat[:, 0], minlength=len(lengths))
            stats.split_examples = int((per_example > 1).sum())
            stats.pieces = int(per_example[per_example > 1].sum())
    return PackResult(bins, stats)


def _to_global(bins: Bins, idx: np.ndarray) -> Bins:
    if bins.pieces:
        items = bins.items.copy()
        items[:, 0] = idx[items[:, 0]]
    else:
        items = idx[bins.items]
    return Bins(items, bins.starts, bins.ends)


def _batches(order: np.ndarray, batch_size: int) -> Bins:
    """``order`` cut into consecutive batches of ``batch_size`` (the last one shorter)."""
    starts = np.arange(0, len(order), batch_size, dtype=np.int64)
    return Bins(order, starts, np.minimum(starts + batch_size, len(order)))


# ------------------------------------------------------------------------------------------- the strategies
@register_strategy("none")
def build_padded(sizes: np.ndarray, params: PackParams, rng: np.random.Generator | None) -> Bins:
    """The padded baseline: shuffled examples, ``batch_size`` per micro-batch, padded to the longest."""
    order = rng.permutation(len(sizes)) if rng is not None else np.arange(len(sizes))
    return _batches(order, params.batch_size)


@register_strategy("sorted")
def build_length_grouped(sizes: np.ndarray, params: PackParams, rng: np.random.Generator | None) -> Bins:
    """Length-grouped padded batches: random mega-batches, sorted by length inside, cut into batches."""
    order = rng.permutation(len(sizes)) if rng is not None else np.arange(len(sizes))
    mega = params.megabatch_factor * params.batch_size
    group = np.arange(len(order)) // mega
    order = order[np.lexsort((-sizes[order], group))]  # by group, then longest first inside a group
    return _batches(order, params.batch_size)  # a mega-batch is whole batches, so none straddles two


@register_strategy("ffd")
def build_first_fit(sizes: np.ndarray, params: PackParams, rng: np.random.Generator | None) -> Bins:
    """First-fit decreasing over the whole dataset, whole examples only."""
    return group_by_bin(first_fit_decreasing(sizes, params.budget, params.max_examples_per_bin, rng))


@register_strategy("bfd")
def build_best_fit(sizes: np.ndarray, params: PackParams, rng: np.random.Generator | None) -> Bins:
    """Best-fit decreasing over the whole dataset, whole examples only."""
    return group_by_bin(best_fit_decreasing(sizes, params.budget, params.max_examples_per_bin, rng))


@register_strategy("bfd_split")
def build_best_fit_split(sizes: np.ndarray, params: PackParams, rng: np.random.Generator | None) -> Bins:
    """Best-fit decreasing; an example longer than the budget is cut into pieces across bins."""
    budget, step = params.budget, params.budget - 1
    n = len(sizes)
    over = np.flatnonzero(sizes > budget)
    # Piece j of a long example starts at j * (budget - 1); pieces before the last one are exactly full.
    last = -(-(sizes[over] - budget) // step)
    full_ex = np.repeat(over, last)
    full_start = (np.arange(len(full_ex)) - np.repeat(np.cumsum(last) - last, last)) * step
    full_pieces = np.stack([full_ex, full_start, full_start + budget], 1).astype(np.int64).reshape(-1, 3)

    start = np.zeros(n, dtype=np.int64)
    start[over] = last * step
    pool = np.stack([np.arange(n), start, sizes], 1).astype(np.int64)  # whole examples and tails
    bin_of = best_fit_decreasing(sizes - start, budget, params.max_examples_per_bin, rng)
    packed = group_by_bin(bin_of, pool)  # the full pieces first, one bin each, then the packed bins
    counts = np.concatenate([np.ones(len(full_pieces), dtype=np.int64), packed.counts])
    return Bins.from_counts(np.concatenate([full_pieces, packed.items]), counts)


@register_strategy("wrapped")
def build_wrapped(sizes: np.ndarray, params: PackParams, rng: np.random.Generator | None) -> Bins:
    """Concatenate the (shuffled) examples and cut the stream every ``budget`` tokens."""
    order = rng.permutation(len(sizes)) if rng is not None else np.arange(len(sizes))
    if params.max_examples_per_bin is not None:
        return _wrapped_capped(sizes, order, params.budget, params.max_examples_per_bin)
    budget, lengths = params.budget, sizes[order]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1])
    # Bin k covers stream tokens [p_k, e_k). When the cut falls inside an example, the next bin starts one
    # token back (the overlap token); when it would leave a lone first token of an example in this bin,
    # the bin closes one token early. Either way the next bin starts at e - 1; at an example edge, at e.
    ends_list, starts_list = ends.tolist(), starts.tolist()
    bin_start, bin_end, p = [], [], 0
    while p < total:
        e = p + budget
        if e >= total:
            bin_start.append(p)
            bin_end.append(total)
            break
        j = bisect.bisect_right(ends_list, e - 1)  # the example holding token e - 1
        bin_start.append(p)
        if ends_list[j] == e:
            bin_end.append(e)
            p = e
        else:
            bin_end.append(e - 1 if starts_list[j] == e - 1 else e)
            p = e - 1
    p_k, e_k = np.asarray(bin_start, dtype=np.int64), np.asarray(bin_end, dtype=np.int64)
    first = np.searchsorted(ends, p_k, side="right")
    count = np.searchsorted(ends, e_k - 1, side="right") - first + 1
    row_bin = np.repeat(np.arange(len(p_k)), count)
    ex = np.arange(len(row_bin)) - np.repeat(np.cumsum(count) - count, count) + first[row_bin]
    lo = np.maximum(p_k[row_bin] - starts[ex], 0)
    hi = np.minimum(e_k[row_bin] - starts[ex], lengths[ex])
    return Bins.from_counts(np.stack([order[ex], lo, hi], 1), count)


def _wrapped_capped(sizes: np.ndarray, order: np.ndarray, budget: int, cap: int) -> Bins:
    """``wrapped`` one example at a time, closing a bin early when it holds ``cap`` items."""
    rows: list[tuple[int, int, int]] = []
    bounds: list[int] = []  # row index where each bin after the first starts
    room, in_bin = budget, 0
    for i, length in zip(order.tolist(), sizes[order].tolist(), strict=True):
        start = 0
        while True:
            rest = length - start
            if rest <= room:
                rows.append((i, start, length))
                room, in_bin = room - rest, in_bin + 1
                if room == 0 or in_bin == cap:
                    bounds.append(len(rows))
                    room, in_bin = budget, 0
                break
            if room >= 2:  # a piece needs a labelled token besides its overlap token
                rows.append((i, start, start + room))
                start += room - 1
            bounds.append(len(rows))
            room, in_bin = budget, 0
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    edges = np.unique(np.asarray([0, *bounds, len(table)], dtype=np.int64))  # no empty bin
    return Bins(table, edges[:-1], edges[1:])


# ------------------------------------------------------------------------------------- convenience helpers
def pack_best_fit_decreasing(
    lengths: np.ndarray, budget: int, max_examples_per_bin: int | None = None, rng: np.random.Generator | None = None
) -> list[np.ndarray]:
    """Bins of ``bfd`` over ``lengths`` (each in ``[1, budget]``), as arrays of example indices."""
    return list(pack(lengths, "bfd", PackParams(budget, max_examples_per_bin), rng).bins)


def batch_padded(n: int, batch_size: int, rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """The padded baseline's micro-batches of ``n`` examples: shuffled, ``batch_size`` each."""
    return list(build_padded(np.ones(n, dtype=np.int64), PackParams(1, batch_size=batch_size), rng))
