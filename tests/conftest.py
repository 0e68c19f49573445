"""Shared fixtures and helpers: a small tokenized DailyDialog-like set, a local tokenizer, tiny models, config
composition without running the app, the one-line CLI error check, a torchrun helper."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("PACKFSDP_CACHE", str(REPO / ".cache" / "packfsdp"))
os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


SHARED_LAUNCH_DIRS = {"tests/distributed": ("worker_results", "reference"), "tests/faults": ("finished_run",)}
"""Folders whose test files read session fixtures that each run one launch (``launch/run_tests.sh`` runs the
suite on two xdist workers: each folder is one scope, so its launches run once)."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with a scope per test file, and one per ``SHARED_LAUNCH_DIRS`` folder."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedLaunchScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((d for d in SHARED_LAUNCH_DIRS if path.startswith(d + "/")), path)

    return SharedLaunchScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:  # a shared launch read outside its folder would run once per worker
        for folder, fixtures in SHARED_LAUNCH_DIRS.items():
            if set(fixtures) & set(item.fixturenames) and not item.nodeid.startswith(folder + "/"):
                raise pytest.UsageError(
                    f"{item.nodeid} reads a launch of {folder} ({', '.join(fixtures)}): "
                    "move it there or add its folder to SHARED_LAUNCH_DIRS"
                )
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_dir() -> str:
    return os.environ["PACKFSDP_CACHE"]


@pytest.fixture(scope="session")
def small_data_cfg(cache_dir):
    from trainer.config import DataConfig

    return DataConfig(num_records=300, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def tokenizer(small_data_cfg):
    from trainer.config import ModelConfig
    from trainer.data import load_tokenizer

    return load_tokenizer(ModelConfig(), small_data_cfg)


@pytest.fixture(scope="session")
def small_dataset(tokenizer, small_data_cfg):
    from trainer.data import load_dataset

    return load_dataset(small_data_cfg, tokenizer, max_length=512)


def tiny_gpt2_config(**overrides):
    from trainer.config import ModelConfig

    base = dict(n_layer=2, n_embd=32, n_head=4, n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return ModelConfig(family="gpt2", config_overrides=base | overrides)


@functools.cache
def register_configs_once() -> None:
    """``register_configs`` rebuilds every ConfigStore entry (~0.5 s); the store is a process-wide singleton."""
    from trainer.compose import register_configs

    register_configs()


def compose_job(overrides: list[str]):
    """The validated ``JobConfig`` a run would get from these command-line overrides (nothing is run)."""
    from hydra import compose, initialize_config_dir

    from trainer.compose import config_dir, open_mapping_overrides, to_job_config

    register_configs_once()
    with initialize_config_dir(str(config_dir()), version_base=None):
        return to_job_config(compose("config", overrides=open_mapping_overrides(overrides)))


def exit_line(capsys, check, *args) -> str:
    """The one stderr line of ``check(*args)``, which must exit with status 2 and print nothing else there."""
    with pytest.raises(SystemExit) as exit_info:
        check(*args)
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, *, what: str):
    """``predicate()``'s first truthy value, polled every ``interval_s``; fails naming ``what`` and the timeout
    after ``timeout_s``. For a state an asynchronous event brings (a timer thread, a process's exit): a fixed sleep
    before the assertion flakes on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)
    return value


def run_torchrun(args: list[str], nproc: int = 2, timeout: float = 300, env: dict | None = None, cwd=REPO):
    """Run ``torchrun --standalone --nproc_per_node nproc <args>``; returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    full_env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (env or {})
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
