"""A CPU stand-in for compiled FlexAttention with a backward, so the ``flex`` backend's gradients run in CI.

torch's FlexAttention runs forward on CPU but has no backward there (``flex_unavailable``). ``install``
makes ``backends_cuda._flex_fn`` return ``flex_attention_double``: ``flex_attention``'s signature and
results computed densely with plain torch ops under autograd, in the inputs' dtype: the block mask's
``mask_mod`` evaluated on every (query, key) pair, ``score_mod`` on the scaled scores, GQA as
``enable_gqa`` maps heads (query head ``h`` uses key/value head ``h // (H / Hkv)``), and, with
``return_aux=AuxRequest(lse=True)``, ``(out, AuxOutput(lse=[B, H, Q]))`` with the log-sum-exp in natural
log and its gradient, as the GPU kernel's backward takes ``grad_logsumexp``. A query with no key gets 0
and an lse of ``-inf``.

What only a GPU shows: the Triton kernels, their block sparsity and rounding, compile.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import AuxOutput, BlockMask


def flex_attention_double(
    query,
    key,
    value,
    score_mod=None,
    block_mask: BlockMask | None = None,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    kernel_options=None,
    *,
    return_aux=None,
):
    batch, heads, q_len, dim = query.shape
    if key.shape[1] != heads:
        if not enable_gqa:
            raise ValueError("flex_attention needs enable_gqa=True for fewer key/value heads than query heads")
        group = heads // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scale = dim**-0.5 if scale is None else scale
    scores = query @ key.transpose(-1, -2) * scale
    b, h, q_idx, kv_idx = (
        torch.arange(n).view(*[-1 if i == j else 1 for j in range(4)])
        for i, n in enumerate((batch, heads, q_len, key.shape[2]))
    )
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    if block_mask is not None:
        keep = block_mask.mask_mod(b, h, q_idx, kv_idx).expand_as(scores)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.softmax(scores, dim=-1).nan_to_num(0.0) @ value).to(query.dtype)
    if return_aux is not None and return_aux.lse:
        return out, AuxOutput(lse=lse)
    return (out, lse) if return_lse else out


def install(monkeypatch) -> None:
    """The ``flex`` backend calls the double (undone with ``monkeypatch``)."""
    from trainer.model import backends_cuda

    monkeypatch.setattr(backends_cuda, "_flex_fn", lambda device: flex_attention_double)
