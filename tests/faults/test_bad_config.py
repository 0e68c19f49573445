"""Items 5 and 6 (config part): a bad config is rejected before any process-group work, with one line saying
what to change; ``_target_`` paths outside the allowlist are refused before anything is instantiated."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import exit_line
from tests.faults.conftest import compose_job
from trainer.cli import check_overrides
from trainer.safety import UnsafeTargetError, check_target

BASE = ["recipe=cpu_dailydialog"]
CALLS = []


def record_call(*args, **kwargs):  # a _target_ that would leave a trace if it were ever called
    CALLS.append(args)


def one_error_line(capsys, overrides: list[str]) -> str:
    line = exit_line(capsys, check_overrides, overrides)
    assert line.startswith("packfsdp: config error: ")
    return line.removeprefix("packfsdp: config error: ")


@pytest.mark.parametrize(
    "override, expected",
    [
        # wrong types (OmegaConf/Hydra errors, caught and reduced to one line)
        (
            "packing.token_budget=abc",
            "packing.token_budget: Value 'abc' of type 'str' could not be converted to Integer",
        ),
        ("max_steps=1.5", "max_steps: Value '1.5' of type 'float' could not be converted to Integer"),
        ("logger.wandb=maybe", "logger.wandb: Value 'maybe' is not a valid bool"),
        ("no_such_key=3", "Key 'no_such_key' not in 'JobConfig'"),
        ("+packing.token_buget=512", "unknown key 'packing.token_buget'; did you mean packing.token_budget?"),
        # retired keys: one line saying where the fact went
        ("packing.oversize=drop", "packing.oversize: removed: training never let it act"),
        ("data.num_dialogs=40", "data.num_dialogs is now data.num_records; set that instead"),
        ("+packing.oversize=drop", "packing.oversize: removed: training never let it act"),
        ("data.streaming=true", "data.streaming is now data.stream.enabled; set that instead"),
        ("data.mix_by=tokens", "data.mix_by is now data.mixture.by; set that instead"),
        # zero and negative sizes
        ("packing.token_budget=0", "packing.token_budget must be a positive"),
        ("grad_accum=-1", "grad_accum must be a positive number"),
        ("data.max_length=0", "data.max_length must be a positive number"),
        ("guard.collective_timeout_s=0", "guard.collective_timeout_s must be a positive number"),
        # unknown backends
        ("parallel.backend=mpi", "parallel.backend='mpi' is not valid; choose one of: auto, nccl, gloo"),
        ("model.attention=flash9", "model.attention='flash9' is not valid; choose one of: auto, "),
        ("guard.nonfinite=ignore", "guard.nonfinite='ignore' is not valid; choose one of: skip, stop"),
        # a budget that cannot hold one example of the longest allowed length (bfd never splits examples)
        ("packing.token_budget=512", "packing.token_budget=512 cannot hold one example of 1024 tokens"),
        # _target_ outside the allowlist, at the top or nested (Hydra instantiates nested targets too)
        ("optim.optimizer._target_=os.system", "optim.optimizer._target_='os.system' is not allowed"),
        ("optim.optimizer._target_=torch.load", "optim.optimizer._target_='torch.load' is not allowed"),
        (
            "+optim.optimizer.hook._target_=builtins.eval",
            "optim.optimizer.hook._target_='builtins.eval' is not allowed",
        ),
    ],
)
def test_bad_config_is_one_line(capsys, override, expected):
    assert one_error_line(capsys, [*BASE, override]).startswith(expected)


@pytest.mark.parametrize(
    "overrides",
    [
        ["packing.token_budget=512", "data.max_length=512"],  # examples fit the budget
        ["packing.token_budget=512", "model.config_overrides.n_positions=512"],  # the context clamps them
        ["packing=none", "packing.token_budget=512"],  # the padded baseline does not pack by budget
        ["packing.strategy=bfd_split", "packing.token_budget=512"],  # splitting strategies cut long examples
    ],
)
def test_budget_that_fits_is_accepted(overrides):
    compose_job([*BASE, *overrides])


def test_world_size_must_fit_the_mesh(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun sets it, before any process group exists
    line = one_error_line(capsys, [*BASE, "parallel.dp_replicate=2"])
    assert line.startswith("parallel.dp_replicate=2 does not divide the world size 3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_overrides([*BASE, "parallel.dp_replicate=2"])


def test_target_allowlist_is_user_extendable_but_never_reaches_dangerous_callables(monkeypatch):
    name = f"{__name__}.record_call"
    with pytest.raises(UnsafeTargetError):  # the one check, in to_job_config, before anything is built
        compose_job([*BASE, f"optim.optimizer._target_={name}"])
    assert CALLS == []  # refused before instantiation: the target was never imported or called
    monkeypatch.setenv("PACKFSDP_ALLOWED_TARGETS", "tests.faults.,torch.")
    check_target("optim.optimizer._target_", name)
    for dangerous in ("torch.load", "torch.hub.load", "os.system", "subprocess.run", "builtins.exec"):
        with pytest.raises(UnsafeTargetError, match="is not allowed"):
            check_target("x._target_", dangerous)


def test_type_error_from_the_command_line_is_one_line(capsys, monkeypatch):
    """Through the entry's ``main`` (argv checks run before Hydra; a real process: test_config.py)."""
    from trainer.train import main

    monkeypatch.setattr(sys, "argv", ["trainer.train", "recipe=cpu_dailydialog", "packing.token_budget=abc"])
    assert exit_line(capsys, main) == (
        "packfsdp: config error: packing.token_budget: Value 'abc' of type 'str' could not be converted to Integer"
    )


@pytest.mark.parametrize(
    "strategy, oversize, outcome",
    [
        ("bfd", "error", "error"),
        ("bfd", "drop", "dropped"),
        ("bfd_split", "error", "split"),
        ("wrapped", "error", "split"),
    ],
)
def test_example_over_the_budget_follows_the_strategy_rule_and_is_counted(strategy, oversize, outcome):
    """Item 4's last case, at the packing stage (the data stage's truncate/drop is in test_bad_data.py)."""
    import numpy as np

    from trainer.config import PackingConfig
    from trainer.packing import build_sampler

    lengths = np.array([40, 300, 60, 50])
    cfg = PackingConfig(balance="tokens", strategy=strategy, token_budget=128)
    if outcome == "error":
        with pytest.raises(ValueError, match="longer than|over"):
            build_sampler(lengths, cfg, 0, 1, seed=0, oversize=oversize).plan(0)
        return
    stats = build_sampler(lengths, cfg, 0, 1, seed=0, oversize=oversize).plan(0).stats
    if outcome == "dropped":
        assert (stats.dropped_oversize, stats.dropped_oversize_tokens) == (1, 300)
    else:
        assert stats.split_examples == 1 and stats.pieces >= 3 and stats.tokens >= lengths.sum()


def test_a_retired_key_inside_a_mixture_item_names_its_new_name():
    from trainer.config import ConfigError, DataConfig, MixtureConfig
    from trainer.data.mixture import mix_components

    items = [{"source": "chat_synthetic"}, {"source": "chat_synthetic", "num_dialogs": 9}]
    with pytest.raises(ConfigError, match=r"^data.mixture.sources\[1\]: data.num_dialogs is now data.num_records"):
        mix_components(DataConfig(mixture=MixtureConfig(sources=items)))
