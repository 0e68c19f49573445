"""Resume checks the config: a checkpoint stores its run's job config (``job_config.json``), and a resume
whose config changes what is trained is refused, naming the keys.

Every key alters the math unless it is listed in ``HARMLESS`` (how long to train, logging, eval and
checkpoint cadence, where files go, how the same math is laid out on devices), so a new config section is
checked from the day it exists. ``resume_allow_changes=[key, ...]`` accepts named changes (a key or a whole
section). A ``grad_accum`` change that keeps ``grad_accum x world size`` (the global batch) is accepted: it is
what the world-size warning suggests. Under context parallelism the world that counts is the data-parallel one
(world / ``parallel.cp``); a changed ``parallel.cp`` that keeps the row (``cp x token_budget``) is handled as a
world-size change, one that changes the row is refused naming ``parallel.cp`` (``cp_change``).
"""

from __future__ import annotations

import logging
from typing import Any

from trainer.config import ConfigError
from trainer.config.common import RENAMED_KEYS

log = logging.getLogger("trainer.checkpoint")

JOB_CONFIG = "job_config.json"

HARMLESS = (
    "max_steps",
    "stop_after_steps",
    "summary_skip_steps",
    "name",
    "output_root",
    "run_dir",
    "resume",
    "resume_allow_changes",
    "logger",
    "checkpoint",
    "guard",
    "eval.every",
    "eval.max_examples",
    "data.cache_dir",
    "data.plugins",
    "data.stream.eval_records",
    "model.attention",
    "model.self_check",
    "model.self_check_tolerance",
    "parallel.device",
    "parallel.backend",
    "parallel.dp_replicate",
    "parallel.reshard_after_forward",
    "parallel.activation_checkpointing",
    "parallel.activation_checkpointing_every",
    "parallel.cpu_offload",
    "parallel.compile",
    "parallel.compile_backend",
)
"""Keys (or sections) whose change leaves the trained math alone."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and scalars are leaves."""
    if not isinstance(tree, dict) or (prefix and not tree):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out |= flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return out


def _covered(key: str, names: list[str] | tuple[str, ...]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def changed_keys(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """Keys whose value differs (keys the saved config does not have, written by older code, are skipped;
    keys it has under a former name are compared under the new one)."""
    old = {RENAMED_KEYS.get(k, k): v for k, v in flatten(saved).items()}
    new = flatten(current)
    return {k: (old[k], new.get(k)) for k in sorted(old) if k in new and old[k] != new[k]}


def check_resume_config(
    saved: dict, current: dict, allowed: list[str], saved_world: int, world: int, where: str
) -> None:
    """Raise ``ConfigError`` naming every math-changing key (unless allowed); log a world-size change."""
    changes = {k: v for k, v in changed_keys(saved, current).items() if not _covered(k, HARMLESS)}
    saved_world, world = cp_change(saved, current, changes, saved_world, world, where)
    if "grad_accum" in changes and changes["grad_accum"][0] * saved_world == changes["grad_accum"][1] * world:
        changes.pop("grad_accum")  # the global batch (micro-batches per step over all ranks) is unchanged
    refused = {k: v for k, v in changes.items() if not _covered(k, allowed)}
    if refused:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        raise ConfigError(
            f"resume from {where}: the config changes what is trained ({listed}); resume with the checkpoint's "
            f"values, start a new run_dir, or accept with resume_allow_changes=[{','.join(refused)}]"
        )
    for key, (old, new) in changes.items():
        log.warning("resume: %s changed from %r to %r (allowed by resume_allow_changes)", key, old, new)
    if saved_world != world:  # data-parallel worlds: a CP group trains one row
        warn_world_size(
            saved.get("grad_accum", current.get("grad_accum", 1)), saved_world, world, current.get("grad_accum", 1)
        )


def cp_change(saved: dict, current: dict, changes: dict, saved_world: int, world: int, where: str) -> tuple[int, int]:
    """A changed ``parallel.cp`` changes the data-parallel world (world / cp groups). When the packed row
    (``cp x packing.token_budget``) stays the same, the bins are the same and the sampler re-deals the
    unserved ones to the new groups, as on a world-size change: both keys leave ``changes`` and the data
    worlds are returned for the world-size rule. A changed row changes every bin: refused in one line.

    Returns ``(saved data-parallel world, data-parallel world)``."""
    if "parallel.cp" not in changes:
        cp = int(current.get("parallel", {}).get("cp", 1))
        return saved_world // cp, world // cp
    saved_cp, cp = (int(x) for x in changes.pop("parallel.cp"))
    budget = {
        "saved": saved.get("packing", {}).get("token_budget"),
        "now": current.get("packing", {}).get("token_budget"),
    }
    old_row, new_row = saved_cp * budget["saved"], cp * budget["now"]
    if old_row != new_row:
        keep = old_row / cp
        how = f"packing.token_budget={int(keep)} keeps it" if keep == int(keep) else f"parallel.cp={saved_cp}"
        raise ConfigError(
            f"resume from {where}: parallel.cp {saved_cp} -> {cp} changes the packed row ({saved_cp} x "
            f"{budget['saved']} = {old_row} -> {cp} x {budget['now']} = {new_row} tokens), so every bin differs; {how}"
        )
    changes.pop("packing.token_budget", None)
    log.warning(
        "resume: parallel.cp %d -> %d keeps rows of %d tokens; %d -> %d data-parallel group(s), the "
        "unserved bins are re-dealt to them",
        saved_cp,
        cp,
        new_row,
        saved_world // saved_cp,
        world // cp,
    )
    return saved_world // saved_cp, world // cp


def warn_world_size(saved_accum: int, saved_world: int, world: int, accum: int) -> None:
    """Say what a world-size change does to tokens per step, and how to keep the global batch."""
    before, after = saved_accum * saved_world, accum * world
    keep = saved_accum * saved_world / world
    how = (
        f"grad_accum={int(keep)} keeps it"
        if keep == int(keep) and keep >= 1
        else f"no integer grad_accum keeps it on {world} rank(s)"
    )
    log.warning(
        "resume on %d rank(s), the checkpoint was saved on %d: each optimizer step now takes %d micro-batches "
        "instead of %d, so tokens per step change by x%.2f (learning-rate schedule unchanged); %s",
        world,
        saved_world,
        after,
        before,
        after / before,
        "the global batch is kept" if after == before else how,
    )
