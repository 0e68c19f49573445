"""Side by side: ``python -m trainer.summarize PACKED_RUN_DIR PADDED_RUN_DIR`` prints both runs' summaries
and by how much packing won on useful tokens per second."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load_summary(run_dir: str | Path) -> dict:
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: did the run finish?")
    return json.loads(path.read_text())


def format_comparison(packed: dict, padded: dict) -> str:
    rows = [("", "packed", "padded")]
    rows.append(("strategy", packed["strategy"], padded["strategy"]))
    rows.append(("attention", packed["attention"], padded["attention"]))
    rows.append(("useful tokens/s", f"{packed['useful_tokens_per_s']:,.0f}", f"{padded['useful_tokens_per_s']:,.0f}"))
    rows.append(("padding fraction", f"{100 * packed['padding_fraction']:.1f}%", f"{100 * padded['padding_fraction']:.1f}%"))
    rows.append(("mean step time", f"{1000 * packed['mean_step_time_s']:.0f} ms", f"{1000 * padded['mean_step_time_s']:.0f} ms"))
    rows.append(("final train loss", f"{packed['final_loss']:.4f}", f"{padded['final_loss']:.4f}"))
    rows.append(("peak memory", f"{packed['peak_mem_gib']:.2f} GiB", f"{padded['peak_mem_gib']:.2f} GiB"))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(width[i]) for i, cell in enumerate(row)) for row in rows]
    speedup = packed["useful_tokens_per_s"] / padded["useful_tokens_per_s"]
    lines.append(f"packing speedup (useful tokens/s, packed / padded): {speedup:.2f}x "
                 f"on {packed['world_size']} rank(s), {packed['steps_averaged']} steps averaged")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m trainer.summarize PACKED_RUN_DIR PADDED_RUN_DIR", file=sys.stderr)
        sys.exit(2)
    print(format_comparison(load_summary(argv[0]), load_summary(argv[1])))


if __name__ == "__main__":
    main()
