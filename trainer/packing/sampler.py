"""The distributed micro-batch sampler: bins dealt to data-parallel ranks, equal counts by construction.

Per epoch, every rank computes the same global plan from (seed, epoch) alone, so no communication is
needed and every rank agrees: the strategy packs all examples into bins (``trainer.packing.strategies``),
the bins are evened out to a multiple of the world size and dealt in rounds (``trainer.packing.balance``).
Every rank therefore runs the same number of micro-batches, and the trainer groups them into the same
number of optimizer steps.

**Resume.** ``state_dict()`` records (epoch, micro-batches consumed, world size) and, for the current
epoch, the *lineage* of earlier world sizes. On the same world size the plan is rebuilt and continues at
the same micro-batch: the order is exactly the uninterrupted one. On a different world size the old plan
is rebuilt, the bins it had not yet served are re-dealt to the new world (evened out and balanced again,
deterministically), and the epoch continues with exactly the remaining examples: none repeated, none lost.
The next epoch starts from a fresh plan for the new world.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from trainer.packing.balance import (
    TokenCost,
    bin_weights,
    deal_grid,
    even_out_bins,
    rank_balance,
    rank_balance_of,
    work_measure,
)
from trainer.packing.bins import Bins
from trainer.packing.strategies import PackParams, PackStats, get_strategy, pack

if TYPE_CHECKING:  # trainer.config imports the strategy registry from this package
    from trainer.config import PackingConfig

log = logging.getLogger(__name__)


@dataclass
class EpochPlan:
    """One epoch's micro-batches: ``bins[order[k, r]]`` is rank r's k-th micro-batch (a bin).

    The bins stay in their flat table (``Bins``) and a micro-batch's array is sliced out when the loader
    asks for it: at 1M examples, building ~100k arrays up front cost more than the packing itself."""

    bins: Bins
    order: np.ndarray
    """``order[k, r]``: the index in ``bins`` of rank r's k-th micro-batch (full rounds only)."""
    world_size: int
    stats: PackStats
    splits: int = 0
    """Bins split in two to make the count a multiple of the world size (cumulative over re-deals)."""
    filler_microbatches: int = 0
    """Empty micro-batches added because nothing could be split (cumulative over re-deals)."""
    work: np.ndarray | None = None
    """``work[k, r]``: the balanced measure (``packing.balance``) of ``microbatch(k, r)``, kept from the deal."""

    @property
    def microbatches_per_rank(self) -> int:
        return len(self.order)

    def microbatch(self, k: int, rank: int) -> np.ndarray:
        """Rank ``rank``'s ``k``-th micro-batch."""
        return self.bins[self.order[k, rank]]

    @property
    def rounds(self) -> list[list[np.ndarray]]:
        """Every micro-batch, ``rounds[k][r]`` (built on each call: for reports and tests)."""
        return [list(map(self.bins.__getitem__, row)) for row in self.order.tolist()]

    def unserved(self, consumed: int) -> Bins:
        """The non-empty bins of the rounds after the first ``consumed``, round by round."""
        which = self.order[consumed:].reshape(-1)
        return self.bins.take(which[self.bins.counts[which] > 0])


def pack_params(cfg: PackingConfig, padded_batch_size: int | None = None, oversize: str = "error") -> PackParams:
    """The strategies' parameters for ``cfg``. ``oversize`` is for callers that pack lengths training never
    sees (``packfsdp analyze`` drops what does not fit); training's examples always fit (``JobConfig``)."""
    return PackParams(
        budget=cfg.token_budget,
        max_examples_per_bin=cfg.max_examples_per_bin,
        oversize=oversize,
        batch_size=padded_batch_size or cfg.padded_batch_size or 1,
        megabatch_factor=cfg.megabatch_factor,
    )


class MicroBatchSampler:
    """Yields this rank's micro-batches (bins), epoch after epoch, resumable on any world size.

    Args:
        lengths: tokens per example.
        cfg: the packing config (strategy, budget, balance, ...).
        rank, world_size: this rank and the data-parallel world.
        seed: the plan of epoch ``e`` is a function of (seed, e) only.
        padded_batch_size: examples per micro-batch for the padded strategies.
        grad_accum: micro-batches per optimizer step (for the balance report only).
        oversize: what a whole-example strategy does with an example over the budget (``error``/``drop``;
            see ``pack_params``).
        cost: the model's FLOPs per example length (``TokenCost``); needed by ``packing.balance=flops``.
        pair_splits: preference pairs (``TokenizedDataset.pair_splits``): where each example's second
            sequence starts, so a pair weighs what its two sequences weigh (``item_work``) and a padded
            plan counts it as two rows; ``None``: no example is a pair.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        cfg: PackingConfig,
        rank: int,
        world_size: int,
        seed: int,
        padded_batch_size: int | None = None,
        grad_accum: int = 1,
        oversize: str = "error",
        cost: TokenCost | None = None,
        pair_splits: np.ndarray | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.pair_splits = None if pair_splits is None else np.asarray(pair_splits, dtype=np.int64)
        if self.pair_splits is not None and self.pair_splits.shape != self.lengths.shape:
            raise ValueError(f"pair_splits has {len(self.pair_splits)} entries for {len(self.lengths)} examples")
        self.cfg = cfg
        self.cost = cost if cfg.balance == "flops" else None  # the plan depends on it only under flops
        self.measure = work_measure(cfg.balance, cost)
        self.strategy = get_strategy(cfg.strategy)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.padded_batch_size = padded_batch_size or cfg.padded_batch_size or 1
        self.params = pack_params(cfg, self.padded_batch_size, oversize)
        self.grad_accum = grad_accum
        self.epoch, self.next_index = 0, 0
        self.lineage: list[tuple[int, int]] = []
        """Current epoch only: (world size, micro-batches consumed) of each earlier world in this epoch."""
        self._cache: tuple[tuple, EpochPlan] | None = None
        self._logged: set[int] = set()

    # --------------------------------------------------------------------------------------------- plans
    def _rng(self, epoch: int, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch, stream])

    def _deal(self, bins: Bins, world_size: int, epoch: int, stream: int, stats: PackStats) -> EpochPlan:
        bins, splits, fillers = even_out_bins(bins, world_size, self.lengths, self.measure, self.pair_splits)
        rng = self._rng(epoch, stream) if self.cfg.shuffle else None
        weights = bin_weights(bins, self.lengths, self.measure, self.pair_splits)
        order = deal_grid(weights, world_size, rng)  # evened out: full rounds only, no -1
        return EpochPlan(bins, order, world_size, stats, splits, fillers, weights[order])

    def plan(self, epoch: int) -> EpochPlan:
        """The epoch's plan for this world (re-dealt along ``lineage`` for the current epoch)."""
        lineage = tuple(self.lineage) if epoch == self.epoch else ()
        key = (epoch, lineage)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._make_plan(epoch, lineage))  # keep one: plans are cheap to rebuild
            self._log_plan(epoch, self._cache[1])
        return self._cache[1]

    def _make_plan(self, epoch: int, lineage: tuple[tuple[int, int], ...]) -> EpochPlan:
        result = pack(self.lengths, self.cfg.strategy, self.params, self._rng(epoch, 0), self.pair_splits)
        worlds = [ws for ws, _ in lineage] + [self.world_size]
        plan = self._deal(result.bins, worlds[0], epoch, 1, result.stats)
        for j, (_, consumed) in enumerate(lineage):
            splits, fillers = plan.splits, plan.filler_microbatches
            plan = self._deal(plan.unserved(consumed), worlds[j + 1], epoch, 2 + j, result.stats)
            plan.splits += splits
            plan.filler_microbatches += fillers
        return plan

    def _log_plan(self, epoch: int, plan: EpochPlan) -> None:
        if epoch in self._logged:
            return
        self._logged.add(epoch)
        s = plan.stats
        if s.skipped_empty or s.dropped_oversize:
            log.warning(
                "packing epoch %d: skipped %d empty example(s); dropped %d example(s) (%d tokens) longer than "
                "the budget %d",
                epoch,
                s.skipped_empty,
                s.dropped_oversize,
                s.dropped_oversize_tokens,
                s.budget,
            )
        if plan.splits or plan.filler_microbatches:
            # Splitting a bin moves no data; an empty micro-batch is wasted work, so it is a warning.
            log.log(
                logging.WARNING if plan.filler_microbatches else logging.INFO,
                "packing epoch %d: %d bins split and %d empty micro-batches added so every rank runs %d",
                epoch,
                plan.splits,
                plan.filler_microbatches,
                plan.microbatches_per_rank,
            )
        if epoch == 0:
            report = self.balance_report(epoch)
            fill = f"fill {100 * s.fill:.2f}%, {s.bins} bins vs lower bound {s.lower_bound}"
            if self.strategy.padded:
                fill = f"padding overhead {100 * s.padding_overhead:.1f}%"
            if s.split_examples:
                fill += f"; {s.split_examples} examples split into {s.pieces} pieces"
            log.info(
                "packing %s: %d examples -> %d micro-batches per rank x %d ranks (%s); "
                "rank skew (%s per step) %.2f%%, worst step %.2f%%",
                s.strategy,
                s.examples,
                plan.microbatches_per_rank,
                plan.world_size,
                fill,
                self.cfg.balance,
                100 * report["skew"],
                100 * report["worst_step_skew"],
            )

    def balance_report(self, epoch: int = 0, weight=None) -> dict[str, float]:
        """Rank skew of this epoch's plan; ``weight`` defaults to the configured balance measure."""
        plan = self.plan(epoch)
        if weight is None:
            return rank_balance_of(plan.work, self.grad_accum)
        return rank_balance(plan.rounds, weight, self.grad_accum)

    def microbatches_per_rank(self, epoch: int) -> int:
        return self.plan(epoch).microbatches_per_rank

    # ---------------------------------------------------------------------------------------- iteration
    def next_microbatch(self) -> tuple[int, np.ndarray, bool]:
        """(epoch, bin, is_last_of_epoch) of this rank's next micro-batch."""
        plan = self.plan(self.epoch)
        if not plan.microbatches_per_rank:
            raise ValueError(f"epoch {self.epoch} has no micro-batch: no example left to sample ({plan.stats})")
        epoch, batch = self.epoch, plan.microbatch(self.next_index, self.rank)
        self.next_index += 1
        last = self.next_index == plan.microbatches_per_rank
        if last:
            self.epoch, self.next_index, self.lineage = self.epoch + 1, 0, []
        return epoch, batch, last

    # ------------------------------------------------------------------------------------------- resume
    def fingerprint(self) -> str:
        """What the plans depend on besides (seed, epoch, world): the config and the example lengths."""
        cfg = asdict(self.cfg) | {"padded_batch_size": self.padded_batch_size, "oversize": self.params.oversize}
        if self.cost is not None:  # flops: the deal depends on the model's sizes
            cfg["cost"] = asdict(self.cost)
        if self.pair_splits is not None and self.cfg.balance != "tokens":
            # a pair is weighed as its two sequences (under tokens that is its length either way); a plan
            # dealt when a pair weighed as one sequence of its total length is refused, not re-dealt
            cfg["pair_splits"] = hashlib.sha256(self.pair_splits.tobytes()).hexdigest()[:16]
        digest = hashlib.sha256(self.lengths.tobytes()).hexdigest()[:16]
        return hashlib.sha256(json.dumps([cfg, digest], sort_keys=True).encode()).hexdigest()[:16]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "next_index": self.next_index,
            "seed": self.seed,
            "world_size": self.world_size,
            "lineage": [list(x) for x in self.lineage],
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` stopped, on this world size (any world size)."""
        if state["seed"] != self.seed:
            raise ValueError(f"sampler state was saved with seed {state['seed']}; this run has seed {self.seed}")
        if state.get("fingerprint", self.fingerprint()) != self.fingerprint():
            raise ValueError(
                "sampler state was saved with a different packing config or different data (example lengths); "
                "an exact resume needs the same packing.* settings and dataset"
            )
        self.epoch = int(state["epoch"])
        lineage = [tuple(x) for x in state.get("lineage", [])]
        saved_world, consumed = int(state["world_size"]), int(state["next_index"])
        if saved_world == self.world_size:
            self.lineage, self.next_index = lineage, consumed
        elif consumed == 0 and not lineage:  # nothing served yet: this epoch's plan for the new world
            self.lineage, self.next_index = [], 0
        else:
            self.lineage, self.next_index = lineage + [(saved_world, consumed)], 0
            log.info(
                "sampler: resuming epoch %d on %d ranks after %d micro-batches on %d; re-dealing the remaining bins",
                self.epoch,
                self.world_size,
                consumed,
                saved_world,
            )
        self._cache, self._logged = None, set()


def matched_padded_batch_size(lengths: np.ndarray, cfg: PackingConfig, seed: int) -> int:
    """Examples per padded micro-batch that match a packed run's micro-batch count (so both runs see the
    same useful tokens per optimizer step on average). Measured against ``bfd`` at the same budget."""
    params = PackParams(cfg.token_budget, cfg.max_examples_per_bin, oversize="drop")
    bins = pack(lengths, "bfd", params, np.random.default_rng(seed)).bins
    return max(1, round(len(lengths) / max(len(bins), 1)))
