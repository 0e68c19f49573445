"""Shared pieces of the distributed tests: the trainer harness launcher and one reference run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_torchrun

HARNESS = ["-m", "tests.distributed.harness"]


def overrides(cache_dir: str, **extra) -> list[str]:
    base = {
        "parallel": "fsdp_fp32",
        "parallel.device": "cpu",
        "parallel.backend": "gloo",
        "data.num_records": 300,
        "data.cache_dir": cache_dir,
        "packing.token_budget": 512,
        # ++: the preset leaves config_overrides empty, and Hydra refuses new keys in an existing mapping without it
        "++model.config_overrides": (
            "{n_layer:2,n_embd:32,n_head:4,n_positions:512,resid_pdrop:0.1,embd_pdrop:0.1,attn_pdrop:0.0}"
        ),
        "max_steps": 10,
        "grad_accum": 2,
        "optim.warmup_steps": 2,
        "checkpoint.every_steps": 3,
        "checkpoint.keep_last": 0,
        "logger.peak_tflops": 1,  # MFU is not under test; measuring this CPU's bf16 matmul rate takes seconds per rank
    }
    return [f"{k}={v}" for k, v in (base | extra).items()]


def launch(out: Path, args: list[str], nproc: int = 2, env: dict | None = None, torchrun_args: list[str] = ()):
    proc = run_torchrun([*torchrun_args, *HARNESS, *args], nproc=nproc, env={"PFTEST_OUT": str(out)} | (env or {}))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="session")
def reference(tmp_path_factory, cache_dir):
    """10 uninterrupted steps; checkpoints at 3, 6, 9 and 10."""
    root = tmp_path_factory.mktemp("reference")
    launch(root / "out", overrides(cache_dir, run_dir=root / "run"))
    return root


WORKERS = ("parallel_worker", "chunked_loss_worker", "lora_worker", "dpo_worker", "router_aux_worker")
"""The worker modules of tests/distributed whose cases ``worker_results`` runs."""


@pytest.fixture(scope="session")
def worker_results(tmp_path_factory, cache_dir) -> Path:
    """Every worker's cases from one torchrun launch (``tests.distributed.workers``): one interpreter start
    per rank instead of one per worker."""
    out = tmp_path_factory.mktemp("workers")
    proc = run_torchrun(["-m", "tests.distributed.workers", str(out), cache_dir, *WORKERS])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def worker_cases(results: Path, worker: str) -> dict:
    """The JSON record of every case ``worker`` ran (see ``worker_results``)."""
    import json

    return json.loads((results / f"{worker}.json").read_text())
