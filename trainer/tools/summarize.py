"""Side by side: ``packfsdp summarize PACKED_RUN_DIR PADDED_RUN_DIR`` prints the comparison table
of two finished runs wherever they live (``packfsdp compare --report-only DIR`` does the same for
a compare directory, and writes the report files and plots)."""

from __future__ import annotations

import sys
from pathlib import Path

from trainer.tools.compare import build_report, comparison_table, load_summary


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: packfsdp summarize PACKED_RUN_DIR PADDED_RUN_DIR", file=sys.stderr)
        sys.exit(2)
    summaries = {"packed": load_summary(Path(argv[0])), "padded": load_summary(Path(argv[1]))}
    report = build_report(summaries, overrides=[], nproc=summaries["packed"].get("world_size", 1))
    print(comparison_table(report))
    print(
        f"packing speedup (useful tokens/s, packed / padded): "
        f"{report['comparison']['useful_tokens_per_s_ratio']:.2f}x on {report['world_size']} rank(s)"
    )


if __name__ == "__main__":
    main()
