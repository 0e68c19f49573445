"""Settings that are finite yet have no sane meaning (``dpo.beta=1e12`` trained to a held-out loss of 7e10):
refused in one line naming the setting, the range that means something and why. One table, read by
``JobConfig.validate`` after every number was found finite (``common.check_finite_settings``); a new
coefficient gets one row. Each bound sits far outside what any published recipe uses, so a refusal is a
typo or a unit mix-up, never a bold choice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.config.common import ConfigError


def _optimizer(key: str) -> Callable[[Any], Any]:
    return lambda job: job.optim.optimizer.get(key)


def _model_override(key: str) -> Callable[[Any], Any]:
    return lambda job: job.model.config_overrides.get(key)


_AUX_WHY = (
    "the weight of the MoE load-balancing loss against the token loss: published values are 0.001-0.02, "
    "and 10 or more trains the router instead of the model"
)


SANE_RANGES: list[tuple[str, Callable[[Any], Any], float, float, str]] = [
    # (setting, its value in a JobConfig, lowest, first absurd value (the range is [lowest, this)), why)
    (
        "optim.lr",
        lambda job: job.optim.lr,
        0.0,
        10.0,
        "the peak step of the optimizer: fine-tuning uses 1e-6 to 1e-2, and 10 or more wrecks the weights in one step",
    ),
    (
        "optim.lr x optim.weight_decay",
        lambda job: job.optim.lr * job.optim.weight_decay,
        0.0,
        1.0,
        "AdamW's decoupled decay multiplies the weights by 1 - lr x weight_decay each step: at 1 or more it zeroes "
        "or flips them",
    ),
    (
        "optim.optimizer.betas",
        _optimizer("betas"),
        0.0,
        1.0,
        "moment decay rates: at 1 or more the moments never forget (or grow without bound)",
    ),
    ("optim.optimizer.momentum", _optimizer("momentum"), 0.0, 1.0, "at 1 or more momentum grows without bound"),
    (
        "optim.optimizer.eps",
        _optimizer("eps"),
        0.0,
        1.0,
        "an update is divided by the gradient's RMS + eps, and gradient RMS is far under 1: "
        "a larger eps trains nothing",
    ),
    (
        "dpo.beta",
        lambda job: job.dpo.beta,
        0.0,
        100.0,
        "rewards are beta x log-prob ratios: past 100 a tenth of a nat saturates the loss "
        "(published values are 0.01-10)",
    ),
    (
        "dpo.simpo_gamma",
        lambda job: job.dpo.simpo_gamma,
        0.0,
        100.0,
        "simpo's target reward margin, in the units of beta x mean token log-prob "
        "(published values are 0.3-1.6 x beta)",
    ),
    (
        "peft.alpha / peft.rank",
        lambda job: job.peft.alpha / job.peft.rank if job.peft.rank else None,
        0.0,
        100.0,
        "the scale of every LoRA update: recipes use 0.5-4, and 100 or more blows the adapters' output up",
    ),
    ("model.config_overrides.router_aux_loss_coef", _model_override("router_aux_loss_coef"), 0.0, 10.0, _AUX_WHY),
    ("model.config_overrides.aux_loss_coef", _model_override("aux_loss_coef"), 0.0, 10.0, _AUX_WHY),
    (
        "model.self_check_tolerance",
        lambda job: job.model.self_check_tolerance,
        0.0,
        1.0,
        "a relative logit difference: at 1 or more the self-check passes anything "
        "(model.self_check=false turns it off)",
    ),
]


def check_sane_settings(job: Any) -> None:
    """Refuse, in one line, the first setting of ``job`` outside its range in ``SANE_RANGES``."""
    for name, read, lowest, absurd, why in SANE_RANGES:
        value = read(job)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not lowest <= v < absurd:
                raise ConfigError(f"{name}={v:g} has no sane meaning ({why}); give a value in [{lowest:g}, {absurd:g})")
