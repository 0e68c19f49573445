"""The examples a run trains on, built in one place for the trainer and the tools.

``build_training_data`` runs stages 1-2 of the data flow for a config: tokenizer -> tokenized dataset
(examples clamped to the model's context and, unless the strategy splits them, to the token budget) ->
held-out split (eval) -> this rank's sampler; with ``data.stream.enabled=true``, this rank's share of the stream
packed online instead (``streaming_training_data``). ``trainer.loop.Trainer``, ``packfsdp analyze`` and
``packfsdp inspect`` all call it, so they see the same examples.

``model_context`` and ``resolve_attention`` read the facts the data and the model depend on from the model's
transformers config alone (no weights): its context length (``trainer.config.stated_context``, the same
rule the trainer applies to its built model) and the attention backend, resolved once against the device,
the compute dtype and what the model's attention needs (dropout, logit softcapping, sinks).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.collate import collate_packed, collate_padded
from trainer.config import ConfigError, JobConfig, ModelConfig, stated_context
from trainer.data import TokenizedDataset, load_dataset, load_tokenizer, source_fingerprint
from trainer.data.examples import holds_pairs, pair_splits_of
from trainer.data.holdout import split_holdout
from trainer.data.stream import ExampleStream, head_sets
from trainer.library_log import library_load
from trainer.model import DTYPES, AttentionBackend, AttentionBackendError, AttentionNeeds, resolve_backend
from trainer.model_config import model_config, tokenizer_fields
from trainer.objectives import OBJECTIVE_TYPES
from trainer.packing import MicroBatchSampler, TokenCost, build_sampler
from trainer.packing.online import ServedExamples, StreamingSampler
from trainer.throughput import config_flop_params, token_cost

log = logging.getLogger(__name__)


@dataclass
class TrainingData:
    """What ``build_training_data`` returns."""

    tokenizer: Any
    """The tokenizer (a transformers ``PreTrainedTokenizerBase``)."""
    dataset: TokenizedDataset
    """The examples training sees: the held-out ones removed (streaming: ``ServedExamples``, those of the
    micro-batch just served)."""
    eval_dataset: TokenizedDataset | None
    """The held-out examples (``None`` when ``eval.holdout_fraction`` is 0)."""
    sampler: MicroBatchSampler
    """This rank's micro-batches of ``dataset`` (streaming: a ``StreamingSampler``)."""
    collate: Callable
    """``collate_packed`` or ``collate_padded``, as the strategy needs."""
    max_length: int
    """The longest example kept (``JobConfig.max_example_length``)."""
    probe: TokenizedDataset | None = None
    """Streaming only: the stream's first training examples (the start-up self-check draws its batch there)."""
    probe_sampler: MicroBatchSampler | None = None
    """Streaming only: the probe's own plan (one rank), where the self-check's worst case is found."""

    def check_examples(self) -> tuple[TokenizedDataset, MicroBatchSampler]:
        """The examples and the plan the startup self-check draws its batch from: the run's own, or a stream's
        head (a stream's examples are dealt as read)."""
        return (self.dataset, self.sampler) if self.probe is None else (self.probe, self.probe_sampler)


def build_training_data(
    cfg: JobConfig, rank: int = 0, world_size: int | None = None, *, tokenizer: Any = None, context: int | None = None
) -> TrainingData:
    """Tokenizer -> dataset -> held-out split -> sampler, for this rank of ``world_size``.

    Args:
        cfg: the validated job config.
        rank, world_size: whose micro-batches the sampler deals (the plan is the same on every rank);
            ``world_size=None``: one data-parallel group (``parallel.cp`` ranks), as the tools look at a run.
        tokenizer: an already loaded tokenizer (the trainer's model is built from it); ``None`` loads it.
        context: the model's context length when known (the trainer's built model states it); ``None``
            reads it from the model's config (``model_context``).

    Raises:
        ConfigError: the token budget cannot hold one example of the longest allowed length (the same
            verdict on every rank, so no rank is left waiting).
    """
    world_size = cfg.parallel.cp if world_size is None else world_size
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model, cfg.data)
    if context is None:
        context = model_context(cfg.model)
    cfg.validate_budget(context)
    max_length = cfg.max_example_length(context)
    if cfg.data.stream.enabled:
        return streaming_training_data(cfg, tokenizer, max_length, rank, world_size)
    dataset = load_dataset(cfg.data, tokenizer, max_length)
    check_objective_fits_data(cfg, holds_pairs(dataset))
    dataset, eval_dataset = split_holdout(
        dataset, cfg.eval.holdout_fraction, cfg.eval.holdout_seed, cfg.eval.max_examples
    )
    # Context parallel: bins of C x token_budget tokens are planned and dealt to the world / C data-parallel
    # groups; every rank of a group (cp innermost: ranks g*C .. g*C + C - 1) gets the same bin and shards it.
    cp = cfg.parallel.cp
    packing = dataclasses.replace(cfg.packing, token_budget=cfg.row_budget)
    sampler = build_sampler(
        dataset.lengths,
        packing,
        rank // cp,
        world_size // cp,
        cfg.seed,
        grad_accum=cfg.grad_accum,
        cost=balance_cost(cfg, tokenizer),
        pair_splits=pair_splits_of(dataset),
    )
    collate = collate_packed if cfg.packing.packed else collate_padded
    return TrainingData(tokenizer, dataset, eval_dataset, sampler, collate, max_length)


def check_objective_fits_data(cfg: JobConfig, pairs: bool) -> None:
    """The data holds what the objective's batches must carry (``Objective.pairs``): a mismatch is one line."""
    wants_pairs = OBJECTIVE_TYPES[cfg.objective].pairs
    if pairs and not wants_pairs:
        on_pairs = " or ".join(f"objective={name}" for name, cls in OBJECTIVE_TYPES.items() if cls.pairs)
        raise ConfigError(
            f"data.source={cfg.data.source} holds preference pairs (prompt/chosen/rejected); train "
            f"them with {on_pairs} (objective={cfg.objective} would learn the rejected replies too)"
        )
    if not pairs and wants_pairs:
        raise ConfigError(
            f"objective={cfg.objective} needs preference pairs (prompt/chosen/rejected columns); "
            f"data.source={cfg.data.source} holds none"
        )


def streaming_training_data(
    cfg: JobConfig, tokenizer: Any, max_length: int, rank: int, world_size: int
) -> TrainingData:
    """``data.stream.enabled=true``: this rank's share of the stream (``trainer.data.stream``), packed online
    (``trainer.packing.online``); the eval set and the self-check's examples come from the stream's head."""
    holdout = (cfg.eval.holdout_fraction, cfg.eval.holdout_seed)
    eval_dataset, probe = head_sets(cfg.data, tokenizer, max_length, holdout, cfg.eval.max_examples)
    stream = ExampleStream(cfg.data, tokenizer, max_length, rank, world_size, holdout)
    sampler = StreamingSampler(
        stream, cfg.packing, cfg.data.stream.buffer, rank, world_size, fingerprint=source_fingerprint(cfg.data)
    )
    log.info(
        "streaming %s: packed online from a window of %d examples per rank; the run is max_steps=%d steps",
        cfg.data.source,
        cfg.data.stream.buffer,
        cfg.max_steps,
    )
    # the self-check's worst case reads only lengths, budget and batch size: no deal to weigh, no model to build
    probe_sampler = build_sampler(probe.lengths, dataclasses.replace(cfg.packing, balance="tokens"), 0, 1, cfg.seed)
    return TrainingData(
        tokenizer, ServedExamples(sampler), eval_dataset, sampler, collate_packed, max_length, probe, probe_sampler
    )


def balance_cost(cfg: JobConfig, tokenizer: Any) -> TokenCost | None:
    """``packing.balance=flops``: the model's FLOPs per example length, from its config alone (the model built
    on the meta device, the vocabulary the trainer gives it), so the trainer and the tools deal the same plan.
    With LoRA every base weight counts as frozen (4 FLOPs per parameter and token instead of 6)."""
    if cfg.packing.balance != "flops":
        return None
    base = None if cfg.model.name_or_path else tokenizer_fields(tokenizer)
    what = (
        f"model.name_or_path={cfg.model.name_or_path}" if cfg.model.name_or_path else f"model.family={cfg.model.family}"
    )
    with library_load(what):
        sizes = config_flop_params(model_config(cfg.model, base=base), cfg.model.trust_remote_code)
    if cfg.peft.method != "none":
        sizes = sizes._replace(frozen=sizes.params)
    return token_cost(sizes)


def model_context(cfg: ModelConfig) -> int | None:
    """The model's context length from its config alone (no weights). ``None`` when the config states none
    or cannot be read (an unreachable hub id, say: the examples are then clamped to ``data.max_length``
    only, which is logged)."""
    try:
        return stated_context(model_config(cfg))
    except (OSError, ValueError) as e:  # transformers raises these for missing or unreadable configs
        log.warning("model context unknown (%s); examples are clamped to data.max_length only", e)
        return None


def resolve_attention(cfg: JobConfig, device: torch.device) -> AttentionBackend:
    """The packed attention backend for ``model.attention`` on ``device``, in the compute dtype
    (``parallel.param_dtype``), for what the model's attention needs (``AttentionNeeds``, read from its
    config, no weights: dropout, logit softcapping, sinks): a backend that cannot honour one is never given
    the model (``auto`` moves on, a named backend fails with one line naming the family and the argument).
    Resolved once, before any heavy work, so a backend that cannot run fails first."""
    what = (
        f"model.name_or_path={cfg.model.name_or_path}" if cfg.model.name_or_path else f"model.family={cfg.model.family}"
    )
    with library_load(what):  # a config transformers rejects (dbrx from a bare config): one line
        needs = AttentionNeeds.of(model_config(cfg.model))
    if reason := needs.context_parallel_refusal(cfg.parallel.cp):
        raise AttentionBackendError(reason)
    return resolve_backend(cfg.model.attention, device, DTYPES[cfg.parallel.param_dtype], needs=needs)


__all__ = [
    "TrainingData",
    "balance_cost",
    "build_training_data",
    "model_context",
    "resolve_attention",
    "streaming_training_data",
]
