"""Stage 3: turn a micro-batch (example indices) into model inputs.

A **packed** micro-batch is one flat row holding several examples back to back::

    input_ids     a0 a1 a2 a3 | b0 b1 b2 | c0 c1
    position_ids   0  1  2  3 |  0  1  2 |  0  1      restart at 0 for every example
    labels        -100 a1 a2 a3 | -100 b1 b2 | -100 c1   aligned with input_ids; the model shifts
    cu_seqlens    [0, 4, 7, 9]                          example boundaries (int32)
    max_seqlen    4

``labels[t]`` is the token predicted from position ``t - 1``; the first token of every example is -100, so
no label is ever predicted across a boundary (b0 from a3). Tokens outside the loss mask are -100 too.
A bin may also hold *pieces* of examples (``packing=bfd_split|wrapped``): a piece's positions continue
where the example's previous piece left off instead of restarting at 0.

A **padded** micro-batch is the classic rectangle: one row per example, right-padded to the longest, with
an ``attention_mask`` and -100 labels on pads.

A micro-batch of **preference pairs** (``trainer.data.pairs``) holds each pair's two sequences side by side:
pair ``k`` is sequences ``2k`` (prompt + chosen) and ``2k + 1`` (prompt + rejected), each its own segment of
``cu_seqlens`` with positions from 0 (packed), or its own row (padded); ``num_pairs`` counts them.

Both carry ``num_label_tokens`` (tokens that carry loss: the "useful" tokens), ``num_tokens`` (real tokens),
``num_positions`` (positions the model computes, pads included), ``padded_positions`` (what a padded
micro-batch of the same sequences computes: ``trainer.packing.padded_positions`` of its segments) and
``sum_squared_lengths`` (the attention FLOPs' term), counted here on the host, so the metrics never guess.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from trainer.data.examples import IGNORE_INDEX, TokenizedDataset, from_examples, holds_pairs
from trainer.packing import Bins, padded_positions


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    """Packed only: int32 example boundaries, length num_examples + 1."""
    max_seqlen: int = 0
    attention_mask: torch.Tensor | None = None
    """Padded only: 1 for real tokens, 0 for pads."""
    num_examples: int = 0
    num_tokens: int = 0
    num_label_tokens: int = 0
    num_positions: int = 0
    example_ids: list[int] = field(default_factory=list)
    padded_positions: int = 0
    """Positions a padded micro-batch of the same sequences would compute (rows x the longest)."""
    sum_squared_lengths: int = 0
    """Sum over the batch's sequences of length^2 (the attention part of the model FLOPs)."""
    num_pairs: int = 0
    """Preference pairs in the batch: sequences ``2k`` and ``2k + 1`` are pair ``k``'s chosen and rejected."""
    ref_logps: torch.Tensor | None = None
    """``dpo.reference=precompute``: the reference's summed reply log-probs per sequence (float64)."""

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def to(self, device: torch.device) -> Batch:
        """The batch with its tensors on ``device`` (a subclass stays one). Only a copy off the host is
        asynchronous: a device-to-host ``non_blocking`` copy returns before the data is there."""
        non_blocking = torch.device(device).type != "cpu"
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                for f in dataclasses.fields(Batch)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def model_inputs(self) -> dict:
        """Keyword arguments for ``VarlenCausalLM``'s passes (``forward``, ``token_loss``, ...)."""
        if self.packed:
            return {
                "input_ids": self.input_ids,
                "position_ids": self.position_ids,
                "cu_seqlens": self.cu_seqlens,
                "max_seqlen": self.max_seqlen,
            }
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": self.attention_mask}


def sequence_counts(lengths: list[int]) -> dict[str, int]:
    """``padded_positions`` and ``sum_squared_lengths`` of a micro-batch of sequences of ``lengths`` (a packed
    row's segments, a padded batch's rows): ``trainer.packing.padded_positions`` of them as one bin."""
    sizes = np.asarray(lengths, dtype=np.int64)
    return {
        "padded_positions": int(padded_positions(Bins.of([np.arange(len(sizes))]), sizes)[0]),
        "sum_squared_lengths": int((sizes * sizes).sum()),
    }


def _labels_for(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    labels = np.where(mask, ids, IGNORE_INDEX).astype(np.int64)
    labels[0] = IGNORE_INDEX  # nothing before the first token belongs to this example
    return labels


def collate_packed(dataset: TokenizedDataset, indices: np.ndarray, pad_id: int = 0) -> Batch:
    """One flat varlen row from a bin (see the module docstring).

    ``indices`` is a 1-D array of example indices, or a 2-D ``(k, 3)`` array of pieces
    ``(example, start, end)`` (``bfd_split``, ``wrapped``): a piece is its own segment in ``cu_seqlens``,
    its positions continue at ``start``, and its first token carries no label (it is the previous piece's
    last token, whose successor's label that piece already holds; see ``trainer.packing.strategies``).
    """
    indices = np.asarray(indices)
    if len(indices) == 0:
        return _empty_batch(pad_id)
    if holds_pairs(dataset):
        return collate_pairs(dataset, indices, pad_id, collate_packed)
    pieces = indices if indices.ndim == 2 else None
    ids, labels, positions, seqlens = [], [], [], []
    for k in range(len(indices)):
        if pieces is None:
            example, start = int(indices[k]), 0
            tok, mask = dataset.example(example)
        else:
            example, start, end = (int(v) for v in pieces[k])
            tok, mask = dataset.example(example)
            tok, mask = tok[start:end], mask[start:end]
        ids.append(tok)
        labels.append(_labels_for(tok, mask))
        positions.append(np.arange(start, start + len(tok)))
        seqlens.append(len(tok))
    cu = np.zeros(len(seqlens) + 1, dtype=np.int32)
    np.cumsum(seqlens, out=cu[1:])
    labels_t = torch.from_numpy(np.concatenate(labels))[None]
    n = int(cu[-1])
    return Batch(
        **sequence_counts(seqlens),
        input_ids=torch.from_numpy(np.concatenate(ids).astype(np.int64))[None],
        labels=labels_t,
        position_ids=torch.from_numpy(np.concatenate(positions))[None],
        cu_seqlens=torch.from_numpy(cu),
        max_seqlen=max(seqlens),
        num_examples=len(seqlens),
        num_tokens=n,
        num_label_tokens=int((labels_t != IGNORE_INDEX).sum()),
        num_positions=n,
        example_ids=[int(i) for i in (indices if pieces is None else pieces[:, 0])],
    )


def collate_padded(dataset: TokenizedDataset, indices: np.ndarray, pad_id: int) -> Batch:
    """One row per example, right-padded to the longest; pads get label -100 and attention_mask 0."""
    if len(indices) == 0:
        return _empty_batch(pad_id, packed=False)
    if np.asarray(indices).ndim != 1:
        raise ValueError("padded batches take whole examples; pieces need collate_packed")
    if holds_pairs(dataset):
        return collate_pairs(dataset, indices, pad_id, collate_padded)
    examples = [dataset.example(int(i)) for i in indices]
    width = max(len(t) for t, _ in examples)
    ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    labels = np.full((len(examples), width), IGNORE_INDEX, dtype=np.int64)
    attn = np.zeros((len(examples), width), dtype=np.int64)
    for row, (tok, mask) in enumerate(examples):
        ids[row, : len(tok)] = tok
        labels[row, : len(tok)] = _labels_for(tok, mask)
        attn[row, : len(tok)] = 1
    labels_t = torch.from_numpy(labels)
    return Batch(
        **sequence_counts([len(t) for t, _ in examples]),
        input_ids=torch.from_numpy(ids),
        labels=labels_t,
        position_ids=torch.arange(width).expand(len(examples), width).contiguous(),
        attention_mask=torch.from_numpy(attn),
        num_examples=len(examples),
        num_tokens=int(attn.sum()),
        num_label_tokens=int((labels_t != IGNORE_INDEX).sum()),
        num_positions=len(examples) * width,
        example_ids=[int(i) for i in indices],
    )


def collate_pairs(dataset: TokenizedDataset, indices: np.ndarray, pad_id: int, collate) -> Batch:
    """Pairs ``indices`` as their sequences, chosen and rejected side by side, collated by ``collate``
    (``collate_packed`` or ``collate_padded``) as examples of their own."""
    if np.asarray(indices).ndim != 1:
        raise ValueError("preference pairs are packed whole; pieces cannot hold a pair")
    sequences = [seq for i in indices for seq in dataset.pair(int(i))]
    batch = collate(from_examples(sequences), np.arange(len(sequences)), pad_id)
    batch.example_ids, batch.num_pairs = [int(i) for i in indices for _ in range(2)], len(indices)  # per sequence
    refs = [dataset.ref_logps(int(i)) for i in indices]
    if refs and refs[0] is not None:
        batch.ref_logps = torch.from_numpy(np.concatenate(refs).astype(np.float64))
    return batch


def _empty_batch(pad_id: int, packed: bool = True) -> Batch:
    """A filler micro-batch (one pad token, no label): it runs forward/backward so the rank takes part in
    every collective, and contributes exactly zero loss and zero gradient."""
    one = torch.full((1, 1), pad_id, dtype=torch.long)
    return Batch(
        input_ids=one,
        labels=torch.full((1, 1), IGNORE_INDEX, dtype=torch.long),
        position_ids=torch.zeros((1, 1), dtype=torch.long),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32) if packed else None,
        max_seqlen=1,
        attention_mask=None if packed else torch.ones((1, 1), dtype=torch.long),
        num_positions=1,
        padded_positions=1,  # a filler costs the same either way
    )
