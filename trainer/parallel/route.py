"""The route of the parallel stage: how a micro-batch runs over the ranks, entered by the step as one context.

    route = build_route(cfg.parallel, rank, world)      # Route (cp = 1) or ContextParallelRoute (cp > 1)
    route.prepare(model, sampler, lengths)              # before FSDP: refuse what it cannot run, make its groups
    with route.step(batches, device) as local:          # this rank's part of each micro-batch, on device
        ...                                             # the objective's loss, backward: nothing knows cp
    route.step_metrics()                                # what it measured of the step (``cp_skew``)

Eval (``trainer.evaluate.eval_batches``: ``dp_rank``, ``dp_size``, ``local``) and the startup self-check
(``self_check_route``) go through the same route. Under context parallelism a row is the CP group's (ranks
``g*C .. g*C + C - 1``, cp innermost, so a group lives inside a node), each rank runs its shard
(``cp_layout.shard_batch``) and the attention gathers the row's keys over the group (``cp_attention``); the loop,
the objectives and the model's loss passes see a batch whose ``model_inputs`` carry the shard as its ``layout``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist

from trainer import distributed
from trainer.collate import Batch
from trainer.config import ConfigError, ParallelConfig
from trainer.model.mixers import find_token_mixers
from trainer.model.rope import length_dependent_rope_modules
from trainer.parallel.cp_layout import ShardedBatch, plan_shards, row_hash, row_lengths, shard_batch, split_skew

log = logging.getLogger("trainer")


def refuse_unshardable(model: torch.nn.Module, cp: int) -> None:
    """A model that cannot be made exact under cp > 1, refused in one line: length-dependent rope types
    (``dynamic``, ``longrope``) need each example's *global* length, which one rank's shard does not show;
    token mixers outside attention (``trainer.model.mixers``) need the state of the tokens before the shard."""
    if cp > 1 and (found := length_dependent_rope_modules(model)):
        raise ConfigError(
            f"parallel.cp={cp}: {type(model).__name__}'s rotary embedding {found[0][0]!r} depends on each example's "
            "whole length (dynamic/longrope rope), which a context-parallel shard does not see; use parallel.cp=1"
        )
    if cp > 1 and (mixers := find_token_mixers(model)):
        raise ConfigError(
            f"parallel.cp={cp}: {type(model).__name__}'s {type(mixers[0].module).__name__} ({mixers[0].name}) mixes "
            f"tokens outside attention ({' + '.join(mixers[0].traits)}): its state would have to pass from rank to "
            "rank along the row, which packfsdp does not do; use parallel.cp=1"
        )


def new_cp_group(world_size: int, cp: int, rank: int):
    """This rank's CP group: ranks ``g*C .. g*C + C - 1`` (cp innermost, so a group lives inside a node).
    Every rank creates every group (``new_group`` is collective); ``None`` when ``cp == 1``."""
    if cp == 1:
        return None
    mine = None
    for start in range(0, world_size, cp):
        group = dist.new_group(list(range(start, start + cp)))
        if start <= rank < start + cp:
            mine = group
    return mine


def check_same_row(batch: Batch, group, device: torch.device) -> None:
    """Fail unless every rank of the CP group holds the same row (a hash of its ``cu_seqlens``)."""
    h = torch.tensor([row_hash(batch.cu_seqlens), -row_hash(batch.cu_seqlens)], dtype=torch.float64, device=device)
    dist.all_reduce(h, op=dist.ReduceOp.MAX, group=group)
    if h[0] != -h[1]:
        raise RuntimeError("packfsdp: the ranks of a context-parallel group hold different rows (sampler bug)")


def step_skew(batches: list[Batch], cp: int, device: torch.device) -> float:
    """This step's attention-cost skew of the CP groups: per group, the busiest rank's causal attention pairs
    over the group's mean, minus 1, averaged over groups (each group counted once). One all-reduce."""
    pairs = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    pairs[dist.get_rank()] = sum(b.shard.pairs for b in batches if isinstance(b, ShardedBatch))
    dist.all_reduce(pairs)
    groups = pairs.view(-1, cp)
    mean = groups.mean(dim=1)
    busy = mean > 0
    return float((groups.max(dim=1).values[busy] / mean[busy] - 1).mean()) if busy.any() else 0.0


class CPRoute:
    """The startup self-check's route under cp > 1 (``trainer.model.certification.measure(route=...)``): the
    check row is sharded over the real CP group and run through the CP attention as training runs it; the
    group's logits come back in row order (this rank's own part differentiable, so its backward gives this
    rank's share of the gradient) and the gradient projections are summed over the group."""

    def __init__(self, model: torch.nn.Module, cp: int, rank: int, split: str, group, kernel: str) -> None:
        self.model, self.cp, self.rank, self.split, self.group, self.kernel = model, cp, rank, split, group, kernel

    def __str__(self) -> str:
        return f"context-parallel route: cp={self.cp}, {self.split} split, rank {self.rank} of its group"

    def logits(self, batch: Batch) -> torch.Tensor:
        device = batch.input_ids.device
        shards = plan_shards(batch.cu_seqlens.tolist(), self.cp, self.split)
        local = shard_batch(batch.to("cpu"), self.cp, self.rank, self.split, self.group, self.kernel).to(device)
        mine = self.model(**local.model_inputs())[0]  # [S, V]
        parts = [torch.empty_like(mine) for _ in range(self.cp)]
        dist.all_gather(parts, mine.detach().contiguous(), group=self.group)
        parts[self.rank] = mine
        gathered = torch.cat(parts)  # [C * S, V] in the group's order
        where = torch.empty(int(batch.cu_seqlens[-1]), dtype=torch.long)
        for r, shard in enumerate(shards):
            real = shard.index >= 0
            where[shard.index[real]] = r * shard.slots + torch.nonzero(real).flatten()
        return gathered[where.to(device)][None]

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=self.group)
        return t


class Route:
    """How a micro-batch runs over the ranks: the route of the parallel stage the step, eval and the self-check go
    through. This one (``parallel.cp=1``): whole rows, one per rank, dealt over every rank."""

    def __init__(self, rank: int | None = None, world_size: int | None = None) -> None:
        self.rank = distributed.rank() if rank is None else rank
        self.world_size = distributed.world_size() if world_size is None else world_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group: the rows it is dealt."""
        return self.rank

    @property
    def dp_size(self) -> int:
        """Data-parallel groups (the ranks rows are dealt to)."""
        return self.world_size

    def describe(self) -> str:
        return "data parallel: a micro-batch's row runs whole on its rank"

    def prepare(self, model: torch.nn.Module, sampler) -> None:
        """Set ``model`` (unsharded) up for this route and refuse what it cannot run; ``sampler``: the plan the
        start-up log describes."""

    def local(self, batch: Batch) -> Batch:
        """This rank's part of a collated micro-batch (its whole row)."""
        return batch

    @contextlib.contextmanager
    def step(self, batches: list[Batch], device: torch.device) -> Iterator[list[Batch]]:
        """One optimizer step's micro-batches as this rank runs them (on ``device``)."""
        yield [self.local(b).to(device) for b in batches]

    def step_metrics(self) -> dict[str, float]:
        """What the route measured of the last step (for the step's record)."""
        return {}

    def self_check_route(self, model: torch.nn.Module):
        """The startup self-check's way of running a batch (``None``: ``model`` as is)."""
        return None


class ContextParallelRoute(Route):
    """``parallel.cp = C > 1``: a row is the CP group's (ranks ``g*C .. g*C + C - 1``), each rank runs its shard
    (``shard_batch``), the attention gathers the row's keys over the group (``cp_attention``)."""

    def __init__(
        self,
        cp: int,
        split: str,
        rank: int | None = None,
        world_size: int | None = None,
        group=None,
        kernel: str | None = None,
    ) -> None:
        super().__init__(rank, world_size)
        self.cp, self.split = cp, split
        self.group = group
        """This rank's CP group (``prepare`` makes every group)."""
        self.kernel = kernel
        """The run's attention backend: the kernel a shard's query runs go through (``prepare`` sets the model's)."""
        self.rows_checked = False
        """The first step after start or resume checks that the group holds one row (``check_same_row``)."""
        self.skew: float | None = None

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp

    def describe(self) -> str:
        return f"context parallel: cp={self.cp} ({self.split} split), {self.dp_size} data-parallel group(s)"

    def prepare(self, model: torch.nn.Module, sampler) -> None:
        refuse_unshardable(model.model, self.cp)
        self.group = new_cp_group(self.world_size, self.cp, self.rank)
        self.kernel = model.backend.name
        rows = [row_lengths(b, sampler.lengths) for round_ in sampler.plan(0).rounds[:64] for b in round_]
        log.info(
            "context parallel: cp=%d (%s split), %d data-parallel group(s), rows of %d tokens; attention-cost "
            "skew across the group (first 64 rounds): contiguous %.1f%%, balanced %.1f%%",
            self.cp,
            self.split,
            self.dp_size,
            sampler.params.budget,
            100 * split_skew(rows, self.cp, "contiguous"),
            100 * split_skew(rows, self.cp, "balanced"),
        )

    def local(self, batch: Batch) -> Batch:
        return shard_batch(batch, self.cp, self.rank % self.cp, self.split, self.group, self.kernel)

    @contextlib.contextmanager
    def step(self, batches: list[Batch], device: torch.device) -> Iterator[list[Batch]]:
        if not self.rows_checked:
            for batch in batches:
                check_same_row(batch, self.group, device)
            self.rows_checked = True
        local = [self.local(b).to(device) for b in batches]
        yield local
        self.skew = step_skew(local, self.cp, device)

    def step_metrics(self) -> dict[str, float]:
        return {"cp_skew": self.skew}

    def self_check_route(self, model: torch.nn.Module) -> CPRoute:
        return CPRoute(model, self.cp, self.rank % self.cp, self.split, self.group, self.kernel)


def build_route(cfg: ParallelConfig, rank: int, world_size: int) -> Route:
    """The route ``parallel.cp`` asks for."""
    if cfg.cp > 1:
        return ContextParallelRoute(cfg.cp, cfg.cp_split, rank, world_size)
    return Route(rank, world_size)
