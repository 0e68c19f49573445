"""Two gloo ranks on CPU run real FSDP2 steps (bf16 MixedPrecisionPolicy), packed and padded.

Both runs are jobs of one Hydra sweep (one torchrun launch: each launch costs seconds of interpreter starts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_torchrun

pytestmark = pytest.mark.slow

PACKINGS = ["bfd", "none"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[str, dict[str, Path]]:
    """Rank 0's stdout and the run directory of each packing strategy."""
    root = tmp_path_factory.mktemp("fsdp_train")
    out = run_torchrun(
        [
            "-m",
            "trainer.train",
            "-m",
            "recipe=cpu_dailydialog",
            f"packing={','.join(PACKINGS)}",
            "data.num_records=600",
            "packing.token_budget=512",
            "data.max_length=512",
            "max_steps=12",
            "grad_accum=2",
            "optim.lr=3e-3",
            "optim.warmup_steps=2",
            f"run_dir={root / 'runs'}",
            "logger.peak_tflops=1",  # MFU is not under test: skip measuring the CPU (seconds)
        ],
        cwd=root,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = {
        yaml.safe_load((d / "config.yaml").read_text())["packing"]["strategy"]: d for d in (root / "runs").iterdir()
    }
    assert sorted(runs) == sorted(PACKINGS)
    return out.stdout, runs


def job_log(stdout: str, run_dir: Path) -> str:
    """The lines rank 0 logged for one job of the sweep: from its ``run dir`` line to the next job's."""
    start = stdout.index(f"run dir {run_dir} ")
    end = stdout.find("run dir ", start + 1)
    return stdout[start : end if end >= 0 else None]


@pytest.mark.parametrize("packing", PACKINGS)
def test_two_rank_fsdp_training(packing, sweep):
    stdout, runs = sweep
    run_dir = runs[packing]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 0.3, (first, last)
    for r in records:
        assert r["useful_tokens"] > 0 and r["useful_tokens_per_s"] > 0
        assert r["useful_tokens"] <= r["tokens"] <= r["positions"]
    if packing == "bfd":
        assert all(r["padding_fraction"] == 0.0 for r in records)
        assert "attention backend: sdpa_varlen" in job_log(stdout, run_dir)
    else:
        assert sum(r["padding_fraction"] for r in records) / len(records) > 0.2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["mode"] == ("packed" if packing == "bfd" else "padded")
    assert (run_dir / "config.yaml").is_file()
