"""The training objective's building block: the summed token loss of one micro-batch.

Callers divide by the *global* count of label tokens (all micro-batches of a step, all ranks), so packed,
padded and every world size optimise the same mean token loss. Training, eval and the benchmarks all
use this one function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.collate import IGNORE_INDEX, Batch


def summed_token_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Sum of the token cross-entropies of ``batch``, in fp32. Labels are aligned with input_ids:
    position t predicts ``labels[t + 1]``; -100 (pads, masked tokens, each example's first token) is skipped."""
    logits = model(**batch.model_inputs())
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        batch.labels[:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
