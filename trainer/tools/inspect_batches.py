"""Look at packed micro-batches before a long run: ``packfsdp inspect recipe=NAME num_batches=2``.

Builds the tokenizer, dataset and sampler exactly as ``trainer.train`` would for the same overrides
(``trainer.pipeline.build_training_data``: the eval hold-out removed), then
decodes the first micro-batches of one rank and prints, for each example: its slot in the row
(``cu_seqlens`` boundary), its position_ids (which must restart at 0) and its text with the tokens that
carry **no** loss shown inside ``[[ ]]`` (the first token of every example never carries loss). Under context
parallelism (``parallel.cp > 1``) each row is followed by what every rank of the CP group holds of it
(``cp_view``: its query runs, the example and positions of each, its pads and its attention pairs).

Extra keys (not part of the training config): ``num_batches`` (default 2), ``rank`` (default 0), ``world_size``
(default ``parallel.cp``, one data-parallel group: the plan a run on that many ranks would deal) and ``show_tokens``
(tokens shown at each end of an example, default 40; ``-1`` shows everything). Every other ``key=value`` is a normal
Hydra override (``packing=none`` shows the padded baseline's micro-batches).
"""

from __future__ import annotations

import sys
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from trainer.cli import check_group_choices
from trainer.compose import compose_job_config, register_configs
from trainer.config import ConfigError
from trainer.data.examples import IGNORE_INDEX
from trainer.packing import piece_starts
from trainer.safety import printable

if TYPE_CHECKING:
    from trainer.collate import Batch

EXTRA = {"num_batches": 2, "rank": 0, "world_size": 0, "show_tokens": 40}
"""``world_size=0``: ``parallel.cp`` (one data-parallel group)."""
NO_LOSS_OPEN, NO_LOSS_CLOSE = "[[", "]]"


def render_tokens(tokenizer, ids: np.ndarray, has_loss: np.ndarray, show: int) -> str:
    """Decoded text, no-loss runs inside ``[[ ]]``; long examples keep ``show`` tokens at each end."""
    spans = [(0, len(ids))] if show < 0 or len(ids) <= 2 * show else [(0, show), (len(ids) - show, len(ids))]
    parts = []
    for k, (start, stop) in enumerate(spans):
        if k:
            parts.append(f" ...({spans[1][0] - spans[0][1]} tokens)... ")
        t = start
        while t < stop:
            end = t
            while end < stop and has_loss[end] == has_loss[t]:
                end += 1
            text = tokenizer.decode(ids[t:end].tolist())
            parts.append(text if has_loss[t] else f"{NO_LOSS_OPEN}{text}{NO_LOSS_CLOSE}")
            t = end
    return "".join(parts).replace("\n", "\\n")


def positions_summary(pos: np.ndarray, start: int = 0) -> str:
    ok = np.array_equal(pos, np.arange(start, start + len(pos)))
    shown = " ".join(map(str, pos[:4])) + (f" ... {pos[-1]}" if len(pos) > 4 else "")
    verdict = (
        ("restart at 0: ok" if start == 0 else f"split piece, continues at {start}: ok") if ok else "DO NOT RESTART"
    )
    return f"position_ids {shown} ({verdict})"


def describe(batch: Batch, tokenizer, budget: int, show: int, starts: list[int] | None = None) -> list[str]:
    """Lines describing one micro-batch and each of its examples."""
    from trainer.model.certification.engine import example_spans  # noqa: PLC0415 -- heavy (torch, transformers): after the command line's checks

    labels = batch.labels.numpy()
    slots = [(row, span.start, span.stop) for row, span in example_spans(batch)]
    if batch.packed:
        cu = batch.cu_seqlens.tolist()
        what = (
            f"{batch.num_pairs} pairs ({batch.num_examples} sequences)"
            if batch.num_pairs
            else f"{batch.num_examples} examples"
        )
        head = (
            f"packed row: {what}, {batch.num_tokens}/{budget} tokens "
            f"({100 * batch.num_tokens / budget:.1f}% of the budget), {batch.num_label_tokens} carry loss | "
            f"cu_seqlens {cu}"
        )
    else:
        head = (
            f"padded: {batch.num_examples} rows x {batch.input_ids.shape[1]} positions, {batch.num_tokens} real "
            f"tokens ({100 * (1 - batch.num_tokens / batch.num_positions):.1f}% padding), "
            f"{batch.num_label_tokens} carry loss"
        )
    lines = [head]
    for k, (row, s, e) in enumerate(slots):
        ids = batch.input_ids[row, s:e].numpy()
        has_loss = labels[row, s:e] != IGNORE_INDEX
        where = f"tokens {s}-{e - 1}" if batch.packed else f"row {row}, pads after {e}"
        name = (
            f"pair {batch.example_ids[k]} {('chosen', 'rejected')[k % 2]}"
            if batch.num_pairs
            else f"example {batch.example_ids[k]}"
        )
        lines.append(
            f"  {name} | {where} ({e - s} tokens, {int(has_loss.sum())} with loss) | "
            f"{positions_summary(batch.position_ids[row, s:e].numpy(), starts[k] if starts else 0)}"
            f"{'' if not has_loss[0] else ' | FIRST TOKEN HAS A LABEL'}"
        )
        lines.append("    " + render_tokens(tokenizer, ids, has_loss, show))
    return lines


def cp_view(batch: Batch, cp: int, split: str) -> list[str]:
    """What each rank of a CP group holds of a packed row (``trainer.parallel.cp_layout.plan_shards``): per rank,
    its query runs as ``example e: tokens a-b (positions p-q)`` in slot order, its pads and its attention pairs."""
    from trainer.parallel.cp_layout import plan_shards  # noqa: PLC0415 -- heavy (the model package): after the command line's checks

    lines = [
        f"  context parallel: cp={cp}, {split} split, {plan_shards(batch.cu_seqlens.tolist(), cp, split)[0].slots} "
        "slots per rank"
    ]
    cu = batch.cu_seqlens.tolist()
    for shard in plan_shards(cu, cp, split):
        runs, bounds = [], shard.cu_seqlens_q.tolist()
        for a, b in pairwise(bounds):
            first, last = int(shard.index[a]), int(shard.index[b - 1])
            if first < 0:
                continue  # the pads' run
            doc = int(shard.doc_q[a])
            ex = batch.example_ids[doc] if doc < len(batch.example_ids) else doc
            runs.append(
                f"example {ex}: tokens {first}-{last} (positions {int(shard.pos_q[a])}-{int(shard.pos_q[b - 1])})"
            )
        pads = int((shard.index < 0).sum())
        lines.append(
            f"    rank {shard.rank}: {shard.slots - pads} tokens + {pads} pads, {shard.pairs:.0f} attention "
            f"pairs | " + "; ".join(runs)
        )
    return lines


def parse_args(argv: list[str]) -> tuple[dict, list[str]]:
    extra, overrides = dict(EXTRA), []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in EXTRA:
            extra[key] = int(value)
        else:
            overrides.append(arg)
    return extra, overrides


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra, overrides = parse_args(argv)
    register_configs()
    check_group_choices(overrides)
    try:
        cfg = compose_job_config(overrides)
    except ConfigError as e:
        sys.exit(f"packfsdp: config error: {e}")
    extra["world_size"] = extra["world_size"] or cfg.parallel.cp
    if not 0 <= extra["rank"] < extra["world_size"]:
        sys.exit(f"packfsdp: rank={extra['rank']} is outside world_size={extra['world_size']}")
    try:
        cfg.validate_world(extra["world_size"])
    except ConfigError as e:
        sys.exit(f"packfsdp: config error: {e}")

    from trainer.pipeline import build_training_data  # noqa: PLC0415 -- heavy (the model package): after the command line's checks

    data = build_training_data(cfg, extra["rank"], extra["world_size"])  # the examples trainer.train sees
    dataset, sampler, tokenizer = data.dataset, data.sampler, data.tokenizer
    print(
        f"{len(dataset)} examples | packing {cfg.packing.strategy}, budget {cfg.row_budget} per row | "
        f"rank {extra['rank']} of {extra['world_size']} | text in {NO_LOSS_OPEN} {NO_LOSS_CLOSE} carries no loss"
    )
    for n in range(extra["num_batches"]):
        epoch, indices, _ = sampler.next_microbatch()
        print(f"\n== micro-batch {n + 1} (epoch {epoch}) ==")
        batch = data.collate(dataset, indices, tokenizer.pad_token_id)
        # A split piece (packing=bfd_split|wrapped) starts at its offset inside the example, not at 0.
        starts = piece_starts(indices)
        lines = describe(batch, tokenizer, cfg.row_budget, extra["show_tokens"], starts)
        if cfg.parallel.cp > 1:
            lines += cp_view(batch, cfg.parallel.cp, cfg.parallel.cp_split)
        print("\n".join(printable(line) for line in lines))  # decoded data: no raw escape codes


if __name__ == "__main__":
    main()
