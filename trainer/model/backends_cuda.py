"""GPU backends for packed rows: flash-attn's varlen kernel, torch's varlen_attn, FlexAttention.

Each takes transformers' attention signature (``query`` ``[1, heads, T, head_dim]``) and returns
``[1, T, heads, head_dim]``. Each has an ``*_unavailable(device, dtype)`` that says, in one line, why it
cannot run here (or ``None``): ``resolve_backend`` calls it before any model is built.

Sliding windows map onto the kernels' ``window_size=(left, right)``: transformers' window ``W`` (the last
``W`` tokens, itself included) is ``(W - 1, 0)``; plain causal is ``(-1, 0)``. The kernels work per
example (``cu_seqlens``), so the window never leaves its example.

Attention sinks (``s_aux``) rescale each query's output by ``sigmoid(lse - sink)`` (``trainer.model.sinks``):
flex returns a differentiable log-sum-exp; flash-attn and ``varlen_attn`` return one without a gradient,
which ``kernel_lse`` gives through the kernel (one more kernel forward and backward in the backward pass).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from trainer.model.attention_needs import refuse_unhonoured
from trainer.model.packed_layout import AttentionBackendError, PackedLayout, allowed, packed_args
from trainer.model.sinks import kernel_lse, rescale_by_sinks, sinks_of

log = logging.getLogger(__name__)

HALF = (torch.bfloat16, torch.float16)


def _needs_cuda(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"it needs a CUDA GPU and this run is on {device.type}"
    return None


def _needs_half(dtype: torch.dtype | None, what: str) -> str | None:
    if dtype is not None and dtype not in HALF:
        return f"{what} kernels compute in bfloat16/float16 only, and the compute dtype is {str(dtype).split('.')[-1]}"
    return None


def _needs_sm80(device: torch.device) -> str | None:
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"its flash kernels need an Ampere or newer GPU (sm80+), this one is sm{major}{minor}"
    return None


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, D]`` -> ``[T, H, D]`` (the varlen kernels' layout)."""
    return x[0].transpose(0, 1)


def _window_size(window: int | None) -> tuple[int, int]:
    return (-1, 0) if window is None else (window - 1, 0)


def _one_compute_dtype(query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v in the one dtype the kernels compute in.

    The kernels take a single dtype for all three (flash-attn raises "FlashAttention only support fp16 and
    bf16 data type", flex's backward refuses mixed dtypes), and autocast does not cast the inputs of custom
    ops. Yet under autocast with fp32 master weights, Qwen2/Llama's rotary cos/sin stay fp32, so q and k
    arrive fp32 while v is bf16. The compute dtype is autocast's when it is on; otherwise v's, because v
    comes straight from its projection (the weights' dtype) while rotary or q/k norms may have upcast q
    and k. The output stays in that dtype: it is what transformers' own SDPA path returns under autocast,
    and what the output projection computes in without it, so there is nothing to cast back.
    """
    device_type = query.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else value.dtype
    return query.to(dtype), key.to(dtype), value.to(dtype)


# ------------------------------------------------------------------------------------------------ flash-attn
def flash_attn_unavailable(device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    missing = importlib.util.find_spec("flash_attn") is None
    install = "pip install 'packfsdp[flash]'"
    if reason := _needs_cuda(device):
        return reason + (f"; flash-attn is also not installed ({install})" if missing else "")
    if missing:
        return f"the flash-attn package is not installed ({install}), or choose model.attention=torch_varlen"
    return _needs_sm80(device) or _needs_half(dtype, "flash-attn")


def flash_attn_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """flash-attn's ``flash_attn_varlen_func`` (GQA native; dropout, logit softcapping and sinks supported)."""
    refuse_unhonoured("flash_attn", kwargs, softcap=True, sinks=True)
    sinks = sinks_of("flash_attn", kwargs)
    query, key, value = _one_compute_dtype(query, key, value)
    from flash_attn import flash_attn_varlen_func  # noqa: PLC0415 -- an optional extra, CUDA only

    args = packed_args(module, query, key, kwargs)
    cu = args.cu_seqlens.to(device=query.device, dtype=torch.int32)
    softcap = kwargs.get("softcap")
    options = dict(causal=True, window_size=_window_size(args.window), softmax_scale=scaling)
    q, k, v = _flat(query), _flat(key), _flat(value)

    def attend(q, k, v, **extra):  # no dropout
        return flash_attn_varlen_func(q, k, v, cu, cu, args.max_seqlen, args.max_seqlen, **options, **extra)

    # With dropout, return_attn_probs would also return the dropout mask, [examples, heads, L, L]: the lse then
    # comes from a call without dropout (it does not depend on the dropout).
    with_lse = sinks is not None and dropout == 0
    out = flash_attn_varlen_func(
        q,
        k,
        v,
        cu,
        cu,
        args.max_seqlen,
        args.max_seqlen,
        dropout_p=dropout,
        softcap=0.0 if softcap is None else float(softcap),  # flash-attn's "off" is 0
        return_attn_probs=with_lse,
        **options,
    )
    if sinks is not None:
        if with_lse:
            out, lse, _ = out
        else:
            with torch.no_grad():
                lse = attend(q, k, v, return_attn_probs=True)[1]
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        out = rescale_by_sinks(out, kernel_lse(lse, q, k, attend, scale), sinks)  # lse: [heads, tokens], no gradient
    return out.unsqueeze(0), None


# ---------------------------------------------------------------------------------------------- torch varlen
def torch_varlen_unavailable(device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    if varlen_attn_parameters() is None:
        return (
            f"torch {torch.__version__.split('+')[0]} has no torch.nn.attention.varlen.varlen_attn (it came in "
            "torch 2.10); upgrade torch or choose model.attention=flash_attn/flex"
        )
    if reason := _needs_cuda(device):
        return reason
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention kernels"
    return _needs_sm80(device) or _needs_half(dtype, "torch varlen_attn")


def torch_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``torch.nn.attention.varlen.varlen_attn`` (no extra dependency; sinks where it returns the
    log-sum-exp; no dropout or softcapping)."""
    refuse_unhonoured("torch_varlen", kwargs, sinks=True)
    sinks = sinks_of("torch_varlen", kwargs)
    query, key, value = _one_compute_dtype(query, key, value)
    from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415 -- absent before torch 2.10; tests swap it on its module

    if dropout > 0:
        raise AttentionBackendError(
            f"torch_varlen has no attention dropout but the model asks for {dropout}; set the model's attention "
            "dropout to 0 or choose model.attention=flash_attn/flex"
        )
    if sinks is not None and (reason := torch_varlen_sinks_unavailable()):
        raise AttentionBackendError(
            f"model.attention=torch_varlen cannot honour the model's attention sinks (s_aux): {reason}"
        )
    args = packed_args(module, query, key, kwargs)
    cu = args.cu_seqlens.to(device=query.device, dtype=torch.int32)
    (q, k, v), options = varlen_attn_inputs(_flat(query), _flat(key), _flat(value), scaling, args.window)

    def attend(q, k, v, **extra):
        return varlen_attn(q, k, v, cu, cu, args.max_seqlen, args.max_seqlen, **options, **extra)

    if sinks is None:
        return attend(q, k, v).unsqueeze(0), None
    from torch.nn.attention.varlen import AuxRequest as VarlenAuxRequest  # noqa: PLC0415 -- absent before torch 2.10; tests swap it on its module

    out, lse = attend(q, k, v, return_aux=VarlenAuxRequest(lse=True))  # lse: [heads, tokens], no gradient
    scale = options.get("scale") or q.shape[-1] ** -0.5  # torch 2.10 folds any other scale into q
    return rescale_by_sinks(out, kernel_lse(lse, q, k, attend, scale), sinks).unsqueeze(0), None


def torch_varlen_sinks_unavailable() -> str | None:
    """Why this torch's ``varlen_attn`` cannot apply attention sinks (it returns no log-sum-exp), or None."""
    if "return_aux" not in (varlen_attn_parameters() or ()):
        version = torch.__version__.split("+")[0]
        return f"torch {version}'s varlen_attn returns no log-sum-exp; use model.attention=flash_attn/flex"
    return None


# A plain dict, not functools.cache: torch.compile traces through a cache wrapper (with a warning) but reads
# a filled dict as a constant.
_varlen_attn_signature: dict[str, frozenset[str] | None] = {}


def varlen_attn_parameters() -> frozenset[str] | None:
    """The parameter names of this torch's ``varlen_attn``, or ``None`` if it has none (torch < 2.10).

    Read once from the real signature, not the version string: 2.10 takes ``is_causal`` (no scale, no
    window); 2.11 adds keyword-only ``scale`` and ``window_size``; 2.12 adds ``enable_gqa``.
    """
    if "names" not in _varlen_attn_signature:
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415 -- absent before torch 2.10; tests swap it on its module
        except ImportError:
            _varlen_attn_signature["names"] = None
        else:
            _varlen_attn_signature["names"] = frozenset(inspect.signature(varlen_attn).parameters)
    return _varlen_attn_signature["names"]


def varlen_attn_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, window: int | None
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], dict]:
    """``[T, heads, D]`` q/k/v and the keyword arguments this torch's ``varlen_attn`` takes."""
    names = varlen_attn_parameters() or frozenset()
    options: dict = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in names:
            options["enable_gqa"] = True
        else:
            # torch 2.10/2.11 document equal head counts: repeat each kv head for its group of query heads,
            # the grouping of transformers' repeat_kv (kv head j serves query heads j*g .. (j+1)*g - 1).
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if "window_size" in names:
        options.update(scale=scale, window_size=_window_size(window))
        return (q, k, v), options
    if window is not None:
        raise AttentionBackendError(
            f"torch {torch.__version__.split('+')[0]}'s varlen_attn has no sliding window (a window of {window} "
            "tokens here): use torch >= 2.11 or model.attention=flash_attn/flex"
        )
    if scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5):
        q = q * (scale * q.shape[-1] ** 0.5)  # torch 2.10 always scales by 1/sqrt(head_dim): fold the rest into q
    options["is_causal"] = True
    return (q, k, v), options


# Read now, at import: filled inside a compiled block, the dict would change under dynamo's guard on it and
# recompile the block that runs next.
varlen_attn_parameters()


# --------------------------------------------------------------------------------------------------- flex
def flex_unavailable(device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    if device.type == "cpu":
        # FlexAttention runs forward on CPU but has no backward there: training would fail at step 1.
        version = torch.__version__.split("+")[0]
        return f"FlexAttention has no backward pass on CPU in torch {version}, so it cannot train here"
    return _needs_cuda(device)


_compiled_flex = None


def _flex_fn(device: torch.device):
    """Compiled flex_attention on GPU (the eager path materialises scores); eager elsewhere (tests)."""
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


# One score_mod per cap value, reused: a fresh closure per call would be a new function to the compiled flex.
_softcap_mods: dict[float, object] = {}


def softcap_score_mod(softcap: float):
    """Gemma2's attention logit softcapping as a flex ``score_mod``: ``softcap * tanh(score / softcap)`` on
    the scaled scores, as transformers' eager and flex paths apply it."""
    if softcap not in _softcap_mods:

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

        _softcap_mods[softcap] = score_mod
    return _softcap_mods[softcap]


def flex_block_mask(cu_seqlens: torch.Tensor, window: int | None, device: torch.device) -> BlockMask:
    """The document-causal (sliding-window) BlockMask of a packed row, built once per forward."""
    layout = PackedLayout.of(cu_seqlens)

    def make() -> BlockMask:
        lengths = torch.tensor(layout.lengths, device=device)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        starts = torch.repeat_interleave(cu_seqlens[:-1].to(device=device, dtype=torch.long), lengths)
        pos = torch.arange(layout.total, device=device) - starts

        def document_causal(b, h, q_idx, kv_idx):
            return allowed(doc[q_idx], pos[q_idx], doc[kv_idx], pos[kv_idx], window)

        return create_block_mask(document_causal, None, None, layout.total, layout.total, device=device)

    return layout.cached(f"flex:{window}:{device}", make)


def flex_attention_backend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """FlexAttention with a document-causal block mask (blocks between examples are skipped entirely);
    logit softcapping as a ``score_mod``; sinks through its differentiable log-sum-exp."""
    refuse_unhonoured("flex", kwargs, softcap=True, sinks=True)
    sinks = sinks_of("flex", kwargs)
    query, key, value = _one_compute_dtype(query, key, value)
    if dropout > 0:
        raise AttentionBackendError(
            f"flex has no attention dropout but the model asks for {dropout}; set it to 0 or use flash_attn"
        )
    args = packed_args(module, query, key, kwargs)
    block_mask = flex_block_mask(args.cu_seqlens, args.window, query.device)
    softcap = kwargs.get("softcap")
    out = _flex_fn(query.device)(
        query,
        key,
        value,
        block_mask=block_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        score_mod=None if softcap is None else softcap_score_mod(float(softcap)),
        **({} if sinks is None else {"return_aux": AuxRequest(lse=True)}),
    )
    if sinks is not None:
        out, aux = out
        out = rescale_by_sinks(out, aux.lse, sinks)  # lse: [1, heads, tokens]
    return out.transpose(1, 2).contiguous(), None


# ------------------------------------------------------------------------------- query runs against their keys
def flash_attn_query_runs(
    query, key, value, cu_q, cu_k, max_q: int, max_k: int, scaling, dropout, window, softcap=None
) -> torch.Tensor:
    """flash-attn's varlen kernel with separate boundaries (``cu_q != cu_k``: each run of queries the last of
    its keys, bottom-right causal). ``query`` ``[1, H, S, D]``, keys back to back ``[1, Hkv, K, D]``; returns
    ``[1, S, H, D]``. A context-parallel shard's queries against the row's gathered keys."""
    from flash_attn import flash_attn_varlen_func  # noqa: PLC0415 -- an optional extra, CUDA only

    q, k, v = _one_compute_dtype(query, key, value)
    cq, ck = cu_q.to(device=q.device, dtype=torch.int32), cu_k.to(device=q.device, dtype=torch.int32)
    out = flash_attn_varlen_func(
        _flat(q),
        _flat(k),
        _flat(v),
        cq,
        ck,
        max_q,
        max_k,
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=True,
        window_size=_window_size(window),
        softcap=0.0 if softcap is None else float(softcap),
    )
    return out.unsqueeze(0)


def torch_varlen_query_runs(query, key, value, cu_q, cu_k, max_q: int, max_k: int, scaling, window) -> torch.Tensor:
    """``varlen_attn`` with separate boundaries, as ``flash_attn_query_runs``."""
    from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415 -- absent before torch 2.10; tests swap it on its module

    q, k, v = _one_compute_dtype(query, key, value)
    cq, ck = cu_q.to(device=q.device, dtype=torch.int32), cu_k.to(device=q.device, dtype=torch.int32)
    (fq, fk, fv), options = varlen_attn_inputs(_flat(q), _flat(k), _flat(v), scaling, window)
    return varlen_attn(fq, fk, fv, cq, ck, max_q, max_k, **options).unsqueeze(0)


def flex_query_block_mask(doc_q, pos_q, doc_k, pos_k, window, device) -> BlockMask:
    """The BlockMask of queries at global (example, position) ``doc_q``/``pos_q`` against keys at ``doc_k``/``pos_k``:
    each query sees the keys its example and position allow (``allowed``). Made once per forward by the caller
    (``trainer.parallel.cp_attention``), not per layer."""
    dq, pq, dk, pk = (t.to(device) for t in (doc_q, pos_q, doc_k, pos_k))

    def mask(b, h, q_idx, kv_idx):
        return allowed(dq[q_idx], pq[q_idx], dk[kv_idx], pk[kv_idx], window)

    return create_block_mask(mask, None, None, len(dq), len(dk), device=device)


def flex_query_runs(query, key, value, block_mask: BlockMask, scaling, softcap=None) -> torch.Tensor:
    """FlexAttention of ``query`` ``[1, H, S, D]`` against ``key``/``value`` ``[1, Hkv, K, D]`` under
    ``block_mask`` (``flex_query_block_mask``). Returns ``[1, S, H, D]``."""
    q, k, v = _one_compute_dtype(query, key, value)
    out = _flex_fn(q.device)(
        q,
        k,
        v,
        block_mask=block_mask,
        scale=scaling,
        enable_gqa=q.shape[1] != k.shape[1],
        score_mod=None if softcap is None else softcap_score_mod(float(softcap)),
    )
    return out.transpose(1, 2).contiguous()
