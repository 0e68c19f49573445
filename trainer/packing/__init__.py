"""Stage 2 of the data flow: group examples into micro-batches and deal them to data-parallel ranks.

``strategies`` (none, sorted, ffd, bfd, bfd_split, wrapped) -> ``balance`` (even out, deal, skew) ->
``sampler`` (per-epoch plans, exact resume on any world size); ``bins`` holds many bins as slices of one
table. A stream (``data.stream.enabled=true``) is packed by ``online`` instead: best fit within a bounded window
of examples, resumable with the window's contents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from trainer.packing.balance import (
    WORK_MEASURES,
    TokenCost,
    bin_weight,
    deal_bins,
    even_out_bins,
    item_work,
    rank_balance,
    work_measure,
)
from trainer.packing.bins import Bins
from trainer.packing.sampler import EpochPlan, MicroBatchSampler, matched_padded_batch_size, pack_params
from trainer.packing.strategies import (
    STRATEGIES,
    PackParams,
    PackResult,
    PackStats,
    batch_padded,
    bin_tokens,
    get_strategy,
    item_lengths,
    item_sequences,
    pack,
    pack_best_fit_decreasing,
    padded_positions,
    piece_starts,
    split_into_pieces,
)

if TYPE_CHECKING:  # trainer.config imports the strategy registry from this package
    from trainer.config import PackingConfig


def build_sampler(
    lengths: np.ndarray,
    cfg: PackingConfig,
    rank: int,
    world_size: int,
    seed: int,
    grad_accum: int = 1,
    oversize: str = "error",
    cost: TokenCost | None = None,
    pair_splits: np.ndarray | None = None,
) -> MicroBatchSampler:
    """The sampler for ``cfg.strategy``; a padded baseline's batch size is matched to the packed run.
    ``oversize``: ``error`` or ``drop`` an example over the budget (tools only; see ``pack_params``);
    ``cost``: the model's FLOPs per example length (``packing.balance=flops``); ``pair_splits``: where each
    preference pair's second sequence starts (``TokenizedDataset.pair_splits``; ``None``: no pairs)."""
    padded_bs = None
    if get_strategy(cfg.strategy).padded:
        padded_bs = cfg.padded_batch_size or matched_padded_batch_size(lengths, cfg, seed)
    return MicroBatchSampler(
        lengths,
        cfg,
        rank,
        world_size,
        seed,
        padded_batch_size=padded_bs,
        grad_accum=grad_accum,
        oversize=oversize,
        cost=cost,
        pair_splits=pair_splits,
    )


__all__ = [
    "STRATEGIES",
    "WORK_MEASURES",
    "TokenCost",
    "Bins",
    "EpochPlan",
    "MicroBatchSampler",
    "PackParams",
    "PackResult",
    "PackStats",
    "batch_padded",
    "bin_tokens",
    "bin_weight",
    "build_sampler",
    "deal_bins",
    "even_out_bins",
    "get_strategy",
    "item_lengths",
    "item_sequences",
    "item_work",
    "matched_padded_batch_size",
    "pack",
    "pack_best_fit_decreasing",
    "pack_params",
    "padded_positions",
    "piece_starts",
    "rank_balance",
    "split_into_pieces",
    "work_measure",
]
