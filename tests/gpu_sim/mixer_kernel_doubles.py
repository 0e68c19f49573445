"""CPU stand-ins for the varlen kernels of token mixers, so the ``varlen_kernels`` route runs in CI.

``install(monkeypatch)`` puts pure-torch doubles in ``sys.modules`` under the packages' own paths, with the
signatures ``trainer.model.mixer_kernels`` calls:

- ``causal_conv1d.causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
  return_final_states=False, final_states_out=None, activation=None)`` (causal-conv1d 1.5): ``x`` ``[B, D, T]``,
  ``weight`` ``[D, W]``; with ``seq_idx`` (``[B, T]`` int32) ``x`` must be channel-last (stride 1 along ``D``, as
  the CUDA extension checks), no initial or final states; activation ``None``, ``silu`` or ``swish``. A tap
  reaches back only within its token's sequence.
- ``fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
  output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, head_first=False)`` and
  ``fla.ops.kda.chunk_kda`` (the same, ``g`` per key channel ``[B, T, H, K]``): ``[B, T, H, ...]`` inputs of
  one dtype, not float32 (fla asserts it; ``ACCEPT_FP32`` lifts it for exact plumbing checks), ``beta``
  ``[B, T, H]``; with ``cu_seqlens`` (int64) a batch of one row; value heads may be a multiple of the key
  heads. The state starts at zero at every ``cu_seqlens`` offset.
- ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None,
  dt_bias=None, initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0, inf),
  return_final_states=False, return_varlen_states=False)`` (mamba_ssm 2.2): ``x`` ``[B, T, H, P]``, ``dt``
  ``[B, T, H]``, ``B`` / ``C`` ``[B, T, G, N]``; the state starts at zero wherever ``seq_idx`` changes.

Each computes the documented recurrence token by token (float32, or float64 for float64 inputs) and
counts its calls and the boundaries it was handed (``CALLS``). What only a GPU shows: the kernels' speed,
their chunked numerics and their own checks beyond these.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections import Counter

import torch
import torch.nn.functional as F

ACCEPT_FP32 = True
"""fla's kernels refuse float32; the doubles accept it (and float64) unless a test sets this False."""
CALLS: Counter = Counter()
"""Calls per kernel, and ``<kernel>:bounded`` for those handed the boundaries."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _starts(seq_idx: torch.Tensor | None, cu_seqlens: torch.Tensor | None, total: int) -> set[int]:
    """Token positions where a sequence starts (the state is zeroed there)."""
    if cu_seqlens is not None:
        return set(cu_seqlens[:-1].tolist())
    if seq_idx is not None:
        idx = seq_idx.tolist()
        return {0} | {t for t in range(1, total) if idx[t] != idx[t - 1]}
    return {0}


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    CALLS["causal_conv1d_fn"] += 1
    _check(activation in (None, "silu", "swish"), "activation must be None, silu, or swish")
    _check(
        x.dim() == 3 and weight.dim() == 2 and weight.shape[0] == x.shape[1],
        "x (batch, dim, seqlen), weight (dim, width)",
    )
    if seq_idx is not None:
        CALLS["causal_conv1d_fn:bounded"] += 1
        _check(x.stride(1) == 1, "seq_idx is only supported for channel last layout")
        _check(
            seq_idx.dtype == torch.int32 and tuple(seq_idx.shape) == (x.shape[0], x.shape[2]),
            "seq_idx (batch, seqlen) int32",
        )
        _check(initial_states is None and not return_final_states, "initial_states must be None if seq_idx is not None")
    dtype = _compute_dtype(x)
    xs, w = x.to(dtype), weight.to(dtype)
    width, seqlen = w.shape[1], x.shape[2]
    out = torch.zeros_like(xs) if bias is None else bias.to(dtype)[None, :, None].expand_as(xs).clone()
    same = seq_idx if seq_idx is not None else torch.zeros(x.shape[0], seqlen, dtype=torch.int32, device=x.device)
    for k in range(width):
        shift = width - 1 - k
        if shift >= seqlen:
            continue
        shifted = F.pad(xs, (shift, 0))[..., :seqlen]
        keep = torch.ones_like(same, dtype=torch.bool)
        if shift:
            keep[:, :shift] = False
            keep[:, shift:] = same[:, shift:] == same[:, :-shift]
        out = out + w[None, :, k, None] * shifted * keep[:, None, :]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out.to(x.dtype)


def _delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    use_qk_l2norm_in_kernel,
    cu_seqlens,
    name: str,
    per_channel: bool,
):
    CALLS[name] += 1
    _check(q.dtype == k.dtype == v.dtype, "q, k, v must share a dtype")
    _check(ACCEPT_FP32 or q.dtype != torch.float32, f"{name} does not support float32. Please use bfloat16.")
    _check(beta.dim() == 3, "beta must be of shape [B, T, H]")
    _check(g.dim() == (4 if per_channel else 3), f"g must be of shape {'[B, T, H, K]' if per_channel else '[B, T, H]'}")
    if cu_seqlens is not None:
        CALLS[f"{name}:bounded"] += 1
        _check(q.shape[0] == 1, "The batch size is expected to be 1 when using `cu_seqlens`.")
        _check(
            cu_seqlens.dtype == torch.long and int(cu_seqlens[-1]) == q.shape[1], "cu_seqlens: int64 offsets of the row"
        )
    _check(initial_state is None, "the double has no initial state")
    dtype = _compute_dtype(q)
    heads = v.shape[2]
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if q.shape[2] != heads:  # value heads a multiple of the key heads
        q, k = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (q, k))
        if per_channel and g.shape[2] != heads:
            g = g.repeat_interleave(heads // g.shape[2], dim=2)
    if use_qk_l2norm_in_kernel:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    batch, total = q.shape[:2]
    starts = _starts(None, cu_seqlens, total)
    outs = []
    state = None
    for t in range(total):
        if t in starts or state is None:
            state = q.new_zeros(batch, heads, k.shape[-1], v.shape[-1])
        decay = g[:, t].exp()
        state = state * (decay[..., None] if per_channel else decay[..., None, None])
        predicted = (state * k[:, t, :, :, None]).sum(-2)
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, t, :, :, None]).sum(-2))
    final = state if output_final_state else None
    return torch.stack(outs, dim=1).to(v.dtype), final


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    head_first=False,
):
    return _delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        use_qk_l2norm_in_kernel,
        cu_seqlens,
        "chunk_gated_delta_rule",
        per_channel=False,
    )


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **kwargs,
):
    return _delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        use_qk_l2norm_in_kernel,
        cu_seqlens,
        "chunk_kda",
        per_channel=True,
    )


def mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    return_varlen_states=False,
):
    CALLS["mamba_chunk_scan_combined"] += 1
    batch, total, heads, head_dim = x.shape
    _check(
        tuple(dt.shape) == (batch, total, heads) and tuple(A.shape) == (heads,),
        "dt (batch, seqlen, nheads), A (nheads)",
    )
    _check(
        B.shape == C.shape and B.shape[:2] == (batch, total) and heads % B.shape[2] == 0,
        "B, C (batch, seqlen, ngroups, dstate)",
    )
    _check(isinstance(chunk_size, int) and chunk_size > 0, "chunk_size: int")
    _check(
        initial_states is None and not return_final_states and not return_varlen_states,
        "the double has no states in or out",
    )
    if seq_idx is not None:
        CALLS["mamba_chunk_scan_combined:bounded"] += 1
        _check(seq_idx.dtype == torch.int32 and tuple(seq_idx.shape) == (batch, total), "seq_idx (batch, seqlen) int32")
    dtype = _compute_dtype(x)
    xs, dt, B, C = (t.to(dtype) for t in (x, dt, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    B, C = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))  # [b, t, h, n]
    starts = _starts(seq_idx[0] if seq_idx is not None else None, None, total)
    _check(seq_idx is None or batch == 1, "the double takes seq_idx with one row")
    state, outs = None, []
    for t in range(total):
        if t in starts or state is None:
            state = xs.new_zeros(batch, heads, head_dim, B.shape[-1])
        decay = (dt[:, t] * A.to(dtype)).exp()  # [b, h]
        state = state * decay[..., None, None] + (dt[:, t, :, None, None] * xs[:, t, :, :, None] * B[:, t, :, None, :])
        y = (state * C[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + (D.to(dtype)[:, None] if D.dim() == 1 else D.to(dtype)) * xs[:, t]
        if z is not None:
            y = y * F.silu(z[:, t].to(dtype))
        outs.append(y)
    return torch.stack(outs, dim=1).to(x.dtype)


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__dict__.update(attrs)
    return module


def modules(packages: tuple[str, ...] = ("causal_conv1d", "fla", "mamba_ssm")) -> dict[str, types.ModuleType]:
    """The doubles as ``sys.modules`` entries, for the packages named."""
    out = {}
    if "causal_conv1d" in packages:
        out["causal_conv1d"] = _module("causal_conv1d", causal_conv1d_fn=causal_conv1d_fn)
    if "fla" in packages:
        out |= {
            "fla": _module("fla"),
            "fla.ops": _module("fla.ops"),
            "fla.ops.gated_delta_rule": _module(
                "fla.ops.gated_delta_rule", chunk_gated_delta_rule=chunk_gated_delta_rule
            ),
            "fla.ops.kda": _module("fla.ops.kda", chunk_kda=chunk_kda),
        }
    if "mamba_ssm" in packages:
        out |= {
            "mamba_ssm": _module("mamba_ssm"),
            "mamba_ssm.ops": _module("mamba_ssm.ops"),
            "mamba_ssm.ops.triton": _module("mamba_ssm.ops.triton"),
            "mamba_ssm.ops.triton.ssd_combined": _module(
                "mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=mamba_chunk_scan_combined
            ),
        }
    return out


def install(monkeypatch, packages: tuple[str, ...] = ("causal_conv1d", "fla", "mamba_ssm")) -> None:
    """Install the doubles of ``packages`` (undone with ``monkeypatch``) and reset ``CALLS``."""
    for name, module in modules(packages).items():
        monkeypatch.setitem(sys.modules, name, module)
    CALLS.clear()


__all__ = ["CALLS", "causal_conv1d_fn", "chunk_gated_delta_rule", "chunk_kda", "install", "mamba_chunk_scan_combined"]
