"""``objective=distill``: packed knowledge distillation from a frozen teacher (``objective.Distill``).

- ``loss``: the per-token loss ``alpha * CE + (1 - alpha) * D`` (forward KL, reverse KL or generalized JSD at a
  temperature, TRL's GKD definitions), chunk by chunk, against a live teacher's head or its stored top-k;
- ``teacher``: the teacher loaded and checked against the student (vocabulary, head rows, context, head), and
  its passes over a batch;
- ``topk``: ``distill.teacher_logits=precompute``'s store beside the data cache;
- ``check``: the startup self-check's loss (``DistillLossCheck``);
- ``objective``: what the loop calls (``Distill``).
"""

from trainer.objectives.distill.objective import Distill

__all__ = ["Distill"]
