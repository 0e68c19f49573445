"""``JobConfig``: every section, the run-level fields, and the checks that span sections."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trainer.config.common import (
    GENERATED_SOURCES,
    ConfigError,
    check_choice,
    check_finite_settings,
    check_positive,
    stated_context,
)
from trainer.config.distill import DistillConfig
from trainer.config.sanity import check_sane_settings
from trainer.config.sections import DataConfig, ModelConfig, PackingConfig, ParallelConfig
from trainer.config.training import (
    OBJECTIVES,
    CheckpointConfig,
    DPOConfig,
    EvalConfig,
    GuardConfig,
    LoggerConfig,
    LossConfig,
    OptimConfig,
    PeftConfig,
)


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    objective: str = "sft"
    """``sft`` (the mean token cross-entropy of the labels), ``dpo`` (a preference objective over pairs of
    ``prompt``/``chosen``/``rejected`` data, set by the ``dpo`` section) or ``distill`` (distillation from a frozen
    teacher, set by the ``distill`` section); ``trainer.objectives``."""
    name: str = "run"
    """Run name: the run directory is ``<output_root>/<name>/<timestamp>`` unless ``run_dir`` is set."""
    output_root: str = "outputs"
    run_dir: str | None = None
    """Explicit run directory (all ranks use it as is). Without it, a torchrun restart (same rendezvous id)
    reuses the directory of the attempt it restarts, so ``resume=auto`` finds that attempt's checkpoints."""
    resume: str = "none"
    """``none``; ``auto`` (the latest complete checkpoint of this run under the checkpoint dir, or a fresh
    start when there is none); or the path of a checkpoint (``.../step_00000100``) or of a run / checkpoints
    dir. A new run (``none``) into a run dir that already holds a run is refused."""
    resume_allow_changes: list[str] = field(default_factory=list)
    """Keys (``data.loss_on``, ``grad_accum``, or a section such as ``optim``) whose change from the
    checkpoint's config a resume accepts; any other change that alters the math is refused, naming the keys
    (see ``trainer.checkpoint.config_check``). A flat key, not ``resume.allow_changes``: ``resume=auto``
    must stay a plain value."""
    stop_after_steps: int | None = None
    """Leave the loop after this many steps (checkpointing first) while the schedule still spans
    ``max_steps``/``epochs``: a planned stop, e.g. before a job's time limit, to resume later."""
    seed: int = 1234
    """Seeds the training: the model's random init (and LoRA's), the order of micro-batches every epoch and
    each step's torch/numpy/python RNG (dropout). Not the data: a run's three seeds each seed one fact, so
    one can change without the others. ``data.seed``: which records (the generated sources, the mixture's
    draw; part of the data cache's key); ``eval.holdout_seed``: which of them are held out for eval."""
    epochs: int = 1
    """Epochs over the data when ``max_steps`` is not set."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (wins over ``epochs``)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank."""
    summary_skip_steps: int = 2
    """Steps excluded from the run summary's throughput averages (warm-up, allocator growth)."""

    def validate(self) -> None:
        check_finite_settings(self)  # nan/inf anywhere (optim.lr=inf, guard.collective_timeout_s=inf): one line
        for part in (
            self.model,
            self.data,
            self.packing,
            self.parallel,
            self.optim,
            self.loss,
            self.logger,
            self.eval,
            self.checkpoint,
            self.guard,
            self.peft,
            self.dpo,
            self.distill,
        ):
            part.validate()
        check_sane_settings(self)  # finite but meaningless (dpo.beta=1e12, optim.lr=100): one line
        check_choice("objective", self.objective, OBJECTIVES)
        self.validate_objective()
        check_positive("epochs", self.epochs)
        check_positive("grad_accum", self.grad_accum)
        if self.max_steps is not None:
            check_positive("max_steps", self.max_steps)
        if self.stop_after_steps is not None:
            check_positive("stop_after_steps", self.stop_after_steps)
        if self.summary_skip_steps < 0:
            raise ConfigError("summary_skip_steps must be >= 0")
        self.validate_budget()
        self.validate_streaming()

    def validate_objective(self) -> None:
        """What the objective needs of the rest of the job: its section's ``check_job`` (``DPOConfig``,
        ``DistillConfig``), the one place its refusals live."""
        if self.objective == "distill":
            self.distill.check_job(self)
        elif self.objective == "dpo":
            self.dpo.check_job(self)

    def validate_streaming(self) -> None:
        """``data.stream.enabled=true`` needs a run length and packs online by best fit, one source at a time."""
        if not self.data.stream.enabled:
            return
        if self.max_steps is None:
            raise ConfigError(
                "data.stream.enabled=true: a stream has no known length, so epochs cannot size the run; set max_steps "
                "(each rank's share of the stream is read again from its start when it runs out)"
            )
        refused = {
            "packing.strategy": (
                self.packing.strategy != "bfd",
                f"={self.packing.strategy} (streaming packs "
                "online by best fit within data.stream.buffer examples: packing.strategy=bfd)",
            ),
            "data.mixture.sources": (
                bool(self.data.mixture.sources),
                " (mixtures are not streamed yet: stream one source)",
            ),
            "data.limit": (self.data.limit is not None, " (a stream has no head to cut: set max_steps)"),
            "model.tokenizer": (
                self.model.tokenizer_name() == "local_bpe" and self.data.source not in GENERATED_SOURCES,
                "=local_bpe (it trains on the whole data, which a stream never holds; name a pretrained "
                "tokenizer, model.tokenizer=DIR_OR_HUB_ID, or load a model: model=hf model.name_or_path=...)",
            ),
        }
        for key, (bad, why) in refused.items():
            if bad:
                raise ConfigError(f"data.stream.enabled=true cannot be combined with {key}{why}")

    def validate_budget(self, context: int | None = None) -> None:
        """Under a strategy that packs whole examples, one example of the longest allowed length must fit
        one micro-batch; otherwise examples would be cut to the budget behind the user's back.

        Args:
            context: the model's context length when known (``trainer.pipeline`` checks again with it);
                before the model exists, the size set in ``model.random_init``/``config_overrides`` if any.
        """
        check_budget_fits_memory(self.packing.token_budget)
        if not self.packing.packed or self.packing.splits_examples:
            return
        if context is None:
            context = stated_context(self.model.init_fields())
        longest = self.longest_in_context(context)
        if self.row_budget < longest:
            cp = self.parallel.cp
            per_rank = -(-longest // cp)
            row = f" x parallel.cp={cp}" if cp > 1 else ""
            raise ConfigError(
                f"packing.token_budget={self.packing.token_budget}{row} cannot hold one example of {longest} tokens "
                f"(data.max_length={self.data.max_length}, model context {context or 'unknown'}) and strategy "
                f"{self.packing.strategy} does not split examples; set packing.token_budget>={per_rank} "
                f"or data.max_length<={self.row_budget}"
            )

    def longest_in_context(self, context: int | None) -> int:
        """``data.max_length`` clamped to the model's ``context`` (when known)."""
        return min(self.data.max_length, context) if context else self.data.max_length

    def max_example_length(self, context: int | None) -> int:
        """The longest example training keeps: ``longest_in_context``, and, unless the strategy splits
        examples, at most one micro-batch's ``packing.token_budget``. So every example fits the model and one
        micro-batch, in packed and padded runs alike."""
        longest = self.longest_in_context(context)
        return longest if self.packing.splits_examples else min(longest, self.row_budget)

    @property
    def row_budget(self) -> int:
        """Tokens of one packed row: ``packing.token_budget`` per rank times the context-parallel degree."""
        return self.packing.token_budget * self.parallel.cp

    def validate_world(self, world_size: int) -> None:
        """The launch fits the config: checked from ``WORLD_SIZE`` before the process group starts (the one
        check of the mesh shape; ``parallel.build_mesh`` relies on it)."""
        cp = self.parallel.cp
        if world_size % cp != 0:
            raise ConfigError(
                f"parallel.cp={cp} does not divide the world size {world_size}; launch a multiple of {cp} ranks"
            )
        if cp > 1 and not self.packing.packed:
            raise ConfigError(
                f"parallel.cp={cp} needs a packed strategy: packing={self.packing.strategy} pads "
                "rectangles, which cannot be sharded along the sequence (use packing=bfd)"
            )
        if cp > 1 and self.data.stream.enabled:
            raise ConfigError(
                f"parallel.cp={cp} cannot be combined with data.stream.enabled=true (a stream is dealt per rank)"
            )
        replicas = self.parallel.dp_replicate
        if replicas is not None and world_size % (replicas * cp) != 0:
            shape = f"parallel.dp_replicate={replicas}" + (f" x parallel.cp={cp}" if cp > 1 else "")
            raise ConfigError(
                f"{shape} does not divide the world size {world_size}; launch a multiple of {replicas * cp} ranks "
                "or change parallel.dp_replicate (the number of nodes: one replica per node)"
            )


BATCH_BYTES_PER_TOKEN = 64
"""The least a micro-batch costs per token of its budget before the model sees it: the collated int64
tensors (input ids, labels, positions, document ids) and the packer's per-token arrays."""


def check_budget_fits_memory(token_budget: int) -> None:
    """A ``packing.token_budget`` whose micro-batch alone cannot fit this machine's memory is one line, not
    an allocation that wakes the kernel's OOM killer (which may take other processes with it)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if token_budget * BATCH_BYTES_PER_TOKEN > memory:
        raise ConfigError(
            f"packing.token_budget={token_budget} needs at least {token_budget * BATCH_BYTES_PER_TOKEN / 2**30:.0f} "
            f"GiB per micro-batch, more than this machine's {memory / 2**30:.0f} GiB; lower it"
        )
