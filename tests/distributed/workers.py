"""``python -m tests.distributed.workers OUT CACHE NAME...`` under torchrun (2 gloo ranks on CPU): the cases of
each worker module ``tests.distributed.NAME`` (its ``run_cases(cache)``) in one process group; rank 0 writes
``OUT/NAME.json``. One launch for all of them: each interpreter start (torch, transformers) costs seconds."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

from tests.quick_exit import run_then_exit
from trainer import distributed


def main(out: Path, cache: str, names: list[str]) -> None:
    distributed.init_distributed(torch.device("cpu"), "gloo")
    for name in names:
        results = importlib.import_module(f"tests.distributed.{name}").run_cases(cache)
        if distributed.rank() == 0:
            (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    distributed.destroy_distributed()


if __name__ == "__main__":
    run_then_exit(main, Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
