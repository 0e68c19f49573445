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
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.collate import IGNORE_INDEX, Batch
from trainer.model.mixers import find_token_mixers

CP_SPLITS = ("contiguous", "balanced")


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
    """One rank's share of a packed row and the boundaries its attention needs (host-built, then moved)."""

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

    def to(self, device: torch.device) -> "CPShard":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return CPShard(**moved)


def plan_shards(cu_seqlens: list[int], cp: int, split: str) -> list[CPShard]:
    """Every rank's ``CPShard`` of the row ``cu_seqlens`` (each rank uses its own; all derive the same)."""
    lengths = [e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
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
        shards.append(CPShard(
            index=torch.from_numpy(index[r].copy()),
            cu_seqlens_q=torch.tensor(runs_q, dtype=torch.int32),
            key_index=torch.from_numpy(np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)),
            cu_seqlens_k=torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32),
            max_q=int(max(lens_q, default=1)), max_k=int(max(lens_k, default=1)),
            doc_q=torch.from_numpy(doc_all[r].copy()), pos_q=torch.from_numpy(np.asarray(pos_all[r]).copy()),
            doc_all=torch.from_numpy(doc_all.reshape(-1).copy()),
            pos_all=torch.from_numpy(np.asarray(pos_all).reshape(-1).copy()),
            slots=slots, cp=cp, rank=r, pairs=float((pos_all[r][index[r] >= 0] + 1).sum()),
        ))
    return shards


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """``targets[t] = labels[t + 1]`` (the token position ``t`` predicts); the last position predicts nothing."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def shard_batch(batch: Batch, cp: int, rank: int, split: str) -> Batch:
    """This rank's share of a packed batch: its tokens, their positions and their *shifted* targets. The
    counts are this rank's share too, so summed over the group every token is counted once; the
    per-example counts (examples, attention pairs) stay on the group's first rank."""
    shard = plan_shards(batch.cu_seqlens.tolist(), cp, split)[rank]
    take = shard.index.clamp(min=0)
    pad = shard.index < 0
    targets = shifted_targets(batch.labels)[0, take].masked_fill(pad, IGNORE_INDEX)[None]
    real = int((~pad).sum())
    return Batch(
        input_ids=batch.input_ids[0, take].masked_fill(pad, 0)[None],
        labels=targets,
        position_ids=batch.position_ids[0, take].masked_fill(pad, 0)[None],
        cu_seqlens=batch.cu_seqlens,  # the global row's boundaries (metrics; the hash check)
        max_seqlen=batch.max_seqlen,
        num_examples=batch.num_examples if rank == 0 else 0,
        num_tokens=real,
        num_label_tokens=int((targets != IGNORE_INDEX).sum()),
        num_positions=shard.slots,
        example_ids=batch.example_ids if rank == 0 else [],
        cp_shard=shard,
    )


def row_hash(cu_seqlens: torch.Tensor) -> int:
    """A 62-bit hash of a row's boundaries: every rank of a CP group must hold the same row."""
    digest = hashlib.sha256(cu_seqlens.to(torch.int64).cpu().numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


# ------------------------------------------------------------------------------------------- collectives
class _AllGatherTokens(torch.autograd.Function):
    """``[1, H, S, D]`` per rank -> ``[1, H, C * S, D]`` (rank order); backward reduce-scatters the
    gradient (gloo has no reduce-scatter: there it is an all-reduce and this rank's slice)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        c = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(c)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        c, r = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            parts = list(grad.chunk(c, dim=2))
            out = torch.empty_like(parts[r])
            dist.reduce_scatter(out, [p.contiguous() for p in parts], group=group)
            return out, None
        dist.all_reduce(grad, group=group)
        return grad.chunk(c, dim=2)[r].contiguous(), None


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    return _AllGatherTokens.apply(x, group)


def full_keys_stand_in(full: torch.Tensor):
    """For one process (tests, the GPU check): the "all-gather" returns the whole row's keys/values."""
    return lambda x, group: full


# ------------------------------------------------------------------------------------------- attention
def _lower_right_mask(lq: int, lk: int, window: int | None, device) -> torch.Tensor:
    i = torch.arange(lq, device=device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & (i - j < window)
    return ok


def cp_sdpa(q, k, v, shard: CPShard, scaling, dropout, window, softcap=None):
    """Per query run, SDPA with an explicit bottom-right causal (window) mask. ``k``/``v`` are the runs'
    keys back to back (``[1, Hkv, K, D]``); returns ``[1, S, H, D]``."""
    if softcap is not None:
        raise ValueError("packfsdp: sdpa_varlen cannot softcap attention logits under cp; use flash_attn or flex")
    cq, ck = shard.cu_seqlens_q.tolist(), shard.cu_seqlens_k.tolist()
    outs = []
    for n in range(len(cq) - 1):
        qs, qe, ks, ke = cq[n], cq[n + 1], ck[n], ck[n + 1]
        mask = _lower_right_mask(qe - qs, ke - ks, window, q.device)
        outs.append(F.scaled_dot_product_attention(
            q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], attn_mask=mask, dropout_p=dropout, scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1],
        ))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature under context parallelism (``kwargs['cp_shard']``,
    ``kwargs['cp_group']``, ``kwargs['cp_kernel']``: sdpa_varlen, flash_attn, torch_varlen or flex)."""
    shard: CPShard = kwargs["cp_shard"]
    gather = kwargs.get("cp_gather") or gather_tokens
    group = kwargs.get("cp_group")
    kernel = kwargs.get("cp_kernel", "sdpa_varlen")
    window = kwargs.get("sliding_window")
    window = int(window) if window is not None and int(window) > 0 else None
    softcap = kwargs.get("softcap")
    k_all, v_all = gather(key, group), gather(value, group)
    if kernel == "flex":
        return _cp_flex(query, k_all, v_all, shard, scaling, window, softcap), None
    k_runs, v_runs = k_all.index_select(2, shard.key_index), v_all.index_select(2, shard.key_index)
    if kernel in ("sdpa_varlen", "sdpa_block_mask"):
        return cp_sdpa(query, k_runs, v_runs, shard, scaling, dropout, window, softcap), None
    from trainer.model.backends_cuda import _flat, _one_compute_dtype, _window_size, varlen_attn_inputs

    q, k, v = _one_compute_dtype(query, k_runs, v_runs)
    cq = shard.cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    ck = shard.cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    if kernel == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            _flat(q), _flat(k), _flat(v), cq, ck, shard.max_q, shard.max_k, dropout_p=dropout,
            softmax_scale=scaling, causal=True, window_size=_window_size(window),
            softcap=0.0 if softcap is None else float(softcap),
        )
        return out.unsqueeze(0), None
    if kernel == "torch_varlen":
        from torch.nn.attention.varlen import varlen_attn

        (fq, fk, fv), options = varlen_attn_inputs(_flat(q), _flat(k), _flat(v), scaling, window)
        return varlen_attn(fq, fk, fv, cq, ck, shard.max_q, shard.max_k, **options).unsqueeze(0), None
    raise ValueError(f"packfsdp: no context-parallel path for attention backend {kernel!r}")


def _cp_flex(query, k_all, v_all, shard: CPShard, scaling, window, softcap):
    """FlexAttention on global (example, position): local queries against the whole gathered row."""
    from torch.nn.attention.flex_attention import create_block_mask

    from trainer.model.backends_cuda import _flex_fn, _one_compute_dtype, softcap_score_mod
    from trainer.model.packed_layout import allowed

    q, k, v = _one_compute_dtype(query, k_all, v_all)
    dq, pq = shard.doc_q.to(q.device), shard.pos_q.to(q.device)
    dk, pk = shard.doc_all.to(q.device), shard.pos_all.to(q.device)

    def mask(b, h, q_idx, kv_idx):
        return allowed(dq[q_idx], pq[q_idx], dk[kv_idx], pk[kv_idx], window)

    block_mask = create_block_mask(mask, None, None, q.shape[2], k.shape[2], device=q.device)
    out = _flex_fn(q.device)(
        q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1],
        score_mod=None if softcap is None else softcap_score_mod(float(softcap)),
    )
    return out.transpose(1, 2).contiguous()


CP_ATTENTION = "packfsdp_cp"


def register_cp_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, torch.compiler.disable(cp_attention))


register_cp_attention()


# ------------------------------------------------------------------------------------------- the group
def refuse_unshardable(model: torch.nn.Module, cp: int) -> None:
    """A model that cannot be made exact under cp > 1, refused in one line: length-dependent rope types
    (``dynamic``, ``longrope``) need each example's *global* length, which one rank's shard does not show;
    token mixers outside attention (``trainer.model.mixers``) need the state of the tokens before the shard."""
    from trainer.config import ConfigError
    from trainer.model.rope import length_dependent_rope_modules

    if cp > 1 and (found := length_dependent_rope_modules(model)):
        raise ConfigError(
            f"parallel.cp={cp}: {type(model).__name__}'s rotary embedding {found[0][0]!r} depends on each example's "
            "whole length (dynamic/longrope rope), which a context-parallel shard does not see; use parallel.cp=1"
        )
    if cp > 1 and (mixers := find_token_mixers(model)):
        raise ConfigError(
            f"parallel.cp={cp}: {type(model).__name__}'s {type(mixers[0].module).__name__} ({mixers[0].name}) mixes "
            f"tokens outside attention ({' + '.join(mixers[0].traits)}): its state would have to pass from rank to "
            "rank along the row, which packfsdp does not do; use parallel.cp=1"
        )


def new_cp_group(world_size: int, cp: int, rank: int):
    """This rank's CP group: ranks ``g*C .. g*C + C - 1`` (cp innermost, so a group lives inside a node).
    Every rank creates every group (``new_group`` is collective); ``None`` when ``cp == 1``."""
    if cp == 1:
        return None
    mine = None
    for start in range(0, world_size, cp):
        group = dist.new_group(list(range(start, start + cp)))
        if start <= rank < start + cp:
            mine = group
    return mine


def check_same_row(batch: Batch, group, device: torch.device) -> None:
    """Fail unless every rank of the CP group holds the same row (a hash of its ``cu_seqlens``)."""
    h = torch.tensor([row_hash(batch.cu_seqlens), -row_hash(batch.cu_seqlens)], dtype=torch.float64, device=device)
    dist.all_reduce(h, op=dist.ReduceOp.MAX, group=group)
    if h[0] != -h[1]:
        raise RuntimeError("packfsdp: the ranks of a context-parallel group hold different rows (sampler bug)")


def step_skew(batches: list[Batch], cp: int, device: torch.device) -> float:
    """This step's attention-cost skew of the CP groups: per group, the busiest rank's causal attention pairs
    over the group's mean, minus 1, averaged over groups (each group counted once). One all-reduce."""
    pairs = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    pairs[dist.get_rank()] = sum(b.cp_shard.pairs for b in batches if b.cp_shard is not None)
    dist.all_reduce(pairs)
    groups = pairs.view(-1, cp)
    mean = groups.mean(dim=1)
    busy = mean > 0
    return float((groups.max(dim=1).values[busy] / mean[busy] - 1).mean()) if busy.any() else 0.0


class CPRoute:
    """The startup self-check's route under cp > 1 (``trainer.model.selfcheck.self_check(route=...)``): the
    check row is sharded over the real CP group and run through the CP attention as training runs it; the
    group's logits come back in row order (this rank's own part differentiable, so its backward gives this
    rank's share of the gradient) and the gradient projections are summed over the group."""

    def __init__(self, model: torch.nn.Module, cp: int, rank: int, split: str) -> None:
        self.model, self.cp, self.rank, self.split = model, cp, rank, split

    def __str__(self) -> str:
        return f"context-parallel route: cp={self.cp}, {self.split} split, rank {self.rank} of its group"

    def logits(self, batch: Batch) -> torch.Tensor:
        device = batch.input_ids.device
        shards = plan_shards(batch.cu_seqlens.tolist(), self.cp, self.split)
        local = shard_batch(batch.to("cpu"), self.cp, self.rank, self.split).to(device)
        mine = self.model(**local.model_inputs())[0]  # [S, V]
        parts = [torch.empty_like(mine) for _ in range(self.cp)]
        dist.all_gather(parts, mine.detach().contiguous(), group=self.model.cp_group)
        parts[self.rank] = mine
        gathered = torch.cat(parts)  # [C * S, V] in the group's order
        where = torch.empty(int(batch.cu_seqlens[-1]), dtype=torch.long)
        for r, shard in enumerate(shards):
            real = shard.index >= 0
            where[shard.index[real]] = r * shard.slots + torch.nonzero(real).flatten()
        return gathered[where.to(device)][None]

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=self.model.cp_group)
        return t


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
