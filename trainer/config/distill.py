"""``DistillConfig``: the ``distill`` section of ``objective=distill`` (``trainer.objectives.distill``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.config.common import ConfigError, check_choice, check_positive

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
TEACHER_LOGITS = ("live", "precompute")


@dataclass
class DistillConfig:
    """Knowledge distillation from a frozen teacher (``objective=distill``): per label token,
    ``alpha * cross-entropy + (1 - alpha) * divergence(teacher, student)`` at ``temperature``, divided by the
    global count of label tokens as the SFT loss is. The divergences are TRL's ``GKDTrainer.generalized_jsd_loss``:
    ``forward_kl`` is its ``beta=0``, ``reverse_kl`` its ``beta=1``, ``jsd`` its ``0 < beta < 1``."""

    teacher: str | None = None
    """The teacher: a local model folder or a hub id, with the student's tokenizer (the same vocabulary, checked
    at start) and the same number of output rows. Loaded frozen, in the compute dtype, FSDP2-sharded like the
    student. A local folder is looked for when the run starts (a recipe may name one it builds first)."""
    divergence: str = "forward_kl"
    """``forward_kl`` ``KL(teacher || student)`` (mass-covering), ``reverse_kl`` ``KL(student || teacher)``
    (mode-seeking) or ``jsd``, the generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024) with
    ``beta``."""
    beta: float = 0.5
    """``jsd`` only: the mixture ``M = (1 - beta) * student + beta * teacher`` and the loss
    ``beta * KL(teacher || M) + (1 - beta) * KL(student || M)`` (TRL's ``beta``)."""
    temperature: float = 1.0
    """Both distributions of the divergence are ``softmax(logits / temperature)`` (TRL's; no ``T^2``
    factor). The cross-entropy is always at temperature 1."""
    alpha: float = 0.5
    """The cross-entropy's weight: 0 is pure distillation (TRL's GKD loss), 1 is SFT (no teacher needed)."""
    teacher_logits: str = "live"
    """``live``: the teacher runs beside the student every step, its head applied a chunk of label tokens at a
    time (the exact divergence over the whole vocabulary). ``precompute``: one pass of the teacher over the
    data cache before training stores each label token's ``top_k`` log-probabilities and their ids (and the
    mass of the rest), checksummed; a run then holds one model, and the divergence is over the ``top_k``
    tokens plus one bucket for the rest of the vocabulary."""
    top_k: int = 64
    """``precompute``: the teacher's tokens kept per label token (``4 * (2 * top_k + 1)`` bytes per label
    token on disk). A ``top_k`` of at least the vocabulary keeps all of it (the ``live`` loss)."""

    def validate(self) -> None:
        check_choice("distill.divergence", self.divergence, DIVERGENCES)
        check_choice("distill.teacher_logits", self.teacher_logits, TEACHER_LOGITS)
        check_positive("distill.temperature", self.temperature)
        check_positive("distill.top_k", self.top_k)
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"distill.alpha must be in [0, 1], got {self.alpha}")
        if self.divergence == "jsd" and not 0.0 < self.beta < 1.0:
            raise ConfigError(
                f"distill.beta must be in (0, 1) for distill.divergence=jsd, got {self.beta} "
                "(0 is forward_kl, 1 is reverse_kl)"
            )

    def check_job(self, job: Any) -> None:
        """What ``objective=distill`` needs of the rest of ``job`` (a ``JobConfig``)."""
        if not self.teacher:
            raise ConfigError(
                "objective=distill needs a teacher: distill.teacher=DIR_OR_HUB_ID (a model with the "
                "student's tokenizer)"
            )
        refused = {
            "parallel.cp": (
                job.parallel.cp > 1,
                f"={job.parallel.cp} (the teacher's pass is not sharded over a context-parallel group)",
            ),
            "data.stream.enabled": (
                self.teacher_logits == "precompute" and job.data.stream.enabled,
                "=true with distill.teacher_logits=precompute (the top-k is stored in the data "
                "cache; a stream has none: distill.teacher_logits=live)",
            ),
            "data.mixture.sources": (
                self.teacher_logits == "precompute" and bool(job.data.mixture.sources),
                " with distill.teacher_logits=precompute (the top-k is stored per cache folder: "
                "distill.teacher_logits=live)",
            ),
        }
        for key, (bad, why) in refused.items():
            if bad:
                raise ConfigError(f"objective=distill cannot be combined with {key}{why}")
