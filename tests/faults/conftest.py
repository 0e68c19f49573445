"""Fixtures for fault tests: a real Trainer in this process (a world of one gloo rank)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, compose_job, register_configs_once

register_configs_once()  # check_overrides (test_bad_config.py) finds the recipes in the ConfigStore

# The CPU recipe, shrunk so a step takes milliseconds: faults, not throughput, are under test.
SMALL_RUN = [
    "recipe=cpu_dailydialog",
    "data.num_records=300",
    "data.max_length=256",
    "packing.token_budget=256",
    "model.config_overrides.n_embd=32",
    "model.config_overrides.n_positions=256",
    "max_steps=50",
    "grad_accum=1",
    "optim.warmup_steps=0",
    "logger.peak_tflops=1",  # a fixed peak: measuring this CPU's bf16 rate takes seconds
]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """One Trainer shared by a module's tests (building one takes seconds); tests only read its state or
    run steps and compare before/after, so sharing is safe. A ``FaultyTrainer`` (``tests.faults.inject``): with
    no fault injected, the Trainer itself."""
    from tests.faults.inject import FaultyTrainer

    with one_rank_world():
        run_dir = tmp_path_factory.mktemp("inproc")
        t = FaultyTrainer(compose_job([*SMALL_RUN, f"run_dir={run_dir}"]))
        t.model.train()
        yield t
        t.metrics.close()


@contextlib.contextmanager
def one_rank_world():
    """Trainers built in this process (a world of one gloo rank), the environment and logging restored after."""
    import torch

    from trainer import distributed

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # other tests and helpers share the CPU cores: no oversubscription
    saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    saved_handlers = logging.getLogger().handlers[:]
    try:
        yield
    finally:
        distributed.destroy_distributed()
        for k, v in saved_env.items():  # later tests spawn torchrun with os.environ: leave no RANK behind
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        logging.getLogger().handlers[:] = saved_handlers
        torch.set_num_threads(threads)


def train_process(*args: str) -> subprocess.CompletedProcess:
    """``python -m trainer.train SMALL_RUN ARGS`` (one process, one rank), run from the repository."""
    cmd = [sys.executable, "-m", "trainer.train", *SMALL_RUN, *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """The run dir of a finished 2-step SMALL_RUN. One process serves every test that starts a second run
    into a run dir (each interpreter start costs seconds); tests take a copy (``copy_of_finished_run``)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = train_process("max_steps=2", f"run_dir={run_dir}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return run_dir


@pytest.fixture
def copy_of_finished_run(finished_run, tmp_path) -> Path:
    """A test's own copy of ``finished_run``, so whatever a test's run writes stays in its test."""
    return Path(shutil.copytree(finished_run, tmp_path / "run"))
