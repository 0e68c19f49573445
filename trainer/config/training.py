"""The sections that say how a run trains and keeps its work: ``loss``, ``optim``, ``peft``, ``logger``,
``eval``, ``checkpoint``, ``guard``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.config.common import LOSS_IMPLS, ConfigError, check_choice, check_positive


@dataclass
class LossConfig:
    impl: str = "chunked"
    """``chunked``: the LM head and the cross-entropy a chunk of label tokens at a time, so the full
    ``[tokens, vocab]`` logits never exist (Liger's fused kernel on CUDA when ``liger-kernel`` is installed,
    torch elsewhere); exact against ``naive`` (the model's logits, then cross-entropy), faster and far smaller
    at large vocabularies. A family whose logits the chunk cannot reproduce runs ``naive`` (logged)."""
    chunk_tokens: int | None = None
    """Label tokens per chunk (``None``: ``2**25 // vocab``, 128 MiB of fp32 logits per chunk)."""

    def validate(self) -> None:
        check_choice("loss.impl", self.impl, LOSS_IMPLS)
        if self.chunk_tokens is not None:
            check_positive("loss.chunk_tokens", self.chunk_tokens)


@dataclass
class OptimConfig:
    # fused: one kernel over all parameters instead of a loop over tensors; the tiny GPT-2's AdamW step under
    # FSDP2 on one CPU thread went from 41.7 ms to 1.8 ms (a sixth of the whole step). Fused runs on CUDA too.
    optimizer: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "torch.optim.AdamW", "betas": [0.9, 0.95], "eps": 1e-8, "fused": True}
    )
    """The optimizer, built with ``hydra.utils.instantiate(optimizer, params, lr=lr, weight_decay=...)``."""
    lr: float = 3e-4
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Applied to every parameter of 2 or more dimensions: weight matrices and the embedding tables (token
    and position alike, as nanoGPT and torchtitan do); biases and norm weights get none."""
    warmup_steps: int = 10
    """Linear warmup from 0 to ``lr``."""
    min_lr_ratio: float = 0.1
    """Cosine decays to ``lr * min_lr_ratio`` at the last step."""
    grad_clip: float = 1.0
    """Max global gradient norm (``0`` disables clipping)."""

    def validate(self) -> None:
        check_positive("optim.lr", self.lr)
        if self.weight_decay < 0 or self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("optim.weight_decay, optim.warmup_steps and optim.grad_clip must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


PEFT_METHODS = ("none", "lora")
"""``peft.method`` choices: full fine-tuning, or LoRA adapters (``trainer.model.lora``)."""


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (the ``peft`` group): ``none`` trains every weight; ``lora`` freezes
    the base model and trains low-rank adapters injected by the ``peft`` library (``trainer.model.lora``)."""

    method: str = "none"
    """``none`` (full fine-tuning) or ``lora``."""
    rank: int = 8
    """LoRA rank r of each adapter (A: r x in, B: out x r)."""
    alpha: float = 16.0
    """LoRA scaling numerator: the adapter's update is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps training deterministic up to the data order)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names (or name suffixes) that get adapters, e.g. ``[q_proj, v_proj]``; ``[all-linear]``: every
    linear layer of the blocks (the output head excepted), as ``peft`` defines it."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained fully besides the adapters (e.g. ``[lm_head]`` or ``[embed_tokens]``); exported as
    ``peft``'s ``modules_to_save``."""

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def validate(self) -> None:
        check_choice("peft.method", self.method, PEFT_METHODS)
        check_positive("peft.rank", self.rank)
        check_positive("peft.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"peft.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError("peft.target_modules must name at least one module (or [all-linear])")


OBJECTIVES = ("sft", "dpo", "distill")
DPO_LOSSES = ("sigmoid", "robust", "ipo", "simpo")
DPO_REFERENCES = ("live", "precompute")


@dataclass
class DPOConfig:
    """The preference objective (``objective=dpo``; ``trainer.objectives.dpo``), TRL's names and defaults."""

    beta: float = 0.1
    """Strength of the implicit KL penalty: rewards are ``beta * (log pi - log ref)`` of a reply (``simpo``:
    ``beta *`` its mean token log-prob; SimPO's paper uses ~2.0)."""
    loss: str = "sigmoid"
    """``sigmoid`` (DPO), ``robust`` (robust DPO, with ``label_smoothing``), ``ipo`` (IPO, on mean token
    log-probs as TRL computes it) or ``simpo`` (reference-free, length-normalised, with the margin
    ``simpo_gamma``)."""
    label_smoothing: float = 0.0
    """The assumed probability that a pair's label is flipped, in [0, 0.5): with ``sigmoid``, conservative DPO
    (cDPO, the smoothed cross-entropy); with ``robust``, robust DPO (Chowdhury et al. 2024: the unbiased
    estimator, TRL's ``loss_type="robust"``)."""
    simpo_gamma: float = 0.5
    """``simpo``: the target reward margin (TRL's ``CPOConfig.simpo_gamma``)."""
    reference: str = "live"
    """Where the reference log-probs come from: ``live`` (a frozen copy of the starting policy, FSDP2-sharded
    like it, no grad, no optimizer state; with ``peft=lora`` the base with the adapters off, no copy) or
    ``precompute`` (one pass before training, stored in the data cache: a run holds one model). ``simpo``
    needs none."""

    @property
    def needs_reference(self) -> bool:
        return self.loss != "simpo"

    def validate(self) -> None:
        check_choice("dpo.loss", self.loss, DPO_LOSSES)
        check_choice("dpo.reference", self.reference, DPO_REFERENCES)
        check_positive("dpo.beta", self.beta)
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss not in ("sigmoid", "robust"):
            raise ConfigError(f"dpo.label_smoothing applies to dpo.loss=sigmoid or robust, not {self.loss}")

    def check_job(self, job: Any) -> None:
        """What ``objective=dpo`` needs of the rest of ``job`` (a ``JobConfig``): whole pairs packed on the cached
        data route, one data-parallel rank per row."""
        refused = {
            "packing.strategy": (
                job.packing.splits_examples,
                f"={job.packing.strategy} (a pair is packed whole: "
                "packing=bfd, or packing=none for the padded baseline)",
            ),
            "data.stream.enabled": (job.data.stream.enabled, "=true (pairs are read through the data cache)"),
            "data.mixture.sources": (bool(job.data.mixture.sources), " (mix preference sources into one file)"),
            "parallel.cp": (
                job.parallel.cp > 1,
                f"={job.parallel.cp} (a pair's sequences are short enough to stay on one rank)",
            ),
        }
        for key, (bad, why) in refused.items():
            if bad:
                raise ConfigError(f"objective=dpo cannot be combined with {key}{why}")


@dataclass
class LoggerConfig:
    log_every: int = 1
    """Log metrics every N optimizer steps."""
    wandb: bool = False
    """Also log to Weights & Biases."""
    wandb_project: str = "packfsdp"
    wandb_mode: str = "offline"
    """``offline`` (default: works without network or key), ``online`` or ``disabled``."""
    progress_bar: bool = True
    """Show a progress bar (tqdm: useful tokens/s, loss, ETA) on rank 0 when stderr is a terminal; the
    console log lines and ``metrics.jsonl`` are written either way."""
    peak_tflops: float | None = None
    """Peak dense bf16 TFLOP/s of one device, for the MFU estimate. ``None``: a table of known GPUs; a CPU
    has no known peak, so its runs show no MFU unless this is set."""

    def validate(self) -> None:
        check_positive("logger.log_every", self.log_every)
        check_choice("logger.wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))


@dataclass
class EvalConfig:
    holdout_fraction: float = 0.02
    """Share of examples held out of training for eval (``0`` disables eval). An example is held out iff
    a hash of its tokens (and ``holdout_seed``) falls below this share, so the split is deterministic,
    disjoint from training, the same for packed and padded runs, and duplicates never straddle it."""
    holdout_seed: int = 0
    """Seeds which examples are held out: the salt of the held-out hash (changing it draws a different
    held-out set of the same data; ``data.seed`` and ``seed`` leave the split alone, see ``seed``)."""
    every: int = 10
    """Evaluate every N optimizer steps (``0``: only after the last step). Eval always runs at the end."""
    max_examples: int | None = None
    """Evaluate on at most this many held-out examples (the first ones by hash order)."""

    def validate(self) -> None:
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ConfigError(f"eval.holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.every < 0:
            raise ConfigError(f"eval.every must be >= 0, got {self.every}")
        if self.max_examples is not None:
            check_positive("eval.max_examples", self.max_examples)


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save a checkpoint every N optimizer steps (``0``: by ``every_minutes`` and at the end only)."""
    every_minutes: float = 30.0
    """Also save when this many minutes of wall-clock time (rank 0's clock) passed since the last save or
    the start (``0``: off), so a preempted or crashed run loses at most that much work by default."""
    at_end: bool = True
    """Save a checkpoint when training ends (or stops at ``stop_after_steps``)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted after a newer one is complete (``0``: keep all)."""
    dir: str | None = None
    """Where checkpoints go (``None``: ``<run_dir>/checkpoints``). Must be shared by all nodes."""
    verify: bool = True
    """Check every file against the manifest's SHA-256 before loading (catches flipped or truncated files)."""

    def validate(self) -> None:
        if self.every_steps < 0 or self.keep_last < 0 or self.every_minutes < 0:
            raise ConfigError("checkpoint.every_steps, checkpoint.every_minutes and checkpoint.keep_last must be >= 0")


@dataclass
class GuardConfig:
    """What the trainer does when a step goes wrong (see ``trainer.guard``)."""

    nonfinite: str = "skip"
    """A step whose loss or gradient norm is NaN/Inf on any rank: ``skip`` it on every rank (parameters and
    optimizer state unchanged; counted and logged) or ``stop`` the run with a message naming the step."""
    max_consecutive_skips: int = 5
    """With ``skip``: stop anyway after this many non-finite steps in a row (the run has diverged)."""
    collective_timeout_s: float = 600.0
    """Process-group timeout: a rank that waits this long in a collective (another rank stopped answering)
    fails, so the job exits non-zero and torchrun can restart it. Covers the slowest legitimate wait too
    (rank 0 building the dataset cache while the others wait)."""

    def validate(self) -> None:
        check_choice("guard.nonfinite", self.nonfinite, ("skip", "stop"))
        check_positive("guard.max_consecutive_skips", self.max_consecutive_skips)
        check_positive("guard.collective_timeout_s", self.collective_timeout_s)
        if self.collective_timeout_s > 366 * 86400:  # a process group's timeout must fit a timedelta
            raise ConfigError(f"guard.collective_timeout_s={self.collective_timeout_s:g} is over a year; give seconds")
