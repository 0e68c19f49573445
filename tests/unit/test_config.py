"""Configs: wrong choices and values fail with one line, before anything heavy is imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, compose_job, exit_line
from trainer.config import ConfigError


@pytest.mark.parametrize(
    "override, message",
    [
        ("packing.token_budget=0", "packing.token_budget must be a positive number"),
        ("data.loss_on=prompts", "data.loss_on='prompts' is not valid; choose one of: auto, responses, all"),
        ("grad_accum=-1", "grad_accum must be a positive number"),
        ("parallel.param_dtype=int8", "parallel.param_dtype='int8' is not valid"),
    ],
)
def test_bad_values_raise_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        compose_job(["recipe=cpu_dailydialog", override])


@pytest.mark.parametrize(
    "arg, expected",
    [
        (
            "recipe=nope",  # every recipe the folder holds, by name
            "packfsdp: unknown recipe 'nope'; choose one of: "
            + ", ".join(sorted(p.stem for p in (Path(__file__).parents[2] / "recipes").glob("*.yaml"))),
        ),
        ("packing=foo", "packfsdp: unknown packing 'foo'; choose one of:"),
        ("packing.token_budget=-5", "packfsdp: config error: packing.token_budget must be a positive number"),
    ],
)
def test_cli_errors_are_one_line(capsys, monkeypatch, arg, expected):
    """The entry's own argv checks, in this process (the exit code and stderr of a real process: below)."""
    from trainer.train import main

    monkeypatch.setattr(sys, "argv", ["trainer.train", arg])
    assert exit_line(capsys, main).startswith(expected)


@pytest.mark.slow
def test_cli_error_of_a_real_process_is_one_line_and_exit_status_2():
    out = subprocess.run(
        [sys.executable, "-m", "trainer.train", "recipe=nope"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert out.stdout == "" and out.stderr.strip().startswith("packfsdp: unknown recipe 'nope'; choose one of: ")
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_cli_path_imports_no_heavy_library():
    """``python -m trainer.train recipe=nope`` answers in a fraction of a second only while the entry and its
    argv checks leave torch, transformers and datasets unimported (a fresh process: this one has them)."""
    probe = (
        "import sys\n"
        "import trainer.train\n"
        "from trainer.cli import check_group_choices\n"
        "from trainer.compose import register_configs\n"
        "register_configs()\n"
        "check_group_choices(['recipe=cpu_dailydialog', 'packing=none'])\n"
        "print(*[m for m in ('torch', 'transformers', 'datasets') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ""


def test_context_parallel_world_checks():
    from tests.conftest import compose_job
    from trainer.config import ConfigError

    cfg = compose_job(["parallel.cp=3"])
    with pytest.raises(ConfigError, match="parallel.cp=3 does not divide the world size 4"):
        cfg.validate_world(4)
    with pytest.raises(ConfigError, match="needs a packed strategy"):
        compose_job(["parallel.cp=2", "packing=none"]).validate_world(2)
    cfg = compose_job(["parallel.cp=2", "packing.token_budget=512"])
    cfg.validate_world(4)
    assert cfg.row_budget == 1024
