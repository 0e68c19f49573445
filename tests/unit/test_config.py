"""Configs: every recipe composes; wrong choices and values fail with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import REPO
from trainer.cli import group_choices
from trainer.config import ConfigError, config_dir, register_configs, to_job_config

register_configs()


def _compose(overrides):
    with initialize_config_dir(str(config_dir()), version_base=None):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize("recipe", group_choices("recipe"))
@pytest.mark.parametrize("packing", ["bfd", "none"])
def test_every_recipe_composes(recipe, packing):
    job = to_job_config(_compose([f"recipe={recipe}", f"packing={packing}"]))
    assert job.name == recipe
    assert job.packing.strategy == packing


def test_recipes_first_line_is_the_command_that_runs_them():
    for path in (REPO / "recipes").glob("*.yaml"):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# torchrun ") and f"recipe={path.stem}" in first, path


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
        to_job_config(_compose(["recipe=cpu_dailydialog", override]))


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("recipe=nope", "packfsdp: unknown recipe 'nope'; choose one of: cpu_chat_sft, cpu_dailydialog, gpt2_dailydialog, qwen_chat_sft"),
        ("packing=foo", "packfsdp: unknown packing 'foo'; choose one of:"),
        ("packing.token_budget=-5", "packfsdp: config error: packing.token_budget must be a positive number"),
    ],
)
def test_cli_errors_are_one_line(arg, expected):
    out = subprocess.run([sys.executable, "-m", "trainer.train", arg], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(expected), out.stderr
