"""Startup self-check: a worst-case micro-batch of the run's data, run as built and example by example, must agree.

Before step 1 the trainer builds a check batch from the run's own examples (``worst_case_microbatch``: the
longest beside the shortest, a 1-token example, lengths in between), runs it through the model as
it will be trained (packed through the configured backend, or padded with its mask) and runs each of its
examples alone through transformers' own SDPA path. Any disagreement above tolerance means examples see
each other, positions do not restart, or the backend is wrong: the run stops with the numbers.

It compares logits and the gradient of the run's loss (the *loss of the check*, ``CheckLoss``): the packed
batch runs the step's own path forward and backward (``TokenLossCheck``: the loss the run trains with,
``VarlenCausalLM.use_loss``, the chunked loss through the decoder stack and the boundary relay, or the naive
one; under ``objective=dpo``, ``trainer.objectives.dpo.PairLossCheck``: the per-sequence log-probs through the
same head, then the pair losses); each example alone runs through transformers' own attention and its full
logits' cross-entropy, from which the same loss is computed (one backward per example, or per pair: a pair's
loss needs both its sequences, and in half precision one more pass for the reverse-order reference). Where
the loss of the check has per-sequence values (DPO's summed reply log-probs), they are compared too. The
full parameter gradient is compared through ``PROJECTIONS`` fixed, seeded
random projections (``grad_projections``: a dot with a random tensor generated chunk-wise, so memory stays
one chunk). The gradient tolerance is ``GRAD_NOISE_MULT`` times the measured noise of the reference (run
a second time, its examples in reverse order: the gap between the two is the rounding of summing the
examples' gradients in the parameters' dtype), plus a dtype term ``GRAD_TOLERANCE``: a 0.5% leak fails in float32 while bf16 rounding passes in bf16.

A router aux loss (``trainer.router_aux``) is a statistic of a micro-batch's tokens, not a sum over examples:
the token check above runs without it, and ``router_aux_check`` compares it apart, the batch's value and
gradient through the run's path against the same tokens' statistic from each example run alone.

A NaN is never read as a leak: where the run's path (packed or padded) or the reference gives a logit or a
gradient that is not finite, the check stops saying which and where (the reference's: the model's own, not
packing's), never that examples mix.

It runs on the unsharded model (before FSDP), in eval mode (no dropout), in the master dtype; backends whose kernels compute only in half precision run under autocast to the compute
dtype, with a looser tolerance. The worst difference is agreed across ranks, so every rank stops or none.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from trainer import distributed
from trainer.collate import Batch
from trainer.data.examples import IGNORE_INDEX
from trainer.errors import SelfCheckError
from trainer.loss import summed_token_loss
from trainer.model.wrapper import VarlenCausalLM
from trainer.packing import piece_starts
from trainer.router_aux import RouterStats

log = logging.getLogger(__name__)

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 5e-2, torch.float16: 2e-2}
"""Default max |logit difference|, relative to max(1, largest |logit|), per compute dtype."""


GRAD_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 3e-2, torch.float16: 1e-2}
"""Dtype term of the max relative gradient-projection gap, per compute dtype."""
GRAD_NOISE_MULT = 8.0
"""Gradient tolerance = this times the measured noise floor of the one-by-one reference + the dtype term."""
PROJECTIONS, PROJECTION_SEED, CHUNK = 4, 20231, 1 << 20
NOISY_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes whose reference noise is measured (one more pass). In float32 / float64 the rounding of summing the
examples' gradients (measured 2.5e-7 on the tiny GPT-2) is far below the dtype term, so that pass is skipped."""


def grad_projections(model: torch.nn.Module, seed: int = PROJECTION_SEED) -> torch.Tensor:
    """``PROJECTIONS`` dots (float64) of the parameters' gradients with fixed random tensors: generated per
    parameter (in name order) and per chunk of ``CHUNK`` elements from a seeded generator, never whole."""
    out = torch.zeros(PROJECTIONS, dtype=torch.float64)
    for i, (_, param) in enumerate(sorted(model.named_parameters(), key=lambda kv: kv[0])):
        if param.grad is None:
            continue
        flat = param.grad.reshape(-1)
        for c, start in enumerate(range(0, flat.numel(), CHUNK)):
            piece = flat[start : start + CHUNK].float()
            gen = torch.Generator(device=piece.device).manual_seed(seed + 1_000_003 * i + c)
            r = torch.randn(PROJECTIONS, piece.numel(), generator=gen, device=piece.device)
            out += (r @ piece).double().cpu()
    return out


def non_finite_gradient(model: torch.nn.Module) -> str:
    """"the gradient of NAME" for the first parameter (by name) whose gradient is not finite, else ""."""
    grads = sorted((n, p.grad) for n, p in model.named_parameters() if p.grad is not None)
    return next((f"the gradient of {name}" for name, grad in grads if not torch.isfinite(grad).all()), "")


def _zero_grads(model: torch.nn.Module) -> None:
    for param in model.parameters():
        param.grad = None


@dataclass
class SelfCheckResult:
    mode: str
    examples: int
    tokens: int
    max_logit_diff: float
    max_loss_diff: float
    tolerance: float
    worst_example: int
    dtype: str
    grad_gap: float = 0.0
    """max over projections of |packed - one by one| / RMS of the one-by-one projections."""
    grad_tolerance: float = float("inf")
    grad_noise: float = 0.0
    """The reference's own noise floor: its gap to itself run in reverse order."""
    loss: str = "token loss"
    """What the gradient is of (``CheckLoss.describe``)."""
    logp_diff: float | None = None
    """Where the loss of the check has per-sequence values (DPO): the worst sequence's |summed label log-prob,
    packed (the run's path) - alone| (worst relative to its tolerance); ``None``: not compared."""
    logp_tolerance: float = float("inf")
    """That sequence's tolerance: 2 x its label tokens x the logit tolerance (a log-prob moves by at most
    twice its logits' largest move, so logits within tolerance allow no more)."""
    worst_sequence: int = 0
    aux_diff: float | None = None
    """With a router aux loss: |the batch's aux loss, through the run's path - the same tokens' from each example
    alone| relative to the latter (``router_aux_check``); ``None``: not compared."""
    aux_tolerance: float = float("inf")
    aux_grad_gap: float | None = None
    """With a router aux loss and trainable parameters: its gradient's gap, as ``grad_gap``."""
    aux_grad_tolerance: float = float("inf")
    packed_nan: str = ""
    """What is not finite (NaN or inf) in the run's path: "the logits", "the gradient of NAME"; "" if none."""
    alone_nan: str = ""
    """What is not finite with the examples run one by one (the reference: the model's own, not packing's)."""

    @property
    def ratios(self) -> dict[str, float]:
        """Each comparison's gap over its tolerance (the check passes when none is above 1)."""
        out = {"logit diff": self.max_logit_diff / max(self.tolerance, 1e-30),
               "gradient gap": self.grad_gap / max(self.grad_tolerance, 1e-30)}
        if self.logp_diff is not None:
            out["sequence log-prob diff"] = self.logp_diff / max(self.logp_tolerance, 1e-30)
        if self.aux_diff is not None:
            out["router aux loss diff"] = self.aux_diff / max(self.aux_tolerance, 1e-30)
        if self.aux_grad_gap is not None:
            out["router aux gradient gap"] = self.aux_grad_gap / max(self.aux_grad_tolerance, 1e-30)
        return out

    @property
    def ok(self) -> bool:
        return all(r <= 1.0 for r in self.ratios.values())

    def line(self) -> str:
        return (
            f"{self.mode} micro-batch of {self.examples} examples / {self.tokens} tokens vs one by one ({self.dtype}): "
            f"max |logit diff| {self.max_logit_diff:.3g} (tolerance {self.tolerance:.3g}, worst example "
            f"#{self.worst_example}), max |token loss diff| {self.max_loss_diff:.3g}, " + self.logp_line() + self.grad_line()
            + self.aux_line()
        )

    def aux_line(self) -> str:
        if self.aux_diff is None:
            return ""
        grad = "" if self.aux_grad_gap is None else (
            f", its gradient gap {self.aux_grad_gap:.3g} (tolerance {self.aux_grad_tolerance:.3g})")
        return (f"; router aux loss (the batch's statistic vs its examples alone) relative diff {self.aux_diff:.3g} "
                f"(tolerance {self.aux_tolerance:.3g}){grad}")

    def logp_line(self) -> str:
        if self.logp_diff is None:
            return ""
        return (f"max |sequence log-prob diff| {self.logp_diff:.3g} (tolerance {self.logp_tolerance:.3g}, sequence "
                f"#{self.worst_sequence}), ")

    def grad_line(self) -> str:
        if self.grad_tolerance == float("inf"):
            return "gradient not compared (no trainable parameters)"
        return (
            f"gradient gap {self.grad_gap:.3g} ({self.loss}; tolerance {self.grad_tolerance:.3g}, reference noise "
            f"{self.grad_noise:.3g}; {PROJECTIONS} random projections)"
        )


def example_spans(batch: Batch) -> list[tuple[int, slice]]:
    """(row, token slice) of every example (or piece) of the batch, in order."""
    if batch.packed:
        cu = batch.cu_seqlens.tolist()
        return [(0, slice(s, e)) for s, e in zip(cu[:-1], cu[1:])]
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
            raise SelfCheckError(f"the example at token {span.start} has a label on its first token (crosses a boundary)")


def _alone(model: VarlenCausalLM, batch: Batch, row: int, span: slice) -> torch.Tensor:
    """One example of ``batch`` run alone through the padded path (the reference): its float logits."""
    ids = batch.input_ids[row : row + 1, span]
    position_ids = batch.position_ids[row : row + 1, span]  # a split piece keeps its offset
    return model(input_ids=ids, position_ids=position_ids, attention_mask=torch.ones_like(ids)).float()[0]


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=IGNORE_INDEX, reduction="none")


class TokenLossCheck:
    """The loss of the check under SFT: the summed token loss over the batch's label count, as a step takes it.

    A loss of the check (``CheckLoss``: this class, or ``trainer.objectives.dpo.PairLossCheck``) says how the
    packed batch's loss runs through the run's own path (``packed``) and how the same loss is made from
    its sequences run alone, ``group`` consecutive sequences at a time (``alone``), from each one's per-token
    losses: the token cross-entropy of its logits alone, unless the loss of the check has
    ``token_losses(batch, index, logits, labels)`` (``trainer.objectives.distill.check``: against the teacher run
    alone on the sequence)."""

    group = 1
    """Consecutive sequences whose loss comes together (a preference pair: 2): one backward per group."""

    def describe(self) -> str:
        return "token loss"

    def packed(self, model: VarlenCausalLM, batch: Batch, token_losses: list[torch.Tensor] | None = None):
        """(the batch's loss, differentiable, through the run's own path ``use_loss``, chunked or naive, or
        from ``token_losses``, per sequence, when a route gives logits; per-sequence summed label log-probs
        to compare with each sequence alone, or ``None``)."""
        if token_losses is not None:
            return sum(t.sum() for t in token_losses).div(_labelled(batch)), None
        return summed_token_loss(model, batch).div(_labelled(batch)), None

    def alone(self, batch: Batch, token_losses: list[torch.Tensor], labels: list[torch.Tensor]) -> torch.Tensor:
        """The loss of one group of sequences run alone (their token losses and labels), normalised as
        ``packed`` normalises."""
        return sum(t.sum() for t in token_losses).div(_labelled(batch))


def _labelled(batch: Batch) -> int:
    return max(1, int((batch.labels != IGNORE_INDEX).sum()))


def self_check(
    model: VarlenCausalLM,
    batch: Batch,
    tolerance: float | None = None,
    compute_dtype: torch.dtype | None = None,
    starts: list[int] | None = None,
    route=None,
    loss=None,
) -> SelfCheckResult:
    """Compare ``batch`` run as is with its examples run one by one (see the module docstring).
    ``starts``: first position of each segment (split pieces); ``None``: every segment starts at 0.
    ``route``: the way the run computes the batch when it is not ``model(**batch.model_inputs())`` -- an object
    with ``logits(batch)`` (the row's logits, this rank's part differentiable) and ``sum_over_ranks(t)`` (the
    gradient projections summed over the ranks that share the row): ``trainer.parallel.route.CPRoute``.
    ``loss``: the loss of the check (``TokenLossCheck``, the default; ``objective=dpo``: ``PairLossCheck``)."""
    check_positions(batch, starts)
    loss = loss or TokenLossCheck()
    device = next(model.parameters()).device
    dtype = compute_dtype or next(model.parameters()).dtype
    autocast = (
        torch.autocast(device.type, dtype=dtype) if dtype != next(model.parameters()).dtype else contextlib.nullcontext()
    )
    trains = any(p.requires_grad for p in model.parameters())
    spans = example_spans(batch)
    groups = [range(g, min(g + loss.group, len(spans))) for g in range(0, len(spans), loss.group)]

    per_token = getattr(loss, "token_losses", lambda batch, i, logits, labels: _token_losses(logits, labels))

    def alone_losses(group: range) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        labels = [batch.labels[spans[i][0], spans[i][1]] for i in group]
        return [per_token(batch, i, _alone(model, batch, *spans[i]), y) for i, y in zip(group, labels)], labels

    was_training = model.training
    model.eval()
    _zero_grads(model)
    nan = {"packed_nan": "", "alone_nan": ""}  # where a side is not finite (SelfCheckResult)
    try:
        with autocast, torch.set_grad_enabled(trains):
            full = packed_values = None  # the packed logits, once; the loss's per-sequence values
            if trains:
                if route is not None:  # under cp: the row sharded over the group, the loss on its gathered logits
                    full = route.logits(batch).float()
                    value, packed_values = loss.packed(
                        model, batch, [_token_losses(full[row, span], batch.labels[row, span]) for row, span in spans])
                else:  # the run's own loss through its own path, over its own count, as a step takes it
                    value, packed_values = loss.packed(model, batch)
                value.backward()
                nan["packed_nan"] = non_finite_gradient(model)
                packed = grad_projections(model)
                packed = route.sum_over_ranks(packed) if route is not None else packed
                _zero_grads(model)
                packed_values = None if packed_values is None else packed_values.detach().float()
            if full is None:  # the chunked loss gives no logits; a frozen model ran no loss
                with torch.no_grad():
                    full = (route.logits(batch) if route is not None else model(**batch.model_inputs())).float()
            full = full.detach()
            if not torch.isfinite(full).all():
                nan["packed_nan"] = "the logits"
            worst, worst_i, loss_diff, scale = 0.0, 0, 0.0, 1.0
            logps = []  # (|packed - alone| summed label log-prob, label tokens) per sequence
            for group in groups:  # one group's graph at a time: memory of one example (or pair) alone
                token_losses, labels = [], []
                for i in group:
                    row, span = spans[i]
                    alone = _alone(model, batch, row, span)
                    labels.append(batch.labels[row, span])
                    token_losses.append(per_token(batch, i, alone, labels[-1]))
                    alone = alone.detach()
                    if not nan["alone_nan"] and not torch.isfinite(alone).all():
                        nan["alone_nan"] = f"the logits of example #{i}"
                    together = full[row, span]
                    diff = float((together - alone).abs().max())
                    scale = max(scale, float(alone.abs().max()))
                    if diff > worst:
                        worst, worst_i = diff, i
                    if len(labels[-1]) > 1:
                        d = (_token_losses(together, labels[-1]) - _token_losses(alone, labels[-1])).abs().max()
                        loss_diff = max(loss_diff, float(d))
                    if packed_values is not None:
                        logps.append((abs(float(packed_values[i]) + float(token_losses[-1].detach().sum())),
                                      max(1, int((labels[-1][1:] != IGNORE_INDEX).sum()))))
                if trains:  # the grads of the groups accumulate in place, in the parameters' dtype
                    loss.alone(batch, token_losses, labels).backward()
            found = {}  # the gradient's and the log-probs' figures, where compared
            if trains:
                nan["alone_nan"] = nan["alone_nan"] or non_finite_gradient(model)
                reference = grad_projections(model)
                _zero_grads(model)
                rms = max(float(reference.pow(2).mean().sqrt()), 1e-30)
                noise = 0.0
                if dtype in NOISY_DTYPES:
                    for group in reversed(groups):  # the same reference, summed in the other order: its noise
                        loss.alone(batch, *alone_losses(group)).backward()
                    noise = float((grad_projections(model) - reference).abs().max()) / rms
                found = dict(grad_gap=float((packed - reference).abs().max()) / rms, grad_noise=noise,
                             grad_tolerance=GRAD_NOISE_MULT * noise + GRAD_TOLERANCE.get(dtype, 1e-1))
            if getattr(model, "router_aux", None) is not None and route is None:  # cp > 1 refuses it
                found |= router_aux_check(model, batch, spans, trains, dtype, found.get("grad_noise", 0.0),
                                          rms if trains else 0.0)
    finally:
        _zero_grads(model)
        model.train(was_training)
    tol = (TOLERANCE.get(dtype, 5e-2) if tolerance is None else tolerance) * scale
    if logps:  # the worst sequence relative to its tolerance (2 x its label tokens x the logit tolerance)
        k = max(range(len(logps)), key=lambda j: logps[j][0] / logps[j][1])
        found |= dict(logp_diff=logps[k][0], logp_tolerance=2 * logps[k][1] * tol, worst_sequence=k)
    return SelfCheckResult(
        "packed" if batch.packed else "padded", batch.num_examples, batch.num_tokens, worst, loss_diff, tol,
        worst_i, str(dtype).split(".")[-1], loss=loss.describe(), **found, **nan,
    )


def router_aux_check(model: VarlenCausalLM, batch: Batch, spans: list[tuple[int, slice]], trains: bool,
                     dtype: torch.dtype, noise: float, token_rms: float = 0.0) -> dict:
    """The router aux loss of ``batch`` through the run's path against the same tokens' statistic from each
    example run alone (their ``RouterStats`` merged); with trainable parameters its gradient too, the reference's
    taken one example at a time with the batch's counts (``RouterStats.with_counts_of``: the counts carry no
    gradient; a count that differs shows in the value). ``SelfCheckResult``'s ``aux_*`` fields.

    The gradient gap is measured on the scale of what a step trains, ``token gradient + coef x aux gradient``:
    relative to the larger of the aux gradient's own size and the token gradient's (``token_rms``) over
    ``coef``. Near balanced routing the aux gradient alone is at float rounding (1e-8 in float32), where a
    relative gap of its own would read rounding as a leak."""
    _, stats = model.token_loss(**batch.model_inputs(), labels=batch.labels, router=True)
    value = stats.balance_loss()
    if trains:
        value.backward()
        packed = grad_projections(model)
        _zero_grads(model)
    parts = []
    for row, span in spans:  # one example's graph at a time
        ids = batch.input_ids[row : row + 1, span]
        part = model.router_statistics(ids, batch.position_ids[row : row + 1, span], attention_mask=torch.ones_like(ids))
        if trains:
            part.with_counts_of(stats).backward()
        parts.append(RouterStats(*(t.detach() for t in part)))
    reference = float(RouterStats.merged(parts).balance_loss())
    found = dict(aux_diff=abs(float(value.detach()) - reference) / max(abs(reference), 1e-30),
                 aux_tolerance=TOLERANCE.get(dtype, 5e-2))
    if trains:
        alone = grad_projections(model)
        _zero_grads(model)
        rms = max(float(alone.pow(2).mean().sqrt()), token_rms / model.router_aux.coef, 1e-30)
        found |= dict(aux_grad_gap=float((packed - alone).abs().max()) / rms,
                      aux_grad_tolerance=GRAD_NOISE_MULT * noise + GRAD_TOLERANCE.get(dtype, 1e-1))
    return found


def nan_line(result: SelfCheckResult, alone: bool) -> str:
    """The self-check's one line for a NaN (or inf): the model's own where the examples run one by one give it
    (``alone``: on any rank), else the run's packed (or padded) path's; where, as this rank found it."""
    if alone:
        where = result.alone_nan or "(on another rank)"
        return (f"startup self-check failed: {where} is not finite (NaN) with the check batch's examples run one by "
                "one, unpacked: the model's own computation, not packing (e.g. an example that starts with a token "
                "whose embedding is zero); a step would train nothing: stopping before step 1")
    where = result.packed_nan or "(on another rank)"
    return (f"startup self-check failed: {result.mode}, {where} is not finite (NaN) where the same examples run one "
            "by one are finite: stopping before step 1 (model.self_check=false skips this check)")


LADDER = (0.25, 0.5, 0.75, 0.9)
"""Length quantiles of the run's examples added to the check batch, where the token budget has room."""


def worst_case_microbatch(sampler) -> np.ndarray:
    """The self-check's batch, built from the run's own examples so that luck cannot dodge it (the same on
    every rank): the longest example beside the shortest and a 1-token piece, then examples at the length
    quantiles of ``LADDER``. Any length threshold the model has between the shortest and the longest
    example (a sliding window, the original context of a longrope model, a dynamic rope's scaling start)
    is then crossed by examples side by side. Packed: ``(k, 3)`` pieces within the token budget (the longest
    is cut to fit); padded: whole examples, at least two rows."""
    lengths = sampler.lengths
    order = np.argsort(lengths, kind="stable")
    quantiles = [order[min(len(order) - 1, int(q * len(order)))] for q in LADDER]
    longest, shortest = int(order[-1]), int(order[0])
    if not sampler.cfg.packed:
        rows = max(2, sampler.padded_batch_size)
        return np.array(list(dict.fromkeys([longest, shortest, *map(int, quantiles)]))[:rows], dtype=np.int64)
    budget = int(sampler.params.budget)
    short = [(shortest, 0, int(lengths[shortest]))] if lengths[longest] > 1 else []
    short.append((longest, 0, 1))  # a 1-token example (the longest's first token)
    room = budget - sum(end - start for _, start, end in short)
    pieces = [short[-1], (longest, 0, int(min(lengths[longest], max(room, 1)))), *short[:-1]]
    room -= pieces[1][2]
    for index in map(int, quantiles):
        if 0 < lengths[index] <= room:
            pieces.append((index, 0, int(lengths[index])))
            room -= int(lengths[index])
    return np.array(pieces, dtype=np.int64)


def run_startup_self_check(
    model: VarlenCausalLM, batch: Batch, tolerance: float | None, compute_dtype, indices: np.ndarray | None = None,
    route=None, loss=None,
) -> None:
    """Run ``self_check`` on every rank, agree on the worst result, log it, raise ``SelfCheckError`` on a
    mismatch. ``indices``: what the batch was collated from (a ``(k, 3)`` array of pieces when split);
    ``loss``: the loss of the check (``self_check``)."""
    starts = piece_starts(indices) if indices is not None else None
    param = next(model.parameters())
    # Check in the master dtype (exact); only kernels that refuse it run under autocast to the compute dtype.
    if model.backend.unavailable(param.device, param.dtype) is None:
        compute_dtype = None
    device = param.device
    result = self_check(model, batch.to(device), tolerance, compute_dtype, starts, route, loss)
    names, ratios = zip(*result.ratios.items())  # the same keys on every rank: the same loss of the check
    # A NaN gap (NaN logits or gradients) must fail: max() and the all-reduce would let a NaN ratio pass. Where
    # a side is not finite (any rank's) is said as such, never as examples that mix.
    nans = [float(bool(result.packed_nan)), float(bool(result.alone_nan))]
    *excess, packed_nan, alone_nan = distributed.all_reduce_max(
        [r if math.isfinite(r) else math.inf for r in ratios] + nans, device)
    if alone_nan or packed_nan:
        raise SelfCheckError(nan_line(result, bool(alone_nan)))
    if max(excess) > 1.0:
        what = names[max(range(len(excess)), key=excess.__getitem__)]
        if math.isinf(max(excess)):  # a NaN figure from finite logits and gradients: not a measured leak
            raise SelfCheckError(f"startup self-check failed: {result.line()}; worst rank's {what} is not finite "
                                 "(NaN): stopping before step 1 (model.self_check=false skips this check)")
        raise SelfCheckError(
            f"startup self-check failed: {result.line()}; worst rank's {what} is {max(excess):.3g}x over "
            "tolerance. "
            "Examples are not kept apart: stopping before step 1 (model.self_check=false skips this check)"
        )
    log.info("startup self-check passed%s: %s", "" if route is None else f" ({route})", result.line())
