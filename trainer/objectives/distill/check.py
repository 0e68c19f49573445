"""The startup self-check's loss under ``objective=distill`` (``trainer.model.certification``'s loss of the check).

The packed side is the run's own path: the teacher's pass over the packed batch (``live``: its label positions'
hidden states through its head a chunk at a time; ``precompute``: the top-k the store would hold, made by the
same pass from the same batch), then the student's distillation loss through its chunked head (or its logits
under ``loss.impl=naive``), over the batch's label count as a step divides by the global one. The side alone
runs each sequence alone through both models' own transformers attention (full logits, one sequence at a
time) and makes the same per-token loss (``token_losses``): the teacher's distribution of the sequence alone,
over the vocabulary (``live``) or over the ids the packed side's top-k chose plus the rest (``precompute``:
the same classes, so a near-tie at the k-th token cannot change the classes between the two sides).

The teacher runs unsharded in the master dtype here, as the student does; its exactness packed vs alone shows
in the gradient compared (the divergence's gradient is the difference of the two distributions), and a teacher
that leaks between examples fails the check as a student would.
"""

from __future__ import annotations

import torch

from trainer.collate import Batch
from trainer.config.distill import DistillConfig
from trainer.data.examples import IGNORE_INDEX
from trainer.loss import sequence_of_labels
from trainer.model.certification.engine import TokenLossCheck, example_spans, label_count
from trainer.objectives.distill.loss import TopKTeacher, blend, over_classes, student_terms, token_terms
from trainer.objectives.distill.teacher import live_teacher, teacher_top_k


class DistillLossCheck(TokenLossCheck):
    """``CheckLoss`` for distillation: the packed batch through the run's path, each sequence alone against the
    teacher run alone on it (``group`` and ``alone``, per label, as ``TokenLossCheck``)."""

    def __init__(self, teacher: torch.nn.Module, cfg: DistillConfig, k: int | None) -> None:
        super().__init__(per_label=True)
        self.teacher, self.cfg, self.k = teacher, cfg, k
        """``teacher``: unsharded, frozen; ``k``: the stored top-k (``precompute``), ``None``: ``live``."""
        self.packed_ids: tuple[torch.Tensor, torch.Tensor] | None = None
        """``precompute``: the packed side's sequence of each label token and its top-k ids."""

    def describe(self) -> str:
        top = f", the teacher's top-{self.k}" if self.k else ""
        return f"distill {self.cfg.divergence} loss (alpha {self.cfg.alpha}, temperature {self.cfg.temperature}{top})"

    def packed(self, model: torch.nn.Module, batch: Batch, token_losses: list[torch.Tensor] | None = None):
        """(the batch's distillation loss over its label count, differentiable, through the run's path; ``None``)."""
        if self.k is None:
            teacher = live_teacher(self.teacher, batch, self.cfg.temperature)
        else:
            ids, values, rest = teacher_top_k(self.teacher, batch, self.cfg.temperature, self.k)
            teacher = TopKTeacher(ids.long(), values, rest)
            self.packed_ids = (sequence_of_labels(batch.labels, batch.cu_seqlens), teacher.ids)
        return student_terms(model, batch, teacher, self.cfg)[0] / label_count(batch), None

    def token_losses(self, batch: Batch, index: int, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sequence ``index`` alone: per label token, the distillation loss of the student's logits ``logits``
        ``[len, vocab]`` against the teacher's logits of the sequence run alone."""
        row, span = example_spans(batch)[index]
        ids = batch.input_ids[row : row + 1, span]
        with torch.no_grad():
            teacher = self.teacher(
                input_ids=ids, position_ids=batch.position_ids[row : row + 1, span], attention_mask=torch.ones_like(ids)
            )[0].float()
        keep = labels[1:] != IGNORE_INDEX
        student, targets, teacher = logits[:-1][keep], labels[1:][keep], teacher[:-1][keep]
        log_probs = torch.log_softmax(teacher / self.cfg.temperature, dim=-1)
        if self.k is None:
            classes, top = log_probs, None
        else:
            sequence, packed_ids = self.packed_ids
            top = packed_ids[sequence == index]
            classes = over_classes(log_probs, top)
        return blend(*token_terms(student, targets, classes, top, self.cfg), self.cfg)
