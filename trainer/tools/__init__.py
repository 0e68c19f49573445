"""Command-line tools over the library: ``packfsdp TOOL [args]`` (or ``python -m trainer.tools TOOL``).

Training itself is ``torchrun ... -m trainer.train``; everything else a user runs from a shell lives here,
one module per tool, each a thin program over the library modules in ``trainer/``:

    analyze      the packing report of a recipe's data, before training
    inspect      decode the first packed micro-batches (boundaries, position_ids, loss mask)
    compare      the padded baseline and the packed run on the same data, side by side
    summarize    the comparison table of two finished runs
    variability  how the packing win grows with the spread of example lengths
    export       a checkpoint as a Hugging Face model folder

``python -m trainer.analyze`` (and compare, summarize, export, variability) still work: thin aliases.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import sys

TOOLS = {
    "train": ("trainer.train", "train a recipe (same as python -m trainer.train; use torchrun for several ranks)"),
    "analyze": ("trainer.tools.analyze", "the packing report of a recipe's data, before training"),
    "inspect": ("trainer.tools.inspect_batches", "decode the first packed micro-batches of a recipe"),
    "compare": ("trainer.tools.compare", "padded baseline vs packed run on the same data, with a report"),
    "summarize": ("trainer.tools.summarize", "the comparison table of two finished runs"),
    "variability": ("trainer.tools.variability", "packing speedup against the spread of example lengths"),
    "export": ("trainer.tools.export", "a checkpoint as a Hugging Face model folder"),
}


def usage() -> str:
    width = max(map(len, TOOLS))
    lines = ["usage: packfsdp TOOL [args]  (or: python -m trainer.tools TOOL [args])", "", "tools:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in TOOLS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run one tool; its arguments follow the tool's name. Only that tool's module is imported."""
    argv = sys.argv[1:] if argv is None else argv
    atexit.register(gc.freeze)  # runs last: exit without collecting torch's objects (see trainer.train.main)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    name, rest = argv[0], argv[1:]
    if name not in TOOLS:
        sys.exit(f"packfsdp: unknown tool {name!r}\n{usage()}")
    module = importlib.import_module(TOOLS[name][0])
    sys.argv = [f"packfsdp {name}", *rest]  # tools that hand argv on (Hydra) read it from here
    module.main()
