"""One source per fact: the examples a run trains on (``trainer.pipeline``), the strategy facts and choice
lists (the strategy registry), the model's context length."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from tests.conftest import REPO
from trainer.compose import compose_job_config
from trainer.config import (
    ConfigError,
    JobConfig,
    ModelConfig,
    PackingConfig,
    stated_context,
)
from trainer.packing import STRATEGIES, WORK_MEASURES

SMALL = ["recipe=cpu_dailydialog", "data.num_records=300"]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_packing_flags_come_from_the_strategy_registry(name):
    strategy = STRATEGIES[name]
    cfg = PackingConfig(balance="tokens", strategy=name)
    assert cfg.packed is not strategy.padded
    assert cfg.splits_examples is strategy.splits
    with pytest.raises(ConfigError, match=f">= {strategy.min_budget}" if strategy.min_budget > 1 else "positive"):
        replace(cfg, token_budget=strategy.min_budget - 1).validate()


@pytest.mark.parametrize(
    "field, choices",
    [("strategy", tuple(STRATEGIES)), ("balance", tuple(WORK_MEASURES))],
)
def test_packing_choice_lists_come_from_the_registries(field, choices):
    with pytest.raises(ConfigError) as e:
        replace(PackingConfig(balance="tokens"), **{field: "nope"}).validate()
    assert str(e.value).endswith("choose one of: " + ", ".join(choices))


def test_config_imports_neither_torch_nor_the_model_package():
    code = "import sys, trainer.config; print('torch' in sys.modules, 'trainer.model' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_one_rule_for_the_context_length():
    from trainer.pipeline import model_context

    assert stated_context({"n_positions": 256}) == stated_context({"max_position_embeddings": 256}) == 256
    assert stated_context({}) is None
    tiny = ModelConfig(config_overrides={"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 384})
    assert model_context(tiny) == 384  # read from the config alone, as for the built model
    assert model_context(ModelConfig(family="no_such_family")) is None  # unreadable: unknown, logged


def test_max_example_length_clamps_to_context_and_budget():
    cfg = JobConfig()  # data.max_length 1024, bfd with a budget of 2048
    assert cfg.max_example_length(None) == 1024
    assert cfg.max_example_length(512) == 512
    cfg.packing.token_budget = 300
    assert cfg.max_example_length(512) == 300  # whole examples must fit one micro-batch
    cfg.packing.strategy = "bfd_split"
    assert cfg.max_example_length(512) == 512  # splitting strategies cut longer ones instead


def test_analyze_and_inspect_see_the_examples_training_sees(tmp_path, cache_dir, capsys):
    """The trainer, analyze and inspect all build their examples with ``build_training_data``: the eval
    hold-out is removed from what the tools report on."""
    from trainer.pipeline import build_training_data
    from trainer.tools import analyze, inspect_batches

    overrides = [*SMALL, f"data.cache_dir={cache_dir}"]
    data = build_training_data(compose_job_config(overrides))
    assert data.eval_dataset is not None and len(data.eval_dataset) > 0
    figures = analyze.run([*overrides, f"output_root={tmp_path}", "--world-sizes", "2"])
    assert figures["examples"] == len(data.dataset)
    assert figures["tokens"] == int(data.dataset.lengths.sum())
    capsys.readouterr()
    inspect_batches.main([*overrides, "num_batches=1"])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"{len(data.dataset)} examples |") for line in lines)
