"""Issue 24: every number a config holds is finite and bounded (refused in one line naming the key, for
every float field, found generically), and packing's structures grow with bins, not with budget units."""

from __future__ import annotations

import copy
import dataclasses
import functools

import numpy as np
import pytest

from tests.conftest import compose_job
from trainer.config import ConfigError, JobConfig
from trainer.packing.fit import best_fit_decreasing, first_fit_decreasing

BASE = ["recipe=cpu_dailydialog"]


def float_fields(obj, prefix=""):
    """Every float-typed field of the config tree (``optim.lr``, ``guard.collective_timeout_s``, ...)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from float_fields(value, key + ".")
        elif "float" in str(f.type):
            yield key


def test_every_float_setting_refuses_nan_and_inf():
    cfg = compose_job(BASE)
    keys = list(float_fields(cfg))
    assert {
        "optim.lr",
        "optim.weight_decay",
        "optim.grad_clip",
        "checkpoint.every_minutes",
        "guard.collective_timeout_s",
    } <= set(keys)
    for key in keys:
        for bad in (float("nan"), float("inf"), -float("inf")):
            broken = copy.deepcopy(cfg)
            section, _, name = key.rpartition(".")
            setattr(broken if not section else _walk(broken, section), name, bad)
            with pytest.raises(ConfigError, match=rf"^{key}={bad} is not a finite number"):
                broken.validate()


def _walk(cfg: JobConfig, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_numbers_inside_dict_settings_and_huge_ones_are_refused():
    with pytest.raises(ConfigError, match=r"optim.optimizer.eps=nan is not a finite number"):
        compose_job([*BASE, "optim.optimizer.eps=nan"])
    with pytest.raises(ConfigError, match="guard.collective_timeout_s=1e\\+15 is over a year"):
        compose_job([*BASE, "guard.collective_timeout_s=1e15"])
    with pytest.raises(ConfigError, match=r"optim.lr=1e\+300 is out of range"):
        compose_job([*BASE, "optim.lr=1e300"])


def test_a_budget_larger_than_memory_is_one_line():
    with pytest.raises(ConfigError, match=r"packing.token_budget=1000000000000 needs at least .* GiB per micro-batch"):
        compose_job([*BASE, "packing.token_budget=1000000000000"])


@pytest.mark.parametrize("pack", [best_fit_decreasing, first_fit_decreasing])
def test_packing_structures_grow_with_bins_not_budget_units(pack):
    """On main a budget of 10**7 allocated a Python list per budget unit (0.6 GB; 1e12 took a rank down)."""
    import tracemalloc

    sizes = np.random.default_rng(0).integers(1, 5000, 2000).astype(np.int64)
    tracemalloc.start()
    try:
        huge = pack(sizes, 10**7)
        capped = best_fit_decreasing(sizes, 10**7, cap=7)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, f"{peak / 2**20:.0f} MiB for 2000 items"
    assert (huge == 0).all()  # everything fits one bin
    assert np.bincount(capped).max() == 7


def test_dpo_beta_of_1e12_is_one_line():
    """Issue 33, case 11: dpo.beta=1e12 was accepted (held-out loss 7e10, no warning)."""
    with pytest.raises(
        ConfigError, match=r"dpo.beta=1e\+12 has no sane meaning \(rewards are beta x log-prob ratios.*in \[0, 100\)"
    ):
        compose_job(["recipe=cpu_dpo", "dpo.beta=1e12"])


@functools.cache
def base_job() -> JobConfig:
    return compose_job(BASE)


@pytest.mark.parametrize(
    "change, line",
    [
        (lambda job: setattr(job.optim, "lr", 50.0), r"optim.lr=50 has no sane meaning"),
        (
            lambda job: setattr(job.optim, "weight_decay", 2e4),
            r"optim.lr x optim.weight_decay=20 has no sane meaning \(AdamW's",
        ),
        (lambda job: job.optim.optimizer.update(betas=[0.9, 1.5]), r"optim.optimizer.betas=1.5 has no sane meaning"),
        (lambda job: job.optim.optimizer.update(eps=1e6), r"optim.optimizer.eps=1e\+06 has no sane meaning"),
        (lambda job: setattr(job.dpo, "simpo_gamma", 1e9), r"dpo.simpo_gamma=1e\+09 has no sane meaning"),
        (lambda job: setattr(job.peft, "alpha", 1e6), r"peft.alpha / peft.rank=125000 has no sane meaning"),
        (
            lambda job: job.model.config_overrides.update(router_aux_loss_coef=1e12),
            r"router_aux_loss_coef=1e\+12 has no sane",
        ),
        (
            lambda job: setattr(job.model, "self_check_tolerance", 5.0),
            r"self_check_tolerance=5 has no sane .*self_check=false",
        ),
    ],
    ids=[
        "lr",
        "lr x weight_decay",
        "betas",
        "eps",
        "simpo_gamma",
        "lora scale",
        "router_aux_loss_coef",
        "self_check_tolerance",
    ],
)
def test_its_kin_are_one_line_too(change, line):
    """The settings like it (``trainer.config.sanity``: one table), each refused by the same check."""
    job = copy.deepcopy(base_job())
    job.validate()  # the recipe itself is sane
    change(job)
    with pytest.raises(ConfigError, match=line):
        job.validate()
