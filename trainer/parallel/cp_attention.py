"""The attention of one rank's shard of a context-parallel row (the "llama3" scheme, ``trainer.parallel.cp_layout``).

Every rank keeps its own queries; keys and values are all-gathered across the CP group (``gather_tokens``;
backward reduce-scatters dK/dV), and each run of local queries attends exactly the keys its example allows,
through the run's attention backend with separate query and key boundaries (``trainer.model.backends_sdpa``
and ``backends_cuda``: ``*_query_runs``). No softmax merge, so no merge numerics: each query's attention is
computed in one call, as in the unsharded row. Registered with transformers as ``CP_ATTENTION``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AttentionInterface

from trainer.model.attention_needs import refuse_unhonoured
from trainer.model.backends_cuda import (
    flash_attn_query_runs,
    flex_query_block_mask,
    flex_query_runs,
    torch_varlen_query_runs,
)
from trainer.model.backends_sdpa import query_runs, sdpa_query_runs
from trainer.model.packed_layout import PackedLayout


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


def cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature under context parallelism (``kwargs['cp_shard']``: this rank's
    ``CPShard``, whose ``group`` and ``kernel``, sdpa_varlen, flash_attn, torch_varlen or flex, it runs with):
    the row's keys/values all-gathered over the group (``gather_tokens``), then the backend's kernel for query
    runs against their keys (``trainer.model.backends_*``: ``*_query_runs``)."""
    shard = kwargs["cp_shard"]
    kernel, group = shard.kernel, shard.group
    if kernel is None:
        raise ValueError("packfsdp: a context-parallel shard without its attention kernel (shard_batch sets it)")
    refuse_unhonoured(f"{kernel} under parallel.cp", kwargs, softcap=True)  # sinks, selections: never ignored
    window = kwargs.get("sliding_window")
    window = int(window) if window is not None and int(window) > 0 else None
    softcap = kwargs.get("softcap")
    k_all, v_all = gather_tokens(key, group), gather_tokens(value, group)
    # The shard's masks and host bounds are made once per forward: kept with the layout of its query boundaries,
    # which every layer of the forward shares (not on the shard: FSDP2 hands the layers copies of it).
    if kernel == "flex":
        block_mask = PackedLayout.of(shard.cu_seqlens_q).cached(
            f"cp-flex:{window}:{query.device}",
            lambda: flex_query_block_mask(shard.doc_q, shard.pos_q, shard.doc_all, shard.pos_all, window, query.device),
        )
        return flex_query_runs(query, k_all, v_all, block_mask, scaling, softcap), None
    k_runs, v_runs = k_all.index_select(2, shard.key_index), v_all.index_select(2, shard.key_index)
    cq, ck = shard.cu_seqlens_q, shard.cu_seqlens_k
    if kernel in ("sdpa_varlen", "sdpa_block_mask"):
        runs = PackedLayout.of(cq).cached(
            f"cp-sdpa:{window}:{query.device}", lambda: query_runs(cq, ck, window, query.device)
        )
        return sdpa_query_runs(query, k_runs, v_runs, runs, scaling, dropout, softcap), None
    if kernel == "flash_attn":
        return flash_attn_query_runs(
            query, k_runs, v_runs, cq, ck, shard.max_q, shard.max_k, scaling, dropout, window, softcap
        ), None
    if kernel == "torch_varlen":
        return torch_varlen_query_runs(query, k_runs, v_runs, cq, ck, shard.max_q, shard.max_k, scaling, window), None
    raise ValueError(f"packfsdp: no context-parallel path for attention backend {kernel!r}")


CP_ATTENTION = "packfsdp_cp"


def register_cp_attention() -> None:
    AttentionInterface.register(CP_ATTENTION, torch.compiler.disable(cp_attention))


register_cp_attention()
