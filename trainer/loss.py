"""The training objective's building block: the summed token loss of one micro-batch.

Callers divide by the *global* count of label tokens (all micro-batches of a step, all ranks), so packed,
padded and every world size optimise the same mean token loss. Training, eval and the benchmarks all
use ``summed_token_loss``; the model wrapper computes it (``VarlenCausalLM.token_loss``) so that,
under FSDP2, the LM head's parameters are gathered while it runs.

Two implementations of the same sum (``loss.impl``):

- ``naive``: the model's logits ``[tokens, vocab]``, then ``F.cross_entropy`` on them in fp32. At a 152k
  vocabulary and 16k tokens that is 9.3 GiB per fp32 copy, and training holds several (README).
- ``chunked``: the LM head and the cross-entropy fused, a chunk of label tokens at a time, so full logits
  never exist. Only positions with a label enter the head (the rest have zero gradient anyway). Each chunk's
  gradients (of the hidden states, the head weight and bias) are computed in the forward pass, right after
  its logits, and scaled by the incoming gradient in backward: the same matmuls as naive, no recompute,
  and peak memory of one chunk's logits instead of all of them. The cross-entropy runs in fp32, the head
  weight's gradient accumulates in fp32. On CUDA, Liger's fused linear cross-entropy (same idea, Triton
  kernels) runs instead when it is installed.

The chunked pass is one (``chunked_head_terms``) for every loss made this way: a ``ChunkTerms`` gives a
chunk's sums and their gradient w.r.t. its logits (``CrossEntropyTerms`` here, the distillation's
``DistillTerms``), DPO's per-token log-probabilities (``TokenLogprobTerms``, ``chunked_token_logps``) too: those
are kept per token and each chunk is recomputed in backward, as a token's gradient there is known only after
the pair losses.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from trainer.collate import Batch
from trainer.data.examples import IGNORE_INDEX

CHUNK_LOGITS = 2**25
"""Default logits per chunk (128 MiB in fp32): ``chunk_tokens = CHUNK_LOGITS // vocab``. Smaller chunks save
little more memory and cost time: each chunk rewrites the whole fp32 head-weight gradient, and on a CPU a
chunk of 55 tokens at a 152k vocabulary ran 20% slower than one of 880."""


def summed_token_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Sum of the token cross-entropies of ``batch``, in fp32. Labels are aligned with input_ids:
    position t predicts ``labels[t + 1]``; -100 (pads, masked tokens, each example's first token) is skipped.
    ``model`` is a ``VarlenCausalLM`` (its configured loss implementation runs: ``token_loss``)."""
    return model.token_loss(**batch.model_inputs(), labels=batch.labels)


def naive_summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of full ``[batch, seq, vocab]`` logits against ``labels`` (shifted by one)."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        labels[:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


@dataclass(frozen=True)
class LogitTransform:
    """What a family does to the head's output before the softmax (transformers applies it in the
    ``*ForCausalLM`` forward, which the chunked loss bypasses, so it is applied per chunk here)."""

    scale: float = 1.0
    """Multiplies the logits: Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``."""
    softcap: float | None = None
    """``softcap * tanh(logits / softcap)``, after the scale: Gemma2's ``final_logit_softcapping``,
    RecurrentGemma's ``logits_soft_cap``."""

    @classmethod
    def of(cls, config: Any) -> LogitTransform:
        scale = float(getattr(config, "logit_scale", None) or 1.0)
        if getattr(config, "logits_scaling", None):
            scale /= float(config.logits_scaling)
        # RecurrentGemma names its final softcap logits_soft_cap
        softcap = getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_soft_cap", None)
        return cls(scale=scale, softcap=softcap or None)

    def apply(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The transformed logits and, with a softcap, ``d softcap(z) / dz`` (``1 - tanh^2``)."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is None:
            return logits, None
        tanh = torch.tanh(logits / self.softcap)
        return tanh * self.softcap, 1.0 - tanh * tanh


def label_positions(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states that predict a label and their targets, flat: ``([n, hidden], [n])``."""
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    return hidden[:, :-1][keep], targets[keep]


def chunk_tokens_for(vocab: int, chunk_tokens: int | None) -> int:
    return chunk_tokens or max(1, CHUNK_LOGITS // vocab)


class LabelHidden(NamedTuple):
    """The hidden states that predict a label and the output head that makes their logits
    (``VarlenCausalLM.label_hidden`` hands it to an objective's own loss, inside the forward window, where FSDP2
    holds the head gathered). A chunked loss takes ``chunk_tokens`` rows at a time (``logits``), so full
    ``[tokens, vocab]`` logits never exist."""

    hidden: torch.Tensor
    """``[n, hidden]``: the positions that predict a label, in row order."""
    targets: torch.Tensor
    """``[n]``: the label each of them predicts."""
    weight: torch.Tensor
    """The head's weight ``[vocab, hidden]``."""
    bias: torch.Tensor | None
    transform: LogitTransform
    """What the family does to the head's output (scale, softcap), as the model's own logits have it."""
    chunk_tokens: int
    """Rows per chunk (``loss.chunk_tokens``, or ``CHUNK_LOGITS // vocab``)."""

    def logits(self, start: int, end: int) -> torch.Tensor:
        """The fp32 logits of rows ``start:end``, transformed as the model's own."""
        return self.transform.apply(F.linear(self.hidden[start:end], self.weight, self.bias).float())[0]


class ChunkTerms(Protocol):
    """What a chunked head pass computes from one chunk's logits (``chunked_head_terms``)."""

    shape: tuple[int, ...]
    """The values' shape: ``()`` for one loss, ``(k,)`` for the trained loss then its reported parts."""
    per_token: bool
    """``False``: the values are summed over the rows and their gradient made in the forward pass, at once.
    ``True``: one value per row ``[n, *shape]``, whose gradient arrives in backward (a DPO pair's weight depends
    on its log-probs); backward recomputes each chunk's logits with ``weighted(grad_values)``."""

    def __call__(
        self, logits: torch.Tensor, start: int, end: int, with_grad: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(values, grad)`` of rows ``start:end``: the chunk's values (summed: a scalar, or a vector whose first
        entry is the trained loss; ``per_token``: one per row) and, ``with_grad``, d(trained loss)/d(``logits``)
        in fp32 (it may reuse ``logits``' memory: nothing reads them after). ``per_token`` terms weigh that
        gradient by ``weighted``'s incoming gradient and may return ``None`` values then."""
        ...

    def weighted(self, grad_values: torch.Tensor) -> ChunkTerms:
        """``per_token`` only: the same terms, their gradient that of ``(grad_values * values).sum()``."""
        ...


@dataclass(frozen=True)
class CrossEntropyTerms:
    """The summed cross-entropy against ``targets``; its gradient ``softmax - one_hot`` built in place of the
    logits (one ``[chunk, vocab]`` buffer)."""

    targets: torch.Tensor
    shape: ClassVar[tuple[int, ...]] = ()
    per_token: ClassVar[bool] = False

    def __call__(self, logits, start, end, with_grad):
        y = self.targets[start:end]
        lse = torch.logsumexp(logits, dim=-1)
        loss = (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
        if not with_grad:
            return loss, None
        grad = logits.sub_(lse[:, None]).exp_()
        grad[torch.arange(len(y), device=y.device), y] -= 1.0
        return loss, grad


@dataclass(frozen=True)
class TokenLogprobTerms:
    """Each target's log-probability ``[n]`` (``per_token``); weighted by ``grad_values``, the gradient
    ``(one_hot - softmax) * grad_values`` (no values then: backward wants the gradient only)."""

    targets: torch.Tensor
    grad_values: torch.Tensor | None = None
    shape: ClassVar[tuple[int, ...]] = ()
    per_token: ClassVar[bool] = True

    def __call__(self, logits, start, end, with_grad):
        y = self.targets[start:end]
        if not with_grad:
            return logits.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1), None
        grad = torch.softmax(logits, dim=-1).neg_()
        grad[torch.arange(len(y), device=y.device), y] += 1.0
        return None, grad.mul_(self.grad_values[start:end, None].float())

    def weighted(self, grad_values: torch.Tensor) -> TokenLogprobTerms:
        return TokenLogprobTerms(self.targets, grad_values)


def head_backward(grad, softcap_slope, transform: LogitTransform, h, weight, grad_weight, grad_bias) -> torch.Tensor:
    """From a chunk's gradient w.r.t. its transformed logits (fp32, changed in place): the head's share of
    the weight and bias gradients, accumulated in fp32, and the chunk's hidden-state gradient, returned."""
    if softcap_slope is not None:
        grad.mul_(softcap_slope)
    if transform.scale != 1.0:
        grad.mul_(transform.scale)
    if grad_bias is not None:
        grad_bias += grad.sum(0)
    grad = grad.to(h.dtype)
    if weight.dtype == torch.float32:
        grad_weight.addmm_(grad.t(), h)
    else:
        grad_weight += (grad.t() @ h).float()
    return grad @ weight


def _head_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    chunk: int,
    terms: ChunkTerms,
    with_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``terms`` over chunks of ``chunk`` rows of ``transform(hidden @ weight.T + bias)`` (summed, or per row)
    and (``with_grads``) the trained loss's gradients with respect to ``hidden``, ``weight`` (fp32) and ``bias``
    (fp32), each chunk's through the head at once (one chunk's logits alive)."""
    shape = (hidden.shape[0], *terms.shape) if terms.per_token else terms.shape
    values = torch.zeros(shape, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if with_grads else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if with_grads else None
    grad_bias = None
    if with_grads and bias is not None:
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    for start in range(0, hidden.shape[0], chunk):
        end = min(start + chunk, hidden.shape[0])
        h = hidden[start:end]
        logits, softcap_slope = transform.apply(F.linear(h, weight, bias).float())
        chunk_values, grad = terms(logits, start, end, with_grads)
        if chunk_values is not None and terms.per_token:
            values[start:end] = chunk_values
        elif chunk_values is not None:  # None: a per-token backward wants the gradient only
            values += chunk_values
        if with_grads:
            grad_hidden[start:end] = head_backward(grad, softcap_slope, transform, h, weight, grad_weight, grad_bias)
    return values, grad_hidden, grad_weight, grad_bias


class _ChunkedHead(torch.autograd.Function):
    """``terms`` of the head applied to ``hidden`` (``_head_pass``); the trained loss's gradients computed in
    forward, scaled in backward by the incoming gradient of the sums' trained entry."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, transform, chunk, terms):
        sums, ctx.grad_hidden, ctx.grad_weight, ctx.grad_bias = _head_pass(
            hidden, weight, bias, transform, chunk, terms, with_grads=True
        )
        ctx.weight_dtype = weight.dtype
        return sums

    @staticmethod
    def backward(ctx, grad_sums):
        grad_loss = grad_sums if grad_sums.dim() == 0 else grad_sums[0]  # other entries are reported, not trained
        grad_hidden = ctx.grad_hidden * grad_loss.to(ctx.grad_hidden.dtype)
        grad_weight = (ctx.grad_weight * grad_loss).to(ctx.weight_dtype)
        grad_bias = None if ctx.grad_bias is None else (ctx.grad_bias * grad_loss).to(ctx.weight_dtype)
        del ctx.grad_hidden, ctx.grad_weight, ctx.grad_bias
        return grad_hidden, grad_weight, grad_bias, None, None, None


class _RecomputedHead(torch.autograd.Function):
    """``per_token`` ``terms`` of the head applied to ``hidden`` (``_head_pass``); backward recomputes each
    chunk's logits for the gradient weighted by the incoming one: one more head matmul, still one chunk's
    logits at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, transform, chunk, terms):
        values = _head_pass(hidden, weight, bias, transform, chunk, terms, with_grads=False)[0]
        ctx.save_for_backward(hidden, weight, bias)
        ctx.transform, ctx.chunk, ctx.terms = transform, chunk, terms
        return values

    @staticmethod
    def backward(ctx, grad_values):
        hidden, weight, bias = ctx.saved_tensors
        terms = ctx.terms.weighted(grad_values)
        _, grad_hidden, grad_weight, grad_bias = _head_pass(
            hidden, weight, bias, ctx.transform, ctx.chunk, terms, with_grads=True
        )
        grad_bias = None if grad_bias is None else grad_bias.to(weight.dtype)
        return grad_hidden, grad_weight.to(weight.dtype), grad_bias, None, None, None


def chunked_head_terms(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    terms: ChunkTerms,
    transform: LogitTransform = LogitTransform(),
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``terms`` (``ChunkTerms``) of the LM head applied to ``hidden`` ``[n, hidden]``, summed over the rows (or
    per row), never holding more than one chunk's logits; differentiable in the trained entry (summed terms
    make their gradients in the forward pass, so an eval pass skips them; per-row terms in backward)."""
    chunk = chunk_tokens_for(weight.shape[0], chunk_tokens)
    if terms.per_token:
        return _RecomputedHead.apply(hidden, weight, bias, transform, chunk, terms)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not needs_grad:  # eval: the sums only
        return _head_pass(hidden, weight, bias, transform, chunk, terms, with_grads=False)[0]
    return _ChunkedHead.apply(hidden, weight, bias, transform, chunk, terms)


def chunked_summed_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: LogitTransform = LogitTransform(),
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of the LM head applied to ``hidden`` ``[n, hidden]`` against ``targets`` ``[n]``
    (every target a real label), never holding more than one chunk's logits."""
    return chunked_head_terms(hidden, weight, bias, CrossEntropyTerms(targets), transform, chunk_tokens)


def liger_summed_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: LogitTransform = LogitTransform(),
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """The same sum through Liger's fused linear cross-entropy (CUDA, Triton). Liger has a softcap but
    no logit scale: a scale is folded into the hidden states (and the bias)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # noqa: PLC0415 -- optional extra (liger), CUDA only

    if transform.scale != 1.0:
        hidden = hidden * transform.scale
        bias = None if bias is None else bias * transform.scale
    loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum", softcap=transform.softcap)
    return loss_fn(weight, hidden, targets, bias).float()


def liger_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def head_matches_logits(reference: torch.Tensor, ours: torch.Tensor) -> bool:
    """Do the head-from-hidden logits equal the model's own (to the compute dtype's precision)?"""
    tolerance = 1e-4 if reference.dtype == torch.float32 else 3e-2
    scale = max(1.0, float(reference.abs().max()))
    return bool(torch.allclose(reference.float(), ours.float(), rtol=tolerance, atol=tolerance * scale))


@dataclass(frozen=True)
class HeadLoss:
    """The loss implementation a model runs (``VarlenCausalLM.use_loss`` picks it)."""

    impl: str = "naive"
    """``naive`` or ``chunked`` (``LOSS_IMPLS``)."""
    kernel: str = "torch"
    """For ``chunked``: ``torch`` (``chunked_summed_loss``) or ``liger`` (``liger_summed_loss``)."""
    transform: LogitTransform = LogitTransform()
    chunk_tokens: int | None = None

    def describe(self) -> str:
        return f"{self.impl} ({self.kernel})" if self.impl == "chunked" else self.impl

    def __call__(self, hidden, weight, bias, targets) -> torch.Tensor:
        fn = liger_summed_loss if self.kernel == "liger" else chunked_summed_loss
        return fn(hidden, weight, bias, targets, self.transform, self.chunk_tokens)


def chunked_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: LogitTransform = LogitTransform(),
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Log-probability of each target ``[n]`` (fp32) under the LM head applied to ``hidden`` ``[n, hidden]``,
    never holding more than one chunk's logits (the preference objective's building block). ``hidden`` is in the
    head's dtype (``VarlenCausalLM.label_head`` casts it)."""
    return chunked_head_terms(hidden, weight, bias, TokenLogprobTerms(targets), transform, chunk_tokens)


def naive_token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label of full ``[batch, seq, vocab]`` logits (shifted by one), flat ``[n]``."""
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp[keep].gather(1, targets[keep][:, None]).squeeze(1)


def sequence_of_labels(labels: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The sequence each label position belongs to, flat in ``label_positions`` order: a packed row's
    segment (``cu_seqlens``), else the padded row."""
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    if cu_seqlens is None:
        rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(targets)
        return rows[keep]
    positions = torch.arange(1, labels.shape[1], device=labels.device)
    segment = torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)
    return segment[None].expand_as(targets)[keep]
