"""The objective a run optimises, behind one protocol (``base.Objective``; its docstring is the contract).

- ``sft``: the mean token cross-entropy over the step's label tokens (with the router aux loss as an additive
  term where the model's config trains one);
- ``dpo``: DPO and its variants over packed preference pairs (``reference``: the reference's log-probs);
- ``distill``: knowledge distillation from a frozen teacher, chunk by chunk (the ``distill`` package).

``objective=NAME`` picks one from ``OBJECTIVE_TYPES`` (the names are ``trainer.config.OBJECTIVES``, checked when
the config is validated); ``build_objective`` makes it for the built model. A new objective is one module
here, one line below, its config section, a recipe and its tests.
"""

from __future__ import annotations

import torch

from trainer.config import JobConfig
from trainer.objectives.base import MicroLoss, Objective, RunSetup
from trainer.objectives.distill import Distill
from trainer.objectives.dpo import DPO
from trainer.objectives.sft import SFT

OBJECTIVE_TYPES: dict[str, type[Objective]] = {cls.name: cls for cls in (SFT, DPO, Distill)}
"""Every objective, by its ``objective=`` name."""


def build_objective(cfg: JobConfig, model: torch.nn.Module) -> Objective:
    """The objective ``cfg.objective`` names, for ``model`` (the unsharded ``VarlenCausalLM``, its loss picked)."""
    return OBJECTIVE_TYPES[cfg.objective](cfg, model)


__all__ = ["OBJECTIVE_TYPES", "DPO", "Distill", "SFT", "MicroLoss", "Objective", "RunSetup", "build_objective"]
