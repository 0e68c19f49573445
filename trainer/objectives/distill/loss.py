"""The distillation loss, chunk by chunk: neither the student's nor the teacher's ``[tokens, vocab]`` logits
exist at once.

Per label token (a position whose next token carries a label), from the student's logits ``z`` and the
teacher's distribution ``t`` over the same classes::

    loss = alpha * CE(z, label) + (1 - alpha) * D(t, log_softmax(z / T))

``D`` is TRL's ``GKDTrainer.generalized_jsd_loss`` before its reduction: ``forward_kl`` ``KL(t || s)`` (its
``beta=0``), ``reverse_kl`` ``KL(s || t)`` (its ``beta=1``), ``jsd``
``beta * KL(t || m) + (1 - beta) * KL(s || m)`` with the mixture ``m = (1 - beta) s + beta t``; each summed
over the classes, in fp32. The classes are the vocabulary (a live teacher, ``HeadTeacher``: its hidden
states go through its own head one chunk at a time, beside the student's) or the teacher's stored top-k
tokens plus one bucket holding the rest of the vocabulary (``TopKTeacher``: the student's mass outside
those k tokens, computed from its full row, fills its bucket), so every divergence stays finite and a
``top_k`` of the whole vocabulary gives the live loss.

``chunked_distill_loss`` runs the student's head a chunk of label tokens at a time, as the fused
cross-entropy does (``trainer.loss``): each chunk's gradient w.r.t. its logits comes from autograd on that
chunk alone, right after its logits, and goes through the head's backward (``head_backward``) at once;
backward only scales what forward accumulated. ``naive_distill_loss`` is the same sum from full logits
(``loss.impl=naive``, the self-check's one-by-one side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from trainer.collate import Batch
from trainer.config.distill import DistillConfig
from trainer.loss import LogitTransform, chunk_tokens_for, chunked_head_terms, label_positions

LOG_FLOOR = -1.0e4
"""The log-probability a bucket with no mass gets (a top-k that holds the whole vocabulary leaves the rest
empty): ``exp`` of it is exactly 0 in fp32, so the bucket adds exactly nothing and no ``0 * inf`` appears."""

TERMS = ("loss", "cross_entropy", "divergence")
"""What a distillation loss sums over its label tokens (the first is the trained loss)."""


def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` of each row, from log-probabilities over the same classes (``F.kl_div(log_q, log_p,
    log_target=True)`` summed over the classes)."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def divergence(student: torch.Tensor, teacher: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
    """``D(teacher, student)`` per row, from log-probabilities ``[n, classes]`` (see the module docstring)."""
    if cfg.divergence == "forward_kl":
        return kl(teacher, student)
    if cfg.divergence == "reverse_kl":
        return kl(student, teacher)
    mixture = torch.logaddexp(student + math.log1p(-cfg.beta), teacher + math.log(cfg.beta))
    return cfg.beta * kl(teacher, mixture) + (1.0 - cfg.beta) * kl(student, mixture)


def over_classes(log_probs: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """Full-vocabulary log-probabilities ``[n, vocab]`` over the teacher's classes: all of them (``ids``
    ``None``), or the ``ids`` ``[n, k]`` then one bucket with the rest of the mass ``[n, k + 1]``."""
    if ids is None:
        return log_probs
    rest = log_probs.scatter(1, ids, float("-inf")).logsumexp(-1, keepdim=True).clamp_min(LOG_FLOOR)
    return torch.cat([log_probs.gather(1, ids), rest], dim=1)


def token_terms(
    logits: torch.Tensor,
    targets: torch.Tensor,
    teacher: torch.Tensor,
    ids: torch.Tensor | None,
    cfg: DistillConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per label token: the student's cross-entropy at temperature 1 and the divergence at ``cfg.temperature``
    (fp32 ``[n]`` each). ``logits``: the student's ``[n, vocab]`` (transformed as the model's own); ``teacher``:
    the teacher's log-probabilities at the temperature over its classes (``ids``: see ``over_classes``)."""
    logits = logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    cross_entropy = -log_probs.gather(1, targets[:, None]).squeeze(1)
    if cfg.temperature != 1.0:
        log_probs = torch.log_softmax(logits / cfg.temperature, dim=-1)
    return cross_entropy, divergence(over_classes(log_probs, ids), teacher, cfg)


def blend(cross_entropy: torch.Tensor, div: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
    """The trained loss ``alpha * CE + (1 - alpha) * D`` (per token, or of sums)."""
    return cfg.alpha * cross_entropy + (1.0 - cfg.alpha) * div


def mixed(cross_entropy: torch.Tensor, div: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
    """``TERMS`` summed over the tokens: the trained loss, then its parts."""
    ce, d = cross_entropy.sum(), div.sum()
    return torch.stack([blend(ce, d, cfg), ce, d])


@dataclass
class HeadTeacher:
    """A live teacher's label positions: its hidden states ``[n, hidden]`` (no grad) and its head, applied a
    chunk at a time."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    transform: LogitTransform
    temperature: float

    def log_probs(self, start: int, end: int) -> tuple[torch.Tensor, None]:
        logits, _ = self.transform.apply(F.linear(self.hidden[start:end], self.weight, self.bias).float())
        return torch.log_softmax(logits / self.temperature, dim=-1), None


@dataclass
class TopKTeacher:
    """A precomputed teacher's label positions: its ``top_k`` token ids ``[n, k]`` (int64), their
    log-probabilities at the temperature ``[n, k]`` and the log of the rest of its mass ``[n]`` (fp32)."""

    ids: torch.Tensor
    log_probs_k: torch.Tensor
    log_rest: torch.Tensor

    def log_probs(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        rest = self.log_rest[start:end, None].float().clamp_min(LOG_FLOOR)
        return torch.cat([self.log_probs_k[start:end].float(), rest], dim=1), self.ids[start:end]


Teacher = HeadTeacher | TopKTeacher


@dataclass(frozen=True)
class DistillTerms:
    """``TERMS`` of one chunk of the student's logits against ``teacher``'s rows (``trainer.loss.ChunkTerms``);
    the trained loss's gradient through autograd on the chunk alone."""

    targets: torch.Tensor
    teacher: Teacher
    cfg: DistillConfig
    shape: ClassVar[tuple[int, ...]] = (len(TERMS),)
    per_token: ClassVar[bool] = False

    def __call__(self, logits, start, end, with_grad):
        target, ids = self.teacher.log_probs(start, end)
        if with_grad:
            logits = logits.detach().requires_grad_()
        with torch.set_grad_enabled(with_grad):
            terms = mixed(*token_terms(logits, self.targets[start:end], target, ids, self.cfg), self.cfg)
            grad = torch.autograd.grad(terms[0], logits)[0] if with_grad else None
        return terms.detach(), grad


def chunked_distill_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    teacher: Teacher,
    cfg: DistillConfig,
    transform: LogitTransform = LogitTransform(),
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``TERMS`` (fp32 ``[3]``, only the first differentiable) of the student's head on ``hidden``
    ``[n, hidden]`` (every position a label's) against ``targets`` ``[n]`` and ``teacher``'s ``n`` rows, one
    chunk of logits at a time (``trainer.loss.chunked_head_terms``)."""
    return chunked_head_terms(hidden, weight, bias, DistillTerms(targets, teacher, cfg), transform, chunk_tokens)


def naive_distill_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    teacher: Teacher,
    cfg: DistillConfig,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``TERMS`` from the student's full logits at the label positions ``[n, vocab]`` (differentiable as they
    are), the teacher's rows a chunk at a time."""
    chunk = chunk_tokens_for(logits.shape[-1], chunk_tokens)
    sums = torch.zeros(len(TERMS), dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], chunk):
        end = min(start + chunk, logits.shape[0])
        target, ids = teacher.log_probs(start, end)
        sums = sums + mixed(*token_terms(logits[start:end], targets[start:end], target, ids, cfg), cfg)
    return sums


def student_terms(model: torch.nn.Module, batch: Batch, teacher: Teacher, cfg: DistillConfig) -> torch.Tensor:
    """``TERMS`` of ``batch`` (fp32 ``[3]``, the first differentiable) through the student's own path: its chunked
    head inside its forward window (``VarlenCausalLM.label_hidden``), or its full logits where its loss is
    ``naive`` (``loss.impl=naive``, or a head the chunk cannot reproduce)."""
    if model.loss.impl == "naive":
        logits, targets = label_positions(model(**batch.model_inputs()), batch.labels)
        return naive_distill_loss(logits, targets, teacher, cfg, model.loss.chunk_tokens)
    return model.label_hidden(
        **batch.model_inputs(),
        labels=batch.labels,
        fn=lambda head: chunked_distill_loss(
            head.hidden, head.weight, head.bias, head.targets, teacher, cfg, head.transform, head.chunk_tokens
        ),
    )
