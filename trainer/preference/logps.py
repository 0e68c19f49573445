"""Per-sequence summed log-probabilities of the reply tokens, from one packed (or padded) forward.

The model wrapper computes them (``VarlenCausalLM.forward(..., per_sequence=True)``: inside the root
module's forward, where FSDP2 holds the head gathered) through the chunked fused head
(``trainer.loss.chunked_token_logps``): full ``[tokens, vocab]`` logits never exist. A sequence is a packed
segment of ``cu_seqlens`` or a padded row; its first token never carries a label, so nothing is predicted
across a boundary, and each sequence's sum equals that of the sequence run alone.
"""

from __future__ import annotations

import torch

from trainer.collate import Batch
from trainer.loss import sequence_of_labels


def sequence_logps(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Summed label log-probabilities of every sequence of ``batch``, fp32 ``[sequences]`` (pair ``k``:
    entries ``2k`` chosen and ``2k + 1`` rejected). ``model`` is a ``VarlenCausalLM`` (FSDP2-wrapped or not)."""
    return model(**batch.model_inputs(), labels=batch.labels, per_sequence=True)


def sequence_label_counts(batch: Batch) -> torch.Tensor:
    """Label (reply) tokens per sequence, ``[sequences]`` (the length SimPO and IPO normalise by)."""
    sequences = batch.labels.shape[0] if batch.cu_seqlens is None else len(batch.cu_seqlens) - 1
    return torch.bincount(sequence_of_labels(batch.labels, batch.cu_seqlens), minlength=sequences)
