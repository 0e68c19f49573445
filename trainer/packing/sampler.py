"""The distributed micro-batch sampler: bins dealt to data-parallel ranks, equal counts by construction.

Per epoch, every rank computes the same global plan from (seed, epoch) alone, so no communication is
needed and every rank agrees:

1. the strategy groups all examples into bins (micro-batches);
2. if the bin count is not a multiple of the world size, the largest multi-example bins are split in two
   (no data lost or repeated); only if nothing can be split is a rank given an *empty* micro-batch (a
   forward/backward with no label token, counted as ``filler_microbatches`` and logged);
3. bins are sorted by tokens and dealt in rounds of ``world_size`` neighbours (snake order), so the
   micro-batches that run side by side in one step hold about the same tokens on every rank;
4. the rounds are shuffled (when ``shuffle``), and rank ``r`` takes the ``r``-th bin of every round.

Every rank therefore runs the same number of micro-batches, and the trainer groups them into the same
number of optimizer steps. ``state_dict()`` records (epoch, next micro-batch) for an exact resume.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from trainer.config import PackingConfig
from trainer.packing.strategies import batch_padded, pack_best_fit_decreasing

log = logging.getLogger(__name__)


@dataclass
class EpochPlan:
    """One epoch's micro-batches: ``rounds[k][r]`` is rank r's k-th micro-batch (example indices)."""

    rounds: list[list[np.ndarray]]
    splits: int = 0
    """Bins split in two to make the count a multiple of the world size."""
    filler_microbatches: int = 0
    """Empty micro-batches added because nothing could be split."""

    @property
    def microbatches_per_rank(self) -> int:
        return len(self.rounds)


def even_out_bins(bins: list[np.ndarray], world_size: int, lengths: np.ndarray) -> tuple[list[np.ndarray], int, int]:
    """Make ``len(bins)`` a multiple of ``world_size``: split the largest splittable bins, then add fillers."""
    need = -len(bins) % world_size
    if need == 0:
        return bins, 0, 0
    bins = list(bins)
    splittable = sorted(
        (i for i, b in enumerate(bins) if len(b) >= 2), key=lambda i: int(lengths[bins[i]].sum()), reverse=True
    )
    splits = 0
    for i in splittable[:need]:
        b = bins[i][np.argsort(-lengths[bins[i]], kind="stable")]
        bins[i], extra = b[0::2], b[1::2]  # alternate by length: the halves hold similar tokens
        bins.append(extra)
        splits += 1
    fillers = need - splits
    bins += [np.zeros(0, dtype=np.int64) for _ in range(fillers)]
    return bins, splits, fillers


def deal_bins(bins: list[np.ndarray], world_size: int, lengths: np.ndarray, rng: np.random.Generator | None):
    """Sort bins by tokens, cut into rounds of ``world_size`` (snake order), shuffle the rounds."""
    tokens = np.array([int(lengths[b].sum()) for b in bins], dtype=np.int64)
    order = np.argsort(-tokens, kind="stable")
    rounds = []
    for k in range(0, len(order), world_size):
        group = [bins[j] for j in order[k : k + world_size]]
        rounds.append(group if (k // world_size) % 2 == 0 else group[::-1])
    if rng is not None:
        rounds = [rounds[i] for i in rng.permutation(len(rounds))]
    return rounds


class MicroBatchSampler:
    """Yields this rank's micro-batches (arrays of example indices), epoch after epoch, resumable.

    Args:
        lengths: tokens per example.
        cfg: the packing config (strategy, budget, ...).
        rank, world_size: this rank and the data-parallel world.
        seed: the plan of epoch ``e`` is a function of (seed, e) only.
        padded_batch_size: examples per micro-batch for ``strategy=none``.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        cfg: PackingConfig,
        rank: int,
        world_size: int,
        seed: int,
        padded_batch_size: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.cfg = cfg
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.padded_batch_size = padded_batch_size or cfg.padded_batch_size or 1
        self.epoch, self.next_index = 0, 0
        self._plans: dict[int, EpochPlan] = {}

    def _rng(self, epoch: int, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch, stream])

    def plan(self, epoch: int) -> EpochPlan:
        if epoch not in self._plans:
            self._plans = {epoch: self._make_plan(epoch)}  # keep one: plans are cheap to rebuild
            p = self._plans[epoch]
            if p.splits or p.filler_microbatches:
                log.warning(
                    "epoch %d: %d bins split and %d empty micro-batches added so every rank runs %d micro-batches",
                    epoch, p.splits, p.filler_microbatches, p.microbatches_per_rank,
                )
        return self._plans[epoch]

    def _make_plan(self, epoch: int) -> EpochPlan:
        if self.cfg.packed:
            bins = pack_best_fit_decreasing(
                self.lengths, self.cfg.token_budget, self.cfg.max_examples_per_bin, self._rng(epoch, 0)
            )
        else:
            bins = batch_padded(len(self.lengths), self.padded_batch_size, self._rng(epoch, 0))
        bins, splits, fillers = even_out_bins(bins, self.world_size, self.lengths)
        rounds = deal_bins(bins, self.world_size, self.lengths, self._rng(epoch, 1) if self.cfg.shuffle else None)
        return EpochPlan(rounds, splits, fillers)

    def microbatches_per_rank(self, epoch: int) -> int:
        return self.plan(epoch).microbatches_per_rank

    def next_microbatch(self) -> tuple[int, np.ndarray, bool]:
        """(epoch, example indices, is_last_of_epoch) of this rank's next micro-batch."""
        plan = self.plan(self.epoch)
        epoch, batch = self.epoch, plan.rounds[self.next_index][self.rank]
        self.next_index += 1
        last = self.next_index == plan.microbatches_per_rank
        if last:
            self.epoch, self.next_index = self.epoch + 1, 0
        return epoch, batch, last

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "next_index": self.next_index, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["world_size"] != self.world_size:
            raise ValueError(
                f"sampler state was saved with seed {state['seed']} on {state['world_size']} ranks; "
                f"this run has seed {self.seed} on {self.world_size}"
            )
        self.epoch, self.next_index = int(state["epoch"]), int(state["next_index"])


def matched_padded_batch_size(lengths: np.ndarray, cfg: PackingConfig, seed: int) -> int:
    """Examples per padded micro-batch that match a packed run's micro-batch count (so both runs see the
    same useful tokens per optimizer step on average)."""
    bins = pack_best_fit_decreasing(lengths, cfg.token_budget, cfg.max_examples_per_bin, np.random.default_rng(seed))
    return max(1, round(len(lengths) / len(bins)))
