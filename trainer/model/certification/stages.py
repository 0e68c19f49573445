"""The three stages in order: the table prior and the replica when the model is built, the self-check at start.

``certify_config(config)`` runs before any weight is loaded (``build_model``): the table prior refuses a family
or a layer type no backend packs in one line, then the replica stage judges the config itself (rank 0
judges or reads the cache; every rank takes its verdict). ``certify(model, batch)`` runs the startup
self-check on the run's real model and a worst-case batch of its own data (``worst_case_microbatch``), through
the run's route and the objective's loss of the check, agrees on the worst result across ranks, and logs the
certificate's one line. Every refusal is one line naming the stage and the setting (``refusal_line``): a
``FamilyRefusedError`` (a config error, exit code 2) before the model is built, a ``SelfCheckError`` (exit 3)
after.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from trainer import distributed
from trainer.errors import SelfCheckError
from trainer.model.certification.certificate import (
    PRIOR,
    REFUSES,
    REPLICA,
    SELF_CHECK,
    Certificate,
    Stage,
    family_of,
    refusal_line,
)
from trainer.model.certification.engine import measure, nan_line
from trainer.model.certification.replica import cached_judge
from trainer.model.families import (
    NO_CAUSAL_LM,
    TESTED_WITH,
    FamilyRefusedError,
    has_causal_lm,
    selected_keys,
    verdict,
)
from trainer.model_config import trained_config
from trainer.packing import piece_starts

log = logging.getLogger(__name__)

KEEP_SELF_CHECK = "keep model.self_check=true so the startup self-check can vouch for it"
STOPPING = ": stopping before step 1 (model.self_check=false skips this check)"


def prior(config, self_check: bool = True) -> Stage:
    """The table's verdict on ``config`` (``trainer.model.families``), its layer types too (``selected_keys``);
    an untested family (newer than the table) has none: the replica and the self-check decide."""
    family = family_of(config)
    found = verdict(family)
    if found.kind in ("refused", "skipped"):
        raise FamilyRefusedError(refusal_line(family, PRIOR, found.reason))
    if found.kind == "untested" and not has_causal_lm(config):  # transformers could not load it: one line
        raise FamilyRefusedError(refusal_line(family, PRIOR, NO_CAUSAL_LM))
    if reason := selected_keys(config):
        raise FamilyRefusedError(refusal_line(family, PRIOR, reason))
    if found.kind == "exact":
        return Stage(PRIOR, "exact", found.reason)
    untested = f"untested with packing (not in packfsdp's table for transformers {TESTED_WITH})"
    if not self_check:
        raise FamilyRefusedError(refusal_line(family, PRIOR, f"{untested}; {KEEP_SELF_CHECK}"))
    return Stage(PRIOR, "untested", untested)


def replica_stage(config, family: str, self_check: bool) -> Stage:
    """The replica's verdict (``certification.replica``). Under torchrun only rank 0 reads the cache or judges
    (seconds on a miss); every rank gets its verdict (one broadcast), so no rank can decide otherwise."""
    found: list[Stage] = []
    distributed.on_rank0_then_all(lambda: found.append(cached_judge(config)))  # rank 0's error is every rank's
    stage = distributed.broadcast_object(found[0] if found else None)
    if stage.outcome in REFUSES:
        raise FamilyRefusedError(refusal_line(family, REPLICA, stage.detail))
    if stage.outcome == "unbuildable" and not self_check:
        raise FamilyRefusedError(refusal_line(family, REPLICA, f"{stage.detail}: {KEEP_SELF_CHECK}"))
    return stage


def certify_config(config, self_check: bool = True) -> Certificate:
    """The stages that judge ``config`` before the model is built: the table prior, then the replica. A
    multimodal model is judged by its language model (``trained_config``). ``self_check``: whether the startup
    self-check will run (without it, a family or config no earlier stage vouches for is refused)."""
    config = trained_config(config)
    family = family_of(config)
    certificate = Certificate(family, [prior(config, self_check)])
    certificate.stages.append(replica_stage(config, family, self_check))
    return certificate


def check_model(
    model,
    batch,
    tolerance: float | None = None,
    compute_dtype=None,
    indices: np.ndarray | None = None,
    route=None,
    loss=None,
) -> Stage:
    """The self-check stage: ``engine.measure`` of ``batch`` on ``model`` (unsharded, before FSDP) on every rank,
    the worst result agreed across ranks; raises ``SelfCheckError`` (one line) on a mismatch or a NaN.
    ``indices``: what the batch was collated from (a ``(k, 3)`` array of pieces when split); ``route``: the
    run's way of computing a batch when not the model as is (``CPRoute``); ``loss``: the loss of the check."""
    param = next(model.parameters())
    # Check in the master dtype (exact); only kernels that refuse it run under autocast to the compute dtype.
    if model.backend.unavailable(param.device, param.dtype) is None:
        compute_dtype = None
    family = family_of(model.config)
    stage = SELF_CHECK if route is None else f"{SELF_CHECK} through the {route}"
    try:
        m = measure(
            model,
            batch.to(param.device),
            loss,
            route=route,
            compute_dtype=compute_dtype,
            starts=piece_starts(indices) if indices is not None else None,
            tolerance=tolerance,
        )
    except SelfCheckError as e:  # the batch's positions or labels do not restart per example
        raise SelfCheckError(refusal_line(family, stage, f"{e}{STOPPING}")) from None
    names, ratios = list(m.ratios), list(m.ratios.values())  # the same keys on every rank: the same loss of the check
    # A NaN gap must fail: max() and the all-reduce would let a NaN ratio pass. Where a side is not finite
    # (any rank's) is said as such, never as examples that mix.
    nans = [float(bool(m.packed_nan)), float(bool(m.alone_nan))]
    *excess, packed_nan, alone_nan = distributed.all_reduce_max(
        [r if math.isfinite(r) else math.inf for r in ratios] + nans, param.device
    )
    if alone_nan or packed_nan:
        raise SelfCheckError(refusal_line(family, stage, nan_line(m, bool(alone_nan)) + STOPPING))
    if max(excess) > 1.0:
        what = names[max(range(len(excess)), key=excess.__getitem__)]
        how = "is not finite (NaN)" if math.isinf(max(excess)) else f"is {max(excess):.3g}x over tolerance"
        raise SelfCheckError(
            refusal_line(family, stage, f"{m.line()}; worst rank's {what} {how}: examples are not kept apart{STOPPING}")
        )
    return Stage(SELF_CHECK, "exact", m.line() + ("" if route is None else f" (through the {route})"), m)


def certify(
    model,
    batch=None,
    tolerance: float | None = None,
    compute_dtype=None,
    indices: np.ndarray | None = None,
    route=None,
    loss=None,
) -> Certificate:
    """The run's certificate: the stages ``build_model`` ran (``model.certificate``), then the self-check on
    ``batch`` (``check_model``; ``None``: ``model.self_check=false``, the stage is off); logs its one line."""
    built = getattr(model, "certificate", None) or Certificate(getattr(model.config, "model_type", "the model"))
    if batch is None:
        stage = Stage(SELF_CHECK, "off", "model.self_check=false")
    else:
        stage = check_model(model, batch, tolerance, compute_dtype, indices, route, loss)
    model.certificate = Certificate(built.family, [*built.stages, stage])
    log.info("%s", model.certificate.line())
    return model.certificate


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
