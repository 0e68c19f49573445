"""Context parallelism for packed rows: one row sharded along the sequence over the C ranks of a CP group.

The "llama3" scheme: every rank keeps its own queries, keys and values are all-gathered across the group
(backward reduce-scatters dK/dV), and each rank attends its local queries to exactly the keys their
example allows. No softmax merge, so no merge numerics: each query's attention is computed in one call,
as in the unsharded row.

How a row is split (``cp_split``), C = 2, a row of examples ``a`` (10 tokens) and ``b`` (4 tokens)::

    global row      a0 a1 a2 a3 a4 a5 a6 a7 a8 a9 b0 b1 b2 b3
    contiguous      rank 0: a0..a6           rank 1: a7 a8 a9 b0 b1 b2 b3
    balanced        rank 0: a0 a1 a2 | a8 a9 (head + tail)   rank 1: a3..a7 | b0..b3 ... (cost-placed)

``balanced`` cuts each example of at least ``2C`` tokens into ``2C`` near-equal chunks and gives rank r
chunks ``r`` and ``2C - 1 - r`` (zigzag per example: causal attention's cost grows along an example, so a
head chunk and a tail chunk even out); shorter examples stay whole and go to the rank with the least
attention cost so far. Every rank is padded to the same slot count ``S`` (the all-gather needs equal
shards); pads form their own segment and carry no label.

A rank's attention (``CPShard``): its local slots are maximal *query runs* (consecutive tokens of one
example). A run holding positions ``[a, b)`` of an example that starts at ``e`` attends the keys ``[e, b)``
of that example, gathered from every rank's shard, with the causal mask aligned **bottom-right** (query
``i`` of the run sees keys ``j <= i + (b - e) - (b - a)``) -- what flash-attn's varlen kernel does when
``cu_seqlens_q != cu_seqlens_k``. SDPA's ``is_causal`` is top-left on non-square inputs, so the CPU path
passes explicit lower-right masks instead. Sliding windows and softcap apply on those global positions.

Labels are shifted *before* sharding (``shard_batch``: ``targets[t]`` is the token position ``t``
predicts), so the label of a rank's first token is predicted by the previous rank's last position and
is counted exactly once.

The layout is host-side planning (``plan_shards``, ``shard_batch``: numpy and index tensors, no collective);
``trainer.parallel.cp_attention`` runs a shard's attention, ``trainer.parallel.route`` enters it per step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from trainer.collate import Batch
from trainer.config import CP_SPLITS
from trainer.data.examples import IGNORE_INDEX
from trainer.parallel.cp_attention import CP_ATTENTION


# ----------------------------------------------------------------------------------------------- layout
def assign_tokens(lengths: list[int], cp: int, split: str) -> list[np.ndarray]:
    """Per rank, the global token indices it holds (in row order), before padding."""
    total = int(sum(lengths))
    if split == "contiguous":
        size = -(-total // cp) if total else 0
        return [np.arange(r * size, min(total, (r + 1) * size)) for r in range(cp)]
    if split != "balanced":
        raise ValueError(f"parallel.cp_split={split!r}; choose one of {', '.join(CP_SPLITS)}")
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    held: list[list[np.ndarray]] = [[] for _ in range(cp)]
    cost = np.zeros(cp)
    short = []
    for e, n in enumerate(lengths):
        if n >= 2 * cp:
            bounds = np.linspace(0, n, 2 * cp + 1).round().astype(np.int64) + starts[e]
            for r in range(cp):
                for c in (r, 2 * cp - 1 - r):
                    held[r].append(np.arange(bounds[c], bounds[c + 1]))
                    # attention pairs of a chunk: its queries times the keys before them in the example
                    q0, q1 = bounds[c] - starts[e], bounds[c + 1] - starts[e]
                    cost[r] += (q1 * (q1 + 1) - q0 * (q0 + 1)) / 2
        elif n > 0:
            short.append(e)
    for e in sorted(short, key=lambda i: -lengths[i]):  # longest first, each to the cheapest rank
        r = int(np.argmin(cost))
        held[r].append(np.arange(starts[e], starts[e + 1]))
        cost[r] += lengths[e] * (lengths[e] + 1) / 2
    return [np.sort(np.concatenate(h)) if h else np.zeros(0, dtype=np.int64) for h in held]


def attention_cost(lengths: list[int], cp: int, split: str) -> np.ndarray:
    """Causal (query, key) pairs each rank of the group computes for this row."""
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    pos = np.arange(int(starts[-1])) - np.repeat(starts[:-1], lengths)
    return np.array([float((pos[idx] + 1).sum()) for idx in assign_tokens(lengths, cp, split)])


@dataclass
class CPShard:
    """One rank's share of a packed row and the boundaries its attention needs (host-built, then moved). It is
    the model's ``layout`` of a sharded batch (``VarlenCausalLM.inputs``): the attention it names
    (``implementation``) reads it and ``group`` and ``kernel`` from the keyword arguments it gives."""

    index: torch.Tensor
    """``[S]`` long: the global token each local slot holds (``-1``: a pad)."""
    cu_seqlens_q: torch.Tensor
    """int32 offsets of the local query runs (pads last, as one run)."""
    key_index: torch.Tensor
    """``[K]`` long: per run, its keys as positions in the all-gathered ``[C * S]`` buffer, runs back to back."""
    cu_seqlens_k: torch.Tensor
    max_q: int
    max_k: int
    doc_q: torch.Tensor
    """``[S]`` long: example id of each local slot (a distinct negative id per pad); flex's mask."""
    pos_q: torch.Tensor
    """``[S]`` long: position of each local slot inside its example."""
    doc_all: torch.Tensor
    """``[C * S]``: ``doc_q`` of every rank, in the all-gathered order."""
    pos_all: torch.Tensor
    slots: int
    cp: int
    rank: int
    pairs: float = 0.0
    """Causal (query, key) pairs this rank's queries attend (windows aside): its share of the row's attention."""
    group: object = None
    """The CP group's process group (the keys/values are all-gathered over it)."""
    kernel: str | None = None
    """The run's attention backend (``model.attention``): the kernel that attends a shard's query runs (no default:
    ``shard_batch`` and the route set it; a shard without one is refused by ``cp_attention``)."""

    implementation = CP_ATTENTION
    """The transformers attention that runs a shard (``trainer.parallel.cp_attention``)."""

    def attention_kwargs(self) -> dict:
        """What the model's attention layers are handed for this shard."""
        return {"cp_shard": self}

    def to(self, device: torch.device) -> CPShard:
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


def plan_shards(cu_seqlens: list[int], cp: int, split: str) -> list[CPShard]:
    """Every rank's ``CPShard`` of the row ``cu_seqlens`` (each rank uses its own; all derive the same)."""
    lengths = [e - s for s, e in pairwise(cu_seqlens)]
    total = cu_seqlens[-1]
    held = assign_tokens(lengths, cp, split)
    slots = max(1, max(len(h) for h in held))
    starts = np.asarray(cu_seqlens[:-1], dtype=np.int64)
    doc_of = np.repeat(np.arange(len(lengths)), lengths)
    where = np.empty(total, dtype=np.int64)  # gathered-buffer position of every global token
    index = np.full((cp, slots), -1, dtype=np.int64)
    for r, h in enumerate(held):
        index[r, : len(h)] = h
        where[h] = r * slots + np.arange(len(h))
    doc_all = np.where(index >= 0, doc_of[np.maximum(index, 0)], -1 - np.arange(cp * slots).reshape(cp, slots))
    safe = np.maximum(index, 0)
    pos_all = np.where(index >= 0, safe - starts[doc_of[safe]], 0)
    shards = []
    for r, h in enumerate(held):
        runs_q, keys = [0], []
        k = 0
        while k < len(h):  # maximal runs of consecutive tokens of one example
            j = k
            while j + 1 < len(h) and h[j + 1] == h[j] + 1 and doc_of[h[j + 1]] == doc_of[h[k]]:
                j += 1
            e = doc_of[h[k]]
            keys.append(where[starts[e] : h[j] + 1])
            runs_q.append(j + 1)
            k = j + 1
        if len(h) < slots:  # the pads: one run attending to itself (outputs dropped, no label)
            runs_q.append(slots)
            keys.append(r * slots + np.arange(len(h), slots))
        lens_q = np.diff(runs_q)
        lens_k = [len(x) for x in keys]
        shards.append(
            CPShard(
                index=torch.from_numpy(index[r].copy()),
                cu_seqlens_q=torch.tensor(runs_q, dtype=torch.int32),
                key_index=torch.from_numpy(np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)),
                cu_seqlens_k=torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32),
                max_q=int(max(lens_q, default=1)),
                max_k=int(max(lens_k, default=1)),
                doc_q=torch.from_numpy(doc_all[r].copy()),
                pos_q=torch.from_numpy(np.asarray(pos_all[r]).copy()),
                doc_all=torch.from_numpy(doc_all.reshape(-1).copy()),
                pos_all=torch.from_numpy(np.asarray(pos_all).reshape(-1).copy()),
                slots=slots,
                cp=cp,
                rank=r,
                pairs=float((pos_all[r][index[r] >= 0] + 1).sum()),
            )
        )
    return shards


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """``targets[t] = labels[t + 1]`` (the token position ``t`` predicts); the last position predicts nothing."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


@dataclass
class ShardedBatch(Batch):
    """One rank's share of a packed row (``shard_batch``): its tokens, their positions and their SHIFTED targets
    (``labels[t]`` is what position ``t`` predicts: the label of a rank's first token is predicted by the
    previous rank's last position), the row's ``cu_seqlens``, and ``shard``, the model's ``layout``."""

    shard: CPShard | None = None

    def to(self, device: torch.device) -> ShardedBatch:
        moved = super().to(device)
        moved.shard = self.shard.to(device)
        return moved

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "layout": self.shard}


def shard_batch(batch: Batch, cp: int, rank: int, split: str, group, kernel: str) -> ShardedBatch:
    """This rank's share of a packed batch: its tokens, their positions and their *shifted* targets. The
    counts are this rank's share too, so summed over the group every token is counted once; the
    per-example counts (examples, attention pairs, the padded counterfactual) stay on the group's first rank.
    ``group`` and ``kernel``: the CP group and the attention backend the shard's attention runs with."""
    shard = dataclasses.replace(plan_shards(batch.cu_seqlens.tolist(), cp, split)[rank], group=group, kernel=kernel)
    take = shard.index.clamp(min=0)
    pad = shard.index < 0
    targets = shifted_targets(batch.labels)[0, take].masked_fill(pad, IGNORE_INDEX)[None]
    first = rank == 0
    return ShardedBatch(
        input_ids=batch.input_ids[0, take].masked_fill(pad, 0)[None],
        labels=targets,
        position_ids=batch.position_ids[0, take].masked_fill(pad, 0)[None],
        cu_seqlens=batch.cu_seqlens,  # the global row's boundaries (metrics; the hash check)
        max_seqlen=batch.max_seqlen,
        num_examples=batch.num_examples if first else 0,
        num_tokens=int((~pad).sum()),
        num_label_tokens=int((targets != IGNORE_INDEX).sum()),
        num_positions=shard.slots,
        padded_positions=batch.padded_positions if first else 0,
        sum_squared_lengths=batch.sum_squared_lengths if first else 0,
        example_ids=batch.example_ids if first else [],
        shard=shard,
    )


def row_hash(cu_seqlens: torch.Tensor) -> int:
    """A 62-bit hash of a row's boundaries: every rank of a CP group must hold the same row."""
    digest = hashlib.sha256(cu_seqlens.to(torch.int64).cpu().numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def row_lengths(bin_: np.ndarray, lengths: np.ndarray) -> list[int]:
    """Segment lengths of a bin: whole examples (1-D indices) or pieces (``(example, start, end)`` rows)."""
    bin_ = np.asarray(bin_)
    if bin_.ndim == 2:
        return [int(e - s) for _, s, e in bin_]
    return [int(n) for n in lengths[bin_]]


def split_skew(rows: list[list[int]], cp: int, split: str) -> float:
    """Mean over rows of the group's attention-cost skew (max rank / mean rank - 1) for ``split``."""
    skews = []
    for lengths in rows:
        cost = attention_cost(lengths, cp, split)
        if cost.mean() > 0:
            skews.append(cost.max() / cost.mean() - 1)
    return float(np.mean(skews)) if skews else 0.0
