"""Attention sinks (transformers' ``s_aux``: gpt-oss, Granite SWA, MiMo-V2-Flash, ...) on packed rows.

A sink is a learned logit per query head that joins every softmax's denominator and attends to nothing::

    out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink_h))  =  attn_i * sigmoid(lse_i - sink_h)

where ``attn`` is plain attention over the example's keys and ``lse_i = log sum_j exp(s_ij)``. Each example
keeps its own denominator, so a backend that keeps examples apart keeps their sinks apart too. Two exact
routes, gradients included (the sink's too):

- **one more key** (``sdpa_with_sinks``: the SDPA backends, any explicit mask): a zero value every query
  sees, whose score is the sink. SDPA scores are ``scale * q.k``, so each head gets one extra dimension:
  ``q' = [q, 1]``, ``k' = [k, 0]``, the sink key ``[0, sink_h / scale]``. Sinks are per query head, so keys
  and values are repeated to the query heads first (GQA).
- **the log-sum-exp** (``rescale_by_sinks``: flex returns a differentiable lse; flash-attn and torch's
  ``varlen_attn`` return one without a gradient, which ``KernelLSE`` supplies through the kernel itself).
  A window cannot take the extra key on a varlen kernel (the sink would have to sit inside every
  query's window), the lse needs nothing from the window.

Softcapping (Gemma 2) with sinks would change the lse's gradient: no family has both, and the kernel
backends refuse the pair.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from trainer.model.packed_layout import AttentionBackendError


def sinks_of(backend: str, kwargs: dict) -> torch.Tensor | None:
    """The ``s_aux`` transformers passed (``None``: the layer has none); refuses sinks with softcapping."""
    sinks = kwargs.get("s_aux")
    if sinks is not None and kwargs.get("softcap") is not None:
        raise AttentionBackendError(
            f"model.attention={backend} cannot combine attention sinks (s_aux) with logit softcapping (softcap)"
        )
    return sinks


def sdpa_with_sinks(q, k, v, mask: torch.Tensor | None, sinks: torch.Tensor, scale: float | None, dropout: float):
    """SDPA of ``q`` ``[B, H, L, D]`` over ``k`` / ``v`` ``[B, Hk, S, D(v)]`` under the boolean ``mask``
    (``[..., L, S]``; ``None``: causal, ``L == S``), every query also seeing one sink key (module doc)."""
    heads, dim = q.shape[1], q.shape[-1]
    if k.shape[1] != heads:  # the sink is per query head: kv head j serves query heads j*g .. (j+1)*g - 1
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = dim**-0.5 if scale is None else scale
    batch, length, keys = q.shape[0], q.shape[2], k.shape[2]
    sink_key = torch.cat([q.new_zeros(heads, dim), (sinks.to(q.dtype) / scale)[:, None]], dim=-1)
    q = torch.cat([q, q.new_ones(batch, heads, length, 1)], dim=-1)
    k = torch.cat([k, k.new_zeros(batch, heads, keys, 1)], dim=-1)
    k = torch.cat([k, sink_key[None, :, None].expand(batch, -1, 1, -1)], dim=2)
    v = torch.cat([v, v.new_zeros(batch, heads, 1, v.shape[-1])], dim=2)
    if mask is None:
        mask = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril()
    mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)


def rescale_by_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out * sigmoid(lse - sink)``: attention ``out`` ``[T, H, D]`` (or ``[1, H, T, D]`` with ``lse``
    ``[1, H, T]``) and its log-sum-exp ``lse`` ``[T, H]``; the share in float32 at least (float64 stays)."""
    shape = (-1, 1) if lse.dim() == 3 else (-1,)  # heads on the lse's dim 1 (flex) or its last (varlen)
    dtype = torch.promote_types(out.dtype, torch.float32)
    share = torch.sigmoid(lse.to(dtype) - sinks.to(dtype).view(shape))
    return out * share.unsqueeze(-1).to(out.dtype)


class KernelLSE(torch.autograd.Function):
    """A varlen kernel's log-sum-exp ``[T, H]``, with the gradient the kernel does not give, from the kernel
    itself (``attend(q, k, v)``: the same attention, ``[T, H, D]`` in, differentiable in ``v``):

    - ``d lse_i / d q_i = scale * sum_j p_ij k_j``: the attention of ``q`` over the keys with the keys as
      values;
    - ``d lse_i / d k_j = scale * sum_i p_ij q_i``: what that attention's values get back for the
      cotangent ``scale * q``;

    so the backward costs one more forward and backward of the kernel."""

    @staticmethod
    def forward(ctx, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, attend: Callable, scale: float):
        ctx.save_for_backward(q, k)
        ctx.attend, ctx.scale = attend, scale
        return lse.detach().clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lse):
        q, k = ctx.saved_tensors
        dtype = torch.promote_types(q.dtype, torch.float32)
        weight = (grad_lse.to(dtype) * ctx.scale).unsqueeze(-1)  # [T, H, 1]
        with torch.enable_grad():
            values = k.detach().requires_grad_()
            over_keys = ctx.attend(q.detach(), k.detach(), values)
            (grad_k,) = torch.autograd.grad(over_keys, values, (weight * q.to(dtype)).to(over_keys.dtype))
        grad_q = (weight * over_keys.detach().to(dtype)).to(q.dtype)
        return None, grad_q, grad_k.to(k.dtype), None, None


@torch.compiler.disable  # dynamo cannot trace an autograd.Function whose backward calls a closure: a graph break
def kernel_lse(lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, attend: Callable, scale: float) -> torch.Tensor:
    """``KernelLSE``: the kernel's log-sum-exp (``[H, T]``, flash-attn's and ``varlen_attn``'s varlen layout) as
    ``[T, H]``, differentiable in ``q`` and ``k``."""
    tokens, heads = q.shape[0], q.shape[1]
    if tuple(lse.shape) == (heads, tokens):
        lse = lse.transpose(0, 1)
    elif tuple(lse.shape) != (tokens, heads):
        raise AttentionBackendError(
            f"the kernel's log-sum-exp has shape {tuple(lse.shape)}, not [heads, tokens] = {(heads, tokens)}"
        )
    return KernelLSE.apply(lse, q, k, attend, scale)


__all__ = ["KernelLSE", "kernel_lse", "rescale_by_sinks", "sdpa_with_sinks", "sinks_of"]
