"""Every causal-LM family of your transformers: exact / refused (why) / skipped (why) / untested.

    python benchmarks/family_matrix.py                 # the table packfsdp applies (no models built, 1 s)
    python benchmarks/family_matrix.py --probe         # also probe every family on CPU (one core; docs/families.md
                                                       # gives the command, versions and duration of the last sweep)
    python benchmarks/family_matrix.py --probe --jobs 2 --json matrix.json  # two families at a time; rows to a file
    python benchmarks/family_matrix.py --probe llama phi3 falcon   # probe a few
    python benchmarks/family_matrix.py --probe --exact # probe every family the table calls exact
    python benchmarks/family_matrix.py --markdown      # the summary table for docs/families.md

The table (``trainer.model.families``, the certification's prior) was probed with one transformers version;
``--probe`` reruns the probe against yours: the certification's replica stage on each family's default config
(``trainer.model.certification.replica.probe``: a tiny replica, a sliding window of 6 where the family has
one; a packed row runs the trainer's step, the default chunked loss through the decoder and the boundary
relay, backward, then one optimizer step; against its examples one by one: logits and every gradient, in
float64, float32 where the family cannot run in float64, before and after the step), each family in its own
forked process with a time limit (``--jobs`` at a time; the seconds each took go to ``--json``), and flags
any family whose probe disagrees with the table (``MISMATCH``: tell us). A family transformers added after the
table was made shows as ``untested``: the replica and the startup self-check decide for a run's own config.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import resource
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.model.certification import Stage
from trainer.model.certification.replica import probe
from trainer.model.families import TESTED_WITH, verdict


def causal_lm_families() -> list[str]:
    """Every ``model_type`` of the installed transformers' causal-LM auto mapping."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


MEMORY_HEADROOM = 8 << 30
"""Bytes of address space a probe may add to what the parent holds (a family whose "tiny" config still
allocates gigabytes fails alone, not the machine)."""


def _limit_memory() -> None:
    try:
        held = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (held + MEMORY_HEADROOM, resource.RLIM_INFINITY))
    except (OSError, ValueError):  # not Linux: no limit
        pass


def _probe_child(family: str, queue) -> None:
    # A forked child inherits the parent's OpenMP thread pool in a broken state: once the parent has run a
    # parallel op (a test suite has), the child's first one waits forever on a team barrier. One thread
    # never forms a team.
    torch.set_num_threads(1)
    _limit_memory()
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    queue.put(probe(family))


def probe_isolated(family: str, timeout_s: float):
    """``probe(family)`` in a forked child (a family that hangs or eats memory cannot take the run down)."""
    return next(probe_many([family], timeout_s))[1]


def probe_many(families: list[str], timeout_s: float, jobs: int = 1):
    """``probe_isolated`` for each family, ``jobs`` children at a time: yields (family, result, seconds) in the
    order of ``families``. The children are forked from this thread (no threads: fork copies only the caller)."""
    ctx = mp.get_context("fork")
    running: dict[str, tuple] = {}
    done: dict[str, tuple] = {}
    waiting = list(families)
    for family in families:
        while family not in done:
            while waiting and len(running) < max(1, jobs):
                name = waiting.pop(0)
                queue = ctx.Queue()
                child = ctx.Process(target=_probe_child, args=(name, queue))
                child.start()
                running[name] = (child, queue, time.monotonic())
            for name, (child, queue, start) in list(running.items()):
                late = time.monotonic() - start > timeout_s
                if child.is_alive() and not late:
                    continue
                if late and child.is_alive():
                    child.kill()
                    result = Stage("replica", "unbuildable", f"no result within {timeout_s:g} s")
                else:
                    result = queue.get() if not queue.empty() else None
                    result = result or Stage("replica", "unbuildable", f"exit code {child.exitcode}")
                child.join()
                done[name] = (result, time.monotonic() - start)
                del running[name]
            if family not in done:
                time.sleep(0.05)
        yield (family, *done.pop(family))


def agrees(kind: str, outcome: str) -> bool:
    """The probe is consistent with the table: a family the table calls exact must probe exact, or be
    refused by packfsdp for the probe's config (Phi-3.5-MoE with a binding window). A refused family may
    probe exact: its reason can lie outside the tiny probe, or transformers fixed it since."""
    return outcome in ("exact", "refused") if kind == "exact" else True


def markdown(rows: list[tuple[str, str, str]]) -> str:
    """A summary table: verdict -> count and names, then the reasons."""
    by_kind: dict[str, list[str]] = defaultdict(list)
    by_reason: dict[str, list[str]] = defaultdict(list)
    for family, kind, reason in rows:
        by_kind[kind].append(family)
        if reason:
            by_reason[f"{kind}: {reason}"].append(family)
    lines = ["| verdict | count | families |", "|---|---|---|"]
    lines += [
        f"| {kind} | {len(by_kind[kind])} | {', '.join(by_kind[kind])} |"
        for kind in ("exact", "refused", "skipped", "untested")
        if by_kind[kind]
    ]
    lines += ["", "| why | families |", "|---|---|"]
    lines += [f"| {reason} | {', '.join(names)} |" for reason, names in sorted(by_reason.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="only these model types (default: every causal-LM family)")
    parser.add_argument("--probe", action="store_true", help="build and probe each family (CPU, minutes)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per family probe")
    parser.add_argument("--jobs", type=int, default=1, help="families probed at once (one core each)")
    parser.add_argument("--exact", action="store_true", help="only the families the table calls exact")
    parser.add_argument("--markdown", action="store_true", help="print the docs summary table")
    parser.add_argument("--json", type=Path, help="also write the rows (and probe results) here")
    args = parser.parse_args(argv)
    families = args.families or causal_lm_families()
    if args.exact:
        families = [f for f in families if verdict(f).kind == "exact"]
    rows, records, mismatches = [], [], 0
    start = time.monotonic()
    print(
        f"transformers {transformers.__version__} (table probed with {TESTED_WITH}): {len(families)} families",
        file=sys.stderr,
    )
    probed = probe_many(families, args.timeout, args.jobs) if args.probe else ((f, None, 0.0) for f in families)
    for family, result, seconds in probed:
        v = verdict(family)
        rows.append((family, v.kind, v.reason))
        record = {"family": family, "verdict": v.kind, "reason": v.reason}
        line = f"{family:28s} {v.kind:9s} {v.reason}"
        if result is not None:
            record |= {"probe": f"{result.outcome}: {result.detail}", "seconds": round(seconds, 1)}
            ok = agrees(v.kind, result.outcome)
            mismatches += not ok
            line += f"{'  ' if v.reason else ''}[probe: {result.outcome}: {result.detail}]"
            line += "" if ok else "  MISMATCH"
        records.append(record)
        if not args.markdown:
            print(line, flush=True)
    if args.markdown:
        print(markdown(rows))
    counts = {k: sum(1 for _, kind, _ in rows if kind == k) for k in ("exact", "refused", "skipped", "untested")}
    took = f"; probed in {time.monotonic() - start:.0f} s" if args.probe else ""
    print(", ".join(f"{n} {k}" for k, n in counts.items()) + took, file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
