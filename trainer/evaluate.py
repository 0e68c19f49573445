"""Packed eval of the held-out examples (the split itself: ``trainer.data.holdout``).

Eval packs the held-out examples with best-fit decreasing into the training token budget and deals the
bins to ranks exactly like training (equal micro-batch counts on every rank, empty fillers where needed),
then reports the summed token loss over all ranks divided by the global label count. Packed attention
keeps examples apart and labels never cross a boundary, so this equals the mean token loss of the same
examples evaluated one by one (``tests/unit/test_eval.py``).

Under context parallelism (``cp > 1``) eval runs like training: rows of ``cp x token_budget`` tokens are dealt
to the data-parallel groups and each row is sharded over its CP group (``trainer.parallel``'s route), so a long
held-out row fits as its training rows do; each rank counts its own labels, so every label counts once.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch

from trainer import distributed
from trainer.collate import Batch, collate_packed
from trainer.data.examples import TokenizedDataset
from trainer.loss import summed_token_loss
from trainer.packing import deal_bins, even_out_bins, pack_best_fit_decreasing
from trainer.parallel import Route


def eval_microbatches(lengths: np.ndarray, token_budget: int, rank: int, world_size: int) -> list[np.ndarray]:
    """This rank's eval micro-batches: BFD bins of whole examples, evened out and dealt like training (no
    shuffling). Examples are never cut for eval (a piece could not attend to its example's earlier tokens,
    so its loss would differ from the whole example's): under a splitting strategy, where examples may be
    longer than the budget, the eval bins grow to the longest example."""
    budget = max(token_budget, int(lengths.max())) if len(lengths) else token_budget
    bins = pack_best_fit_decreasing(lengths, budget)
    bins, _, _ = even_out_bins(bins, world_size, lengths)
    return [round_[rank] for round_ in deal_bins(bins, world_size, lengths, rng=None)]


def eval_batches(
    dataset: TokenizedDataset, token_budget: int, device: torch.device, pad_id: int = 0, route: Route | None = None
) -> Iterator[Batch]:
    """This rank's held-out micro-batches, collated, through ``route`` (``None``: whole rows on every rank) and on
    ``device``: ``eval_microbatches`` dealt to the data-parallel groups; under context parallelism each row is
    the group's, and this rank gets its shard of it."""
    route = route or Route()
    for indices in eval_microbatches(dataset.lengths, token_budget, route.dp_rank, route.dp_size):
        yield route.local(collate_packed(dataset, indices, pad_id)).to(device)


@torch.no_grad()
def eval_sums(
    model: torch.nn.Module,
    dataset: TokenizedDataset,
    token_budget: int,
    device: torch.device,
    pad_id: int,
    route: Route | None,
    sums_of: Callable[[Batch], Mapping[str, torch.Tensor | float]],
) -> defaultdict[str, float]:
    """The named sums ``sums_of(batch)`` gives for each of this rank's held-out micro-batches (``eval_batches``;
    its losses and their counts), added in float64 and all-reduced over every rank in one collective, the model in
    eval mode meanwhile. Each objective's eval turns them into its metrics.

    Every rank must call this together: the micro-batch count is equal on every rank by construction, so
    FSDP's all-gathers line up. Under context parallelism ``token_budget`` is the row (``JobConfig.row_budget``).
    """
    was_training = model.training
    model.eval()
    names: list[str] | None = None
    sums: torch.Tensor | None = None
    for batch in eval_batches(dataset, token_budget, device, pad_id, route):
        named = sums_of(batch)
        if names is None:
            names = list(named)
            sums = torch.zeros(len(names), dtype=torch.float64, device=device)
        sums += torch.stack([torch.as_tensor(named[k], dtype=torch.float64, device=device) for k in names])
    model.train(was_training)
    if names is None:  # no micro-batch on any rank (their count is equal everywhere): every sum is 0
        return defaultdict(float)
    return defaultdict(float, zip(names, distributed.all_reduce_sum(sums.tolist(), device), strict=True))


def evaluate(
    model: torch.nn.Module,
    dataset: TokenizedDataset,
    token_budget: int,
    device: torch.device,
    pad_id: int = 0,
    route: Route | None = None,
) -> dict[str, float]:
    """Mean token loss over ``dataset`` (all ranks), from packed micro-batches (``eval_sums``)."""
    start = time.perf_counter()

    def sums_of(batch: Batch) -> dict:
        return {"loss": summed_token_loss(model, batch), "labels": batch.num_label_tokens}

    sums = eval_sums(model, dataset, token_budget, device, pad_id, route, sums_of)
    return {
        "eval_loss": sums["loss"] / max(sums["labels"], 1.0),
        "eval_tokens": int(sums["labels"]),
        "eval_time_s": time.perf_counter() - start,
    }
