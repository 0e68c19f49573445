"""A CPU stand-in for the flash-attn 2.8.3 extension, so the real CUDA backend code runs in CI.

``install(monkeypatch)`` puts this module's ``flash_attn_varlen_func`` in ``sys.modules["flash_attn"]``;
with ``device.pretend_capable_gpu`` (the backend's CUDA/sm80 predicates patched to pass) the product runs
unchanged: ``flash_attn_unavailable`` still finds the package with ``importlib`` and still refuses fp32
compute, and ``flash_attn_attention`` runs line for line as on a GPU.

The double has the real package's two layers:

- ``flash_attn_varlen_func`` does what flash-attn's Python wrapper does (``flash_attn_interface.py``):
  the default ``softmax_scale`` is ``head_dim ** -0.5``, a head_dim that is not a multiple of 8 is
  zero-padded and the output cut back, inputs whose last dimension is strided are made contiguous,
  ``max_seqlen_q``/``max_seqlen_k`` must be Python ints (the wrapper is a ``torch.library.custom_op``
  whose schema says ``int``: a tensor is refused), and autocast does not touch its inputs (custom ops have
  no autocast rule), so mixed q/k/v dtypes reach the kernel as they are.
- ``varlen_fwd`` checks what ``mha_varlen_fwd`` in ``csrc/flash_attn/flash_api.cpp`` checks, with its
  messages: q fp16 or bf16, k and v of q's dtype; ``cu_seqlens_q/k`` int32, contiguous, ``batch + 1``
  long; everything on q's device (CUDA there, whatever device here); last-dim stride 1; head_dim at most
  256 and a multiple of 8; query heads divisible by key/value heads; k and v of one shape; softcap and
  dropout not together; ``dropout_p < 1``. It clips the window as the kernel does (``causal`` sets
  ``right = 0``; a side at least ``max_seqlen_k`` long is unbounded, ``-1``). It then computes the
  documented result in fp32 with plain torch, example by example: ``softcap * tanh(q k^T scale /
  softcap)`` when softcap > 0, query ``i`` sees keys ``[i + sk - sq - left, i + sk - sq + right]``
  (``-1``: unbounded), query head ``h`` uses key/value head ``h // (heads / kv_heads)``, a query with no
  key gets 0, dropout on the probabilities; the output is cast to q's dtype. The softmax's log-sum-exp
  (``softmax_lse``, ``[heads, total_q]`` float32, ``+inf`` for a query with no key) comes back with
  ``return_attn_probs=True``, as ``(out, softmax_lse, S_dmask)``, without a gradient of its own.
- Between the two, as in flash-attn (``_flash_attn_varlen_forward`` / ``_backward`` are
  ``torch.library.custom_op``s with fake implementations), the kernel is an opaque op to ``torch.compile``:
  ``flash_attn_double::varlen_fwd`` / ``varlen_bwd``. Dynamo traces the Python wrapper and stops at the op,
  so a compiled block sees here what it sees on a GPU (no host sync inside, ``max_seqlen`` a symbolic int).
  Backward recomputes the forward under autograd with the forward's RNG state (the same dropout mask, as
  the kernel's saved Philox state gives) and returns gradients in the inputs' dtypes.

Stricter than the real kernel, on purpose: ``cu_seqlens`` must start at 0, never decrease and end at the
token count, and ``max_seqlen_*`` must cover the longest example. The kernel trusts those and reads or
leaves garbage when they are wrong; here they raise.

What only a real GPU shows: speed and memory; the kernel's own numerics (bf16 tiles, online softmax, its
rounding differs from this fp32 reference within the tolerances the tests use); the Philox dropout
pattern (here torch's CPU generator draws it); the SM80 check itself; anything about NCCL or several
devices. ``accept_fp32=True`` lifts only the dtype check, so the plumbing around the kernel can be
checked exactly in fp32, which the real kernel cannot do.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from itertools import pairwise

import torch

C = torch._C
VERSION = "2.8.3"
HALF = (torch.float16, torch.bfloat16)


ACCEPT_FP32 = False
"""Lift the fp16/bf16-only check (exact fp32 plumbing tests); everything else is still enforced."""


def _check(condition: bool, message: str) -> None:
    """``TORCH_CHECK``: the C++ extension raises RuntimeError with the message."""
    if not condition:
        raise RuntimeError(message)


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softcap) -> None:
    """The checks of ``mha_varlen_fwd`` (flash_api.cpp, flash-attn 2.8.3), in its order and words."""
    dtypes = HALF + ((torch.float32,) if ACCEPT_FP32 else ())
    _check(q.dtype in dtypes, "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    _check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _check(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check(t.device == q.device, f"{name} must be on CUDA")  # the real kernel: on the one CUDA device
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(cu_seqlens_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    _check(cu_seqlens_k.is_contiguous(), "cu_seqlens_k must be contiguous")
    _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v must be (total, heads, head_size)")
    total_q, num_heads, head_size = q.shape
    num_heads_k = k.shape[1]
    if softcap > 0:
        _check(dropout_p == 0, "Softcapping does not support dropout for now")
    batch_size = cu_seqlens_q.numel() - 1
    _check(batch_size > 0, "batch size must be positive")
    _check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(head_size % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _check(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    _check(
        tuple(k.shape) == (k.shape[0], num_heads_k, head_size), "k must have shape (total_k, num_heads_k, head_size)"
    )
    _check(tuple(v.shape) == tuple(k.shape), "v must have shape (total_k, num_heads_k, head_size)")
    _check(tuple(cu_seqlens_q.shape) == (batch_size + 1,), "cu_seqlens_q must have shape (batch_size + 1)")
    _check(tuple(cu_seqlens_k.shape) == (batch_size + 1,), "cu_seqlens_k must have shape (batch_size + 1)")
    _check(dropout_p < 1, "dropout_p must be below 1")


def _bounds(cu: torch.Tensor, total: int, max_seqlen: int, name: str) -> list[int]:
    """Host copy of ``cu``, checked where the real kernel trusts it (see the module docstring)."""
    bounds = cu.tolist()
    lengths = [e - s for s, e in pairwise(bounds)]
    _check(
        bounds[0] == 0 and bounds[-1] == total and min(lengths) >= 0,
        f"{name} must run from 0 to {total} without decreasing",
    )
    _check(
        max(lengths) <= max_seqlen,
        f"max_seqlen ({max_seqlen}) is below the longest sequence in {name} ({max(lengths)})",
    )
    return bounds


def _attend_one(q, k, v, scale, left, right, softcap, dropout_p) -> torch.Tensor:
    """One example, fp32: ``q`` ``[sq, H, D]``, ``k``/``v`` ``[sk, Hk, D]`` -> ``[sq, H, D]`` and the
    softmax's log-sum-exp ``[H, sq]`` (``+inf`` for a query with no key, as the kernel writes it)."""
    sq, sk, groups = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1).transpose(0, 1) for x in (k, v))  # q head h -> kv head h // groups
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)  # bottom-right aligned, as documented
    j = torch.arange(sk, device=q.device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    masked = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1).masked_fill(~keep.any(-1), float("inf"))
    probs = torch.softmax(masked, dim=-1).nan_to_num(0.0)  # no key: output 0
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    return (probs @ v).transpose(0, 1), lse


def varlen_fwd(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The kernel: ``mha_varlen_fwd``'s checks and window clipping, then the fp32 reference result (with
    ``return_lse``, also the float32 log-sum-exp ``[heads, total_q]``, ``softmax_lse``'s varlen layout)."""
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softcap)
    if max_seqlen_q == 1:
        causal = False  # the kernel's own shortcut: one query row is causal either way
    if causal:
        window_size_right = 0
    if window_size_left >= max_seqlen_k:
        window_size_left = -1
    if window_size_right >= max_seqlen_k:
        window_size_right = -1
    bq = _bounds(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
    bk = _bounds(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    with torch.autocast(q.device.type, enabled=False):  # a kernel is not an autocast op
        outs, lses = zip(
            *[
                _attend_one(
                    q[qs:qe].float(),
                    k[ks:ke].float(),
                    v[ks:ke].float(),
                    softmax_scale,
                    window_size_left,
                    window_size_right,
                    softcap,
                    dropout_p,
                )
                for qs, qe, ks, ke in zip(bq[:-1], bq[1:], bk[:-1], bk[1:], strict=True)
            ],
            strict=True,
        )
    out = torch.cat(outs).to(q.dtype)
    return (out, torch.cat(lses, dim=1)) if return_lse else out


RNG_STATE_BYTES = torch.get_rng_state().numel()


@contextlib.contextmanager
def autograd_inside_kernel() -> Iterator[None]:
    """Gradients inside an op's kernel, which runs below autograd (its dispatch keys excluded): lift that
    exclusion for a kernel that recomputes its forward to differentiate it."""
    exclude = C._dispatch_tls_local_exclude_set().remove(C.DispatchKey.AutogradFunctionality)
    with (
        torch.enable_grad(),
        C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude.remove(C.DispatchKey.ADInplaceOrView)),
    ):
        yield


@torch.library.custom_op("flash_attn_double::varlen_fwd", mutates_args=())
def _varlen_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng_state = torch.get_rng_state()  # before the dropout draws: backward replays them
    out, lse = varlen_fwd(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        return_lse=True,
    )
    return out, lse, rng_state


@_varlen_fwd_op.register_fake
def _(q, k, v, *args):
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    return torch.empty_like(q), lse, q.new_empty(RNG_STATE_BYTES, dtype=torch.uint8)


@torch.library.custom_op("flash_attn_double::varlen_bwd", mutates_args=())
def _varlen_bwd_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rng_state: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return varlen_bwd(
        grad_out,
        q,
        k,
        v,
        rng_state,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
    )


def varlen_bwd(grad_out, q, k, v, rng_state, cu_seqlens_q, cu_seqlens_k, *options):
    """The backward kernel: ``varlen_fwd`` recomputed under autograd with the forward's dropout draws."""
    with autograd_inside_kernel(), torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        out = varlen_fwd(*inputs, cu_seqlens_q, cu_seqlens_k, *options)
        return torch.autograd.grad(out, inputs, grad_out)


@_varlen_bwd_op.register_fake
def _(grad_out, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, *options = inputs
    ctx.save_for_backward(q, k, v, output[2], cu_q, cu_k)
    ctx.options = options


def _backward(ctx, grad_out, grad_lse, grad_rng_state):  # the kernel's lse has no gradient (flash-attn drops it)
    grads = _varlen_bwd_op(grad_out, *ctx.saved_tensors, *ctx.options)
    return (*grads, *[None] * (2 + len(ctx.options)))


_varlen_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _python_int(value, name: str) -> int:
    # The wrapper is a torch.library.custom_op with ``int`` in its schema: a tensor does not bind.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"flash_attn::_flash_attn_varlen_forward() expected {name} to be an int, got {type(value).__name__}"
        )
    return value


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attn's public varlen entry point, as its Python wrapper behaves (see the module docstring); with
    ``return_attn_probs``, ``(out, softmax_lse, S_dmask)``: the lse ``[heads, total_q]`` float32 without a
    gradient of its own (flash-attn's backward ignores it), no dropout mask (``None``)."""
    if alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("the flash-attn double simulates no alibi or paged KV")
    max_seqlen_q, max_seqlen_k = _python_int(max_seqlen_q, "max_seqlen_q"), _python_int(max_seqlen_k, "max_seqlen_k")
    left, right = window_size
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    head_size_og = q.shape[-1]
    pad = (8 - head_size_og % 8) % 8
    q, k, v = (torch.nn.functional.pad(x, [0, pad]) if pad else x for x in (q, k, v))
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out, lse, _ = _varlen_fwd_op(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        float(dropout_p),
        float(softmax_scale),
        bool(causal),
        left,
        right,
        float(softcap),
    )
    out = out[..., :head_size_og]
    return (out, lse, None) if return_attn_probs else out


def as_module() -> types.ModuleType:
    """A fresh ``flash_attn`` module holding the double (``importlib.util.find_spec`` finds its spec)."""
    module = types.ModuleType("flash_attn", "CPU test double of flash-attn (tests/gpu_sim/flash_attn_double.py)")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    module.__version__ = VERSION
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def install(monkeypatch, accept_fp32: bool = False) -> types.ModuleType:
    """Install the double as ``flash_attn`` (undone with ``monkeypatch``; outside pytest use
    ``with pytest.MonkeyPatch.context() as mp: install(mp)``)."""
    module = as_module()
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(sys.modules[__name__], "ACCEPT_FP32", accept_fp32)
    return module
