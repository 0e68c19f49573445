"""Stage 2 of the data flow: group examples into micro-batches and deal them to data-parallel ranks."""

from __future__ import annotations

import numpy as np

from trainer.config import PackingConfig
from trainer.packing.sampler import EpochPlan, MicroBatchSampler, deal_bins, even_out_bins, matched_padded_batch_size
from trainer.packing.strategies import batch_padded, pack_best_fit_decreasing


def build_sampler(lengths: np.ndarray, cfg: PackingConfig, rank: int, world_size: int, seed: int) -> MicroBatchSampler:
    """The sampler for ``cfg.strategy``; the padded baseline's batch size is matched to the packed run."""
    padded_bs = None
    if not cfg.packed:
        padded_bs = cfg.padded_batch_size or matched_padded_batch_size(lengths, cfg, seed)
    return MicroBatchSampler(lengths, cfg, rank, world_size, seed, padded_batch_size=padded_bs)


__all__ = [
    "EpochPlan",
    "MicroBatchSampler",
    "batch_padded",
    "build_sampler",
    "deal_bins",
    "even_out_bins",
    "matched_padded_batch_size",
    "pack_best_fit_decreasing",
]
