"""The comparison engine: a packed batch through the run's own path against its examples run one by one.

``measure(model, batch, loss)`` is the one comparison of every certification stage with a model (the replica,
the startup self-check):

- the batch runs as the run computes it: its logits, and the gradient of the *loss of the check* (``loss``:
  ``TokenLossCheck``, the loss the run trains with, ``VarlenCausalLM.use_loss``, chunked or naive; under
  ``objective=dpo`` ``trainer.objectives.dpo.PairLossCheck``; under ``objective=distill``
  ``trainer.objectives.distill.check.DistillLossCheck``), through the run's route (``route``: under context
  parallelism the row sharded over the CP group, ``trainer.parallel.route.CPRoute``);
- each example runs alone through transformers' own attention (the model's padded path) and its full
  logits, from which the same loss is made, ``loss.group`` sequences at a time (a preference pair: 2); one
  example's graph at a time, so memory stays that of one example beside the batch's logits;
- compared: every example's logits (relative to the largest |logit| alone, at least 1), the loss, the
  per-sequence values where the loss has them (DPO's reply log-probs), and the gradient (``gradient_digest``):
  every parameter's (``full``: a replica, small enough to hold two copies; relative to its largest |value|,
  at least 1) or ``PROJECTIONS`` seeded random projections of the whole (the run's model: one chunk of memory;
  relative to the reference's RMS). A router aux loss (``trainer.router_aux``) is a statistic of a batch's
  tokens, not a sum over examples: compared apart (``router_aux_check``).

One tolerance per dtype (``TOLERANCE``); with projections in half precision the reference's own noise (its
examples summed in reverse order) is measured and allowed ``GRAD_NOISE_MULT`` times. One NaN rule: where a
side is not finite (its logits, its loss, a parameter's gradient: ``Measurement.packed_nan`` / ``alone_nan``),
the stage says which side and where (``nan_line``), never that examples mix. One result type: ``Measurement``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from trainer.collate import Batch
from trainer.data.examples import IGNORE_INDEX
from trainer.errors import SelfCheckError
from trainer.loss import summed_token_loss
from trainer.router_aux import RouterStats


class Tolerance(NamedTuple):
    logits: float
    """Max |logit diff| relative to max(1, the largest |logit| alone)."""
    grads: float
    """Every parameter's gradient (``full``): max |diff| relative to max(1, its largest |value|)."""
    projections: float
    """Gradient projections: the dtype's term of the allowed gap relative to the reference's RMS (plus
    ``GRAD_NOISE_MULT`` times the measured noise)."""


TOLERANCE = {
    torch.float64: Tolerance(1e-6, 1e-5, 1e-9),
    torch.float32: Tolerance(1e-4, 2e-5, 1e-4),
    torch.bfloat16: Tolerance(5e-2, 3e-2, 3e-2),
    torch.float16: Tolerance(2e-2, 1e-2, 1e-2),
}
"""Per compute dtype. A leak between examples gives 1e-4 and more in a float64 replica, a 0.5% gradient gap in
float32; float32 steps inside transformers' float64 models (rope among them, Gemma 4) leave ~1e-7 on a
gradient, bf16 rounding a few 1e-3 on the projections."""
GRAD_NOISE_MULT = 8.0
PROJECTIONS, PROJECTION_SEED, CHUNK = 4, 20231, 1 << 20
NOISY_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes whose reference noise is measured (one more pass over the examples alone). In float32 / float64 the
rounding of summing the examples' gradients (2.5e-7 on the tiny GPT-2) is far below the dtype's term."""


def packed_batch(examples: list[torch.Tensor]) -> Batch:
    """Examples (token ids) laid out as collate lays out a packed row: one flat row, positions restarting,
    ``cu_seqlens``, no label on each example's first token."""
    cu = torch.tensor([0] + [len(e) for e in examples]).cumsum(0).to(torch.int32)
    labels = torch.cat([torch.cat([torch.tensor([IGNORE_INDEX]), e[1:]]) for e in examples])[None]
    return Batch(
        input_ids=torch.cat(examples)[None],
        labels=labels,
        position_ids=torch.cat([torch.arange(len(e)) for e in examples])[None],
        cu_seqlens=cu,
        max_seqlen=max(len(e) for e in examples),
        num_examples=len(examples),
        num_tokens=int(cu[-1]),
        num_label_tokens=int((labels != IGNORE_INDEX).sum()),
        num_positions=int(cu[-1]),
    )


def example_spans(batch: Batch) -> list[tuple[int, slice]]:
    """(row, token slice) of every example (or piece) of the batch, in order."""
    if batch.packed:
        cu = batch.cu_seqlens.tolist()
        return [(0, slice(s, e)) for s, e in zip(cu[:-1], cu[1:], strict=True)]
    lengths = batch.attention_mask.sum(dim=1).tolist()
    return [(row, slice(0, int(n))) for row, n in enumerate(lengths)]


def check_positions(batch: Batch, starts: list[int] | None = None) -> None:
    """position_ids restart in every segment, at 0 (or at ``starts[k]`` for a split piece of an example,
    ``packing=bfd_split|wrapped``) and count up by one; the first token of each segment carries no label."""
    for k, (row, span) in enumerate(example_spans(batch)):
        first = starts[k] if starts is not None else 0
        pos = batch.position_ids[row, span].cpu()
        if not torch.equal(pos, torch.arange(first, first + len(pos))):
            raise SelfCheckError(
                f"position_ids of the example at tokens {span.start}-{span.stop} do not restart at {first}"
            )
        if int(batch.labels[row, span.start]) != IGNORE_INDEX:
            raise SelfCheckError(
                f"the example at token {span.start} has a label on its first token (crosses a boundary)"
            )


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or float64 where it is (a float64 replica keeps its precision)."""
    return t if t.dtype == torch.float64 else t.float()


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=IGNORE_INDEX, reduction="none")


def label_count(batch: Batch) -> int:
    """The batch's label tokens (at least 1): what a per-label loss of the check divides by."""
    return max(1, int((batch.labels != IGNORE_INDEX).sum()))


class TokenLossCheck:
    """The loss of the check under SFT: the summed token loss, over the batch's label count as a step takes it
    (``per_label``; a replica compares the sum, whose gradients keep the scale its tolerance is set for).

    A loss of the check says how the packed batch's loss runs through the run's own path (``packed``) and how
    the same loss is made from its sequences run alone, ``group`` consecutive sequences at a time (``alone``),
    from each one's per-token losses: the token cross-entropy of its logits alone, unless the loss of the
    check has ``token_losses(batch, index, logits, labels)`` (``DistillLossCheck``: against the teacher run
    alone on the sequence)."""

    group = 1
    """Consecutive sequences whose loss comes together (a preference pair: 2): one backward per group."""

    def __init__(self, per_label: bool = True) -> None:
        self.per_label = per_label

    def describe(self) -> str:
        return "token loss"

    def packed(self, model, batch: Batch, token_losses: list[torch.Tensor] | None = None):
        """(the batch's loss, differentiable, through the run's own path ``use_loss``, or from ``token_losses``
        per sequence when a route gives logits; per-sequence values to compare alone, or ``None``)."""
        total = summed_token_loss(model, batch) if token_losses is None else sum(t.sum() for t in token_losses)
        return total / (label_count(batch) if self.per_label else 1), None

    def alone(self, batch: Batch, token_losses: list[torch.Tensor], labels: list[torch.Tensor]) -> torch.Tensor:
        """The loss of one group of sequences run alone, normalised as ``packed`` normalises."""
        return sum(t.sum() for t in token_losses) / (label_count(batch) if self.per_label else 1)


def _zero_grads(model: torch.nn.Module) -> None:
    for param in model.parameters():
        param.grad = None


def _projections(grad: torch.Tensor, seed: int) -> torch.Tensor:
    """``PROJECTIONS`` dots (float64) of ``grad`` with seeded random tensors, generated a chunk at a time."""
    out = torch.zeros(PROJECTIONS, dtype=torch.float64)
    flat = grad.reshape(-1)
    for c, start in enumerate(range(0, flat.numel(), CHUNK)):
        piece = flat[start : start + CHUNK].float()
        gen = torch.Generator(device=piece.device).manual_seed(seed + c)
        r = torch.randn(PROJECTIONS, piece.numel(), generator=gen, device=piece.device)
        out += (r @ piece).double().cpu()
    return out


def gradient_digest(model: torch.nn.Module, full: bool) -> dict[str, torch.Tensor]:
    """Each parameter's gradient by name (``full``: a copy; else its ``PROJECTIONS`` projections, seeded per
    parameter in name order), then the gradients cleared."""
    out = {}
    for i, (name, param) in enumerate(sorted(model.named_parameters(), key=lambda kv: kv[0])):
        if param.grad is not None:
            grad = param.grad.detach()
            out[name] = grad.clone() if full else _projections(grad, PROJECTION_SEED + 1_000_003 * i)
    _zero_grads(model)
    return out


def not_finite(digest: dict[str, torch.Tensor]) -> str:
    """ "the gradient of NAME" for the first parameter (by name) whose digest is not finite, else ""."""
    return next((f"the gradient of {n}" for n, g in sorted(digest.items()) if not torch.isfinite(g).all()), "")


def gradient_gap(
    packed: dict[str, torch.Tensor], alone: dict[str, torch.Tensor], full: bool, floor: float = 0.0
) -> float:
    """``full``: the worst parameter's max |diff| relative to max(1, its largest |value| alone), ``inf`` for a
    gradient one side lacks; projections: the summed projections' max |diff| relative to the reference's RMS
    (at least ``floor``)."""
    if full:
        if packed.keys() != alone.keys():
            return math.inf
        return max(
            (float((packed[n] - a).abs().max()) / max(1.0, float(a.abs().max())) for n, a in alone.items()), default=0.0
        )
    p, a = (sum(d.values(), torch.zeros(PROJECTIONS, dtype=torch.float64)) for d in (packed, alone))
    return float((p - a).abs().max()) / max(float(a.pow(2).mean().sqrt()), floor, 1e-30)


@dataclass
class Measurement:
    """What a stage measured: a batch through the run's path vs its examples one by one, with its tolerances."""

    mode: str
    """``packed`` or ``padded``."""
    examples: int
    tokens: int
    dtype: str
    loss: str = "token loss"
    """What the gradient is of (``describe`` of the loss of the check)."""
    digest: str = ""
    """How the gradient is compared (every parameter, random projections); "" for a frozen model: not compared."""
    logit_diff: float = 0.0
    logit_tolerance: float = math.inf
    worst_example: int = 0
    loss_diff: float | None = None
    """|packed - alone| of the loss of the check, relative to max(1, |alone|) (reported, not judged: its
    gradient is)."""
    grad_gap: float = 0.0
    grad_tolerance: float = math.inf
    grad_noise: float = 0.0
    """The reference's own noise (projections in half precision): its gap to itself summed in reverse order."""
    extra: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Further comparisons, name -> (gap, tolerance): ``sequence log-prob diff`` (DPO), ``router aux loss
    diff`` and its ``router aux gradient gap``."""
    packed_nan: str = ""
    """What is not finite (NaN or inf) through the run's path: "the logits", "the gradient of NAME"; "" if none."""
    alone_nan: str = ""
    """What is not finite with the examples run one by one (the model's own, not packing's)."""

    @property
    def ratios(self) -> dict[str, float]:
        """Each comparison's gap over its tolerance (exact when none is above 1)."""
        out = {"logit diff": self.logit_diff / max(self.logit_tolerance, 1e-30)}
        if self.digest:
            out["gradient gap"] = self.grad_gap / max(self.grad_tolerance, 1e-30)
        return out | {name: gap / max(tol, 1e-30) for name, (gap, tol) in self.extra.items()}

    @property
    def ok(self) -> bool:
        return not (self.packed_nan or self.alone_nan) and all(r <= 1.0 for r in self.ratios.values())

    def line(self) -> str:
        grad = (
            "gradient not compared (no trainable parameters)"
            if not self.digest
            else (
                f"gradient gap {self.grad_gap:.3g} ({self.loss}; tolerance {self.grad_tolerance:.3g}"
                + (f", reference noise {self.grad_noise:.3g}" if self.grad_noise else "")
                + f"; {self.digest})"
            )
        )
        extra = "".join(f"{name} {gap:.3g} (tolerance {tol:.3g}), " for name, (gap, tol) in self.extra.items())
        loss = "" if self.loss_diff is None else f"|loss diff| {self.loss_diff:.3g}, "
        return (
            f"{self.mode} micro-batch of {self.examples} examples / {self.tokens} tokens vs one by one "
            f"({self.dtype}): max |logit diff| {self.logit_diff:.3g} (tolerance {self.logit_tolerance:.3g}, "
            f"worst example #{self.worst_example}), {loss}{extra}{grad}"
        )

    def short(self) -> str:
        return f"{self.dtype} |logit diff| {self.logit_diff:.1g}, |grad diff| {self.grad_gap:.1g}"


def nan_line(m: Measurement, alone: bool) -> str:
    """The one line for a NaN (or inf): the model's own where its examples run one by one give it (``alone``),
    else the run's path's; where, as this process found it."""
    if alone:
        return (
            f"{m.alone_nan or '(on another rank)'} is not finite (NaN) with its examples run one by one, "
            "unpacked: the model's own computation, not packing's; a step would train nothing"
        )
    where = m.packed_nan or "(on another rank)"
    return f"{m.mode}, {where} is not finite (NaN) where its examples run one by one are finite"


class _Packed(NamedTuple):
    logits: torch.Tensor
    value: float
    values: torch.Tensor | None
    digest: dict[str, torch.Tensor]


def _run_packed(model, batch: Batch, loss, route, trains: bool, full: bool) -> _Packed:
    """The batch as the run computes it: its logits (detached, float) and the loss of the check's value and
    gradient digest (``trains``)."""
    logits = values = None
    value, digest = math.nan, {}
    if trains:
        if route is not None:  # under cp: the row sharded over the group, the loss on its gathered logits
            logits = _wide(route.logits(batch))
            token_losses = [_token_losses(logits[r, s], batch.labels[r, s]) for r, s in example_spans(batch)]
            total, values = loss.packed(model, batch, token_losses)
        else:  # the run's own loss through its own path, over its own count, as a step takes it
            total, values = loss.packed(model, batch)
        total.backward()
        value, digest = float(total.detach()), gradient_digest(model, full)
        if route is not None:  # each rank's share of the row's gradient: summed over the group
            digest = dict(zip(digest, route.sum_over_ranks(torch.stack(list(digest.values()))), strict=True))
    if logits is None:  # the chunked loss gives no logits; a frozen model ran no loss
        with torch.no_grad():
            logits = _wide(route.logits(batch) if route is not None else model(**batch.model_inputs()))
    return _Packed(logits.detach(), value, None if values is None else _wide(values.detach()), digest)


def _alone(model, batch: Batch, row: int, span: slice) -> torch.Tensor:
    """One example of ``batch`` run alone through the padded path (the reference): its float logits."""
    ids = batch.input_ids[row : row + 1, span]
    position_ids = batch.position_ids[row : row + 1, span]  # a split piece keeps its offset
    return _wide(model(input_ids=ids, position_ids=position_ids, attention_mask=torch.ones_like(ids)))[0]


def _run_alone(model, batch: Batch, loss, packed: _Packed, trains: bool, order: int = 1) -> tuple[dict, float]:
    """The examples one by one, ``loss.group`` at a time (in ``order``), each compared with the packed logits as
    it runs: (figures, the loss of the check made from them); the gradients accumulate in the parameters."""
    spans = example_spans(batch)
    per_token = getattr(loss, "token_losses", lambda batch, i, logits, labels: _token_losses(logits, labels))
    found = dict(worst=0.0, worst_example=0, scale=1.0, nan="", logps=[])
    total = 0.0
    for start in list(range(0, len(spans), loss.group))[::order]:
        token_losses, labels = [], []
        for i in range(start, min(start + loss.group, len(spans))):
            row, span = spans[i]
            logits = _alone(model, batch, row, span)
            labels.append(batch.labels[row, span])
            token_losses.append(per_token(batch, i, logits, labels[-1]))
            logits = logits.detach()
            if not found["nan"] and not torch.isfinite(logits).all():
                found["nan"] = f"the logits of example #{i}"
            diff = float((packed.logits[row, span] - logits).abs().max())
            found["scale"] = max(found["scale"], float(logits.abs().max()))
            if diff > found["worst"]:
                found["worst"], found["worst_example"] = diff, i
            if packed.values is not None:  # |summed label log-prob packed - alone|, its label tokens
                found["logps"].append(
                    (
                        abs(float(packed.values[i]) + float(token_losses[-1].detach().sum())),
                        max(1, int((labels[-1][1:] != IGNORE_INDEX).sum())),
                    )
                )
        group_loss = loss.alone(batch, token_losses, labels)
        total += float(group_loss.detach())
        if trains:  # the grads of the groups accumulate in place, in the parameters' dtype
            group_loss.backward()
    return found, total


def measure(
    model,
    batch: Batch,
    loss=None,
    *,
    route=None,
    full: bool = False,
    compute_dtype: torch.dtype | None = None,
    starts: list[int] | None = None,
    tolerance: float | None = None,
) -> Measurement:
    """``batch`` through the run's path vs its examples one by one (see the module docstring), in eval mode (no
    dropout), in the parameters' dtype or under autocast to ``compute_dtype``. ``starts``: the first position
    of each segment (split pieces; ``None``: 0); ``tolerance``: the logits' (``model.self_check_tolerance``)."""
    check_positions(batch, starts)
    loss = loss or TokenLossCheck()
    param = next(model.parameters())
    dtype = compute_dtype or param.dtype
    autocast = torch.autocast(param.device.type, dtype=dtype) if dtype != param.dtype else contextlib.nullcontext()
    trains = any(p.requires_grad for p in model.parameters())
    policy = TOLERANCE.get(dtype, Tolerance(5e-2, 1e-1, 1e-1))
    m = Measurement(
        "packed" if batch.packed else "padded",
        batch.num_examples,
        batch.num_tokens,
        str(dtype).split(".")[-1],
        loss.describe(),
        logit_tolerance=policy.logits if tolerance is None else tolerance,
    )
    was_training = model.training
    model.eval()
    _zero_grads(model)
    try:
        with autocast, torch.set_grad_enabled(trains):
            packed = _run_packed(model, batch, loss, route, trains, full)
            found, alone_value = _run_alone(model, batch, loss, packed, trains)
            alone = _compare_gradients(m, model, batch, loss, packed, alone_value, full, policy) if trains else {}
            if getattr(model, "router_aux", None) is not None and route is None:  # cp > 1 refuses it
                m.extra |= router_aux_check(model, batch, policy, m.grad_noise, alone)
    finally:
        _zero_grads(model)
        model.train(was_training)
    m.logit_diff, m.worst_example = found["worst"] / found["scale"], found["worst_example"]
    m.packed_nan = "the logits" if not torch.isfinite(packed.logits).all() else not_finite(packed.digest)
    m.alone_nan = found["nan"] or m.alone_nan
    if found["logps"]:  # the worst sequence relative to its tolerance (2 x its label tokens x the logit tolerance)
        gap, labelled = max(found["logps"], key=lambda g: g[0] / g[1])
        m.extra["max |sequence log-prob diff|"] = (gap, 2 * labelled * m.logit_tolerance * found["scale"])
    return m


def _compare_gradients(
    m: Measurement, model, batch: Batch, loss, packed: _Packed, alone_value: float, full: bool, policy: Tolerance
) -> dict[str, torch.Tensor]:
    """The gradient's figures of ``m`` from the reference the examples alone accumulated (returned, digested);
    in half precision with projections, the reference's noise: the same examples summed in reverse order."""
    alone = gradient_digest(model, full)
    m.alone_nan = not_finite(alone)
    m.loss_diff = abs(packed.value - alone_value) / max(1.0, abs(alone_value))
    m.digest = "every parameter" if full else f"{PROJECTIONS} random projections"
    if not full and getattr(torch, m.dtype) in NOISY_DTYPES:
        _run_alone(model, batch, loss, packed, True, order=-1)
        m.grad_noise = gradient_gap(gradient_digest(model, False), alone, False)
    m.grad_gap = gradient_gap(packed.digest, alone, full)
    m.grad_tolerance = policy.grads if full else GRAD_NOISE_MULT * m.grad_noise + policy.projections
    return alone


AUX_DIFF = "router aux loss (the batch's statistic vs its examples alone) relative diff"
AUX_GRAD = "router aux gradient gap"


def router_aux_check(
    model, batch: Batch, policy: Tolerance, noise: float, token_grads: dict[str, torch.Tensor]
) -> dict[str, tuple[float, float]]:
    """The router aux loss of ``batch`` through the run's path against the same tokens' statistic from each
    example run alone (their ``RouterStats`` merged); with trainable parameters (``token_grads``: the token
    loss's reference digest) its gradient too, the reference's taken one example at a time with the batch's
    counts (``RouterStats.with_counts_of``: the counts carry no gradient; a count that differs shows in the
    value). ``Measurement.extra``'s entries.

    The gradient gap is measured on the scale of what a step trains, ``token gradient + coef x aux gradient``:
    relative to the larger of the aux gradient's own size and the token gradient's over ``coef``. Near balanced
    routing the aux gradient alone is at float rounding (1e-8 in float32), where a relative gap of its own
    would read rounding as a leak."""
    _, stats = model.token_loss(**batch.model_inputs(), labels=batch.labels, router=True)
    value = stats.balance_loss()
    if token_grads:
        value.backward()
        packed = gradient_digest(model, False)
    parts = []
    for row, span in example_spans(batch):  # one example's graph at a time
        ids, positions = batch.input_ids[row : row + 1, span], batch.position_ids[row : row + 1, span]
        part = model.router_statistics(ids, positions, attention_mask=torch.ones_like(ids))
        if token_grads:
            part.with_counts_of(stats).backward()
        parts.append(RouterStats(*(t.detach() for t in part)))
    reference = float(RouterStats.merged(parts).balance_loss())
    out = {AUX_DIFF: (abs(float(value.detach()) - reference) / max(abs(reference), 1e-30), policy.logits)}
    if token_grads:
        token_rms = float(sum(token_grads.values()).pow(2).mean().sqrt())
        floor = token_rms / max(model.router_aux.coef, 1e-30)
        out[AUX_GRAD] = (
            gradient_gap(packed, gradient_digest(model, False), False, floor),
            GRAD_NOISE_MULT * noise + policy.projections,
        )
    return out
