"""CPU kernels for the aten ops under ``torch.nn.attention.varlen.varlen_attn``, so its real Python runs here.

``varlen_attn`` is torch's own Python: argument checks (GQA heads, ``enable_gqa`` where the torch has it),
``is_causal`` derived from the window, a ``torch.library`` custom op with its autograd formula. Underneath
it calls ``aten::_flash_attention_forward`` / ``aten::_flash_attention_backward``, which have CUDA kernels
only. ``registered()`` adds CPU kernels for those two ops for as long as it is entered, so everything
above them runs unchanged. The kernels are PyTorch's vendored copy of flash-attn's ``mha_varlen_fwd``:
the CPU kernels reuse the flash-attn double's checks and fp32 reference (``flash_attn_double.varlen_fwd``),
so the same contract is enforced (fp16/bf16, one dtype, int32 ``cu_seqlens``, head_dim % 8, ...).

The logsumexp output (``return_aux=AuxRequest(lse=True)``) is the reference's, ``[heads, total_q]`` float32,
without a gradient of its own (torch's backward ignores it). Not simulated: backward recomputes the forward
through autograd instead of using the saved output and logsumexp. What only a real GPU shows is as
for the flash-attn double: speed, memory, the kernel's own rounding, NCCL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tests.gpu_sim.flash_attn_double import autograd_inside_kernel, varlen_fwd


def _kernel(
    query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale, left, right, return_lse=False
):
    if cum_seq_q is None or cum_seq_k is None:
        raise NotImplementedError("the varlen double simulates the varlen path only (cum_seq_q/k given)")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    left, right = (-1 if w is None else w for w in (left, right))
    return varlen_fwd(
        query,
        key,
        value,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        scale,
        is_causal,
        left,
        right,
        return_lse=return_lse,
    )


def _forward(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
):
    if seqused_k is not None or alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("the varlen double simulates no seqused_k, alibi or paged KV")
    out, lse = _kernel(
        query,
        key,
        value,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        scale,
        window_size_left,
        window_size_right,
        return_lse=True,
    )
    return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)


def _backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    rng_state,
    unused,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
):
    with autograd_inside_kernel():
        q, k, v = (x.detach().requires_grad_() for x in (query, key, value))
        recomputed = _kernel(
            q,
            k,
            v,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            is_causal,
            scale,
            window_size_left,
            window_size_right,
        )
        return torch.autograd.grad(recomputed, (q, k, v), grad_out)


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """CPU kernels for ``aten::_flash_attention_forward/backward`` while entered (removed on exit)."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("_flash_attention_forward", _forward, "CPU")
        lib.impl("_flash_attention_backward", _backward, "CPU")
        yield
    finally:
        lib._destroy()
