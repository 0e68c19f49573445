"""The certification's result: a ``Stage`` per stage, the ``Certificate`` that holds them, their one line."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.model.certification.engine import Measurement

PRIOR, REPLICA, SELF_CHECK = "table prior", "replica", "self-check"
"""The stages, in the order they run."""
REFUSES = ("refused", "wrong")
"""The outcomes that refuse the model (``Stage.outcome``)."""


@dataclass
class Stage:
    """One stage's verdict."""

    name: str
    """``PRIOR``, ``REPLICA`` or ``SELF_CHECK``."""
    outcome: str
    """``exact``; ``refused`` (packfsdp refuses it: the table, a setting no backend packs, the model's own NaN);
    ``wrong`` (measured: a packed row's examples mix, or only the packed side is not finite); ``error`` (the
    packed run raised where its examples alone ran); ``untested``, ``unbuildable``, ``off``: no verdict."""
    detail: str = ""
    """One line: the figures, the reason, or why there is no verdict."""
    measurement: Measurement | None = None
    cached: bool = False

    def summary(self) -> str:
        """``replica float64 |logit diff| ...``; where not exact, ``self-check: off (model.self_check=false)``."""
        cached = " (cached)" if self.cached else ""
        if self.outcome == "exact":
            return f"{self.name}{' ' if self.detail else ''}{self.detail}{cached}"
        return f"{self.name}: {self.outcome}{f' ({self.detail})' if self.detail else ''}{cached}"


def family_of(config) -> str:
    """The family a config names in every line (its ``model_type``; ``"the model"`` where it names none)."""
    return getattr(config, "model_type", None) or "the model"


def refusal_line(family: str, stage: str, reason: str) -> str:
    """The one line of every refusal: the family, the stage that refuses, and why (the setting where named)."""
    return f"model family {family!r} is not certified exact ({stage}): {reason}"


@dataclass
class Certificate:
    """The certification of the model a run trains: its stages so far (``trainer.model.certification``)."""

    family: str
    stages: list[Stage] = field(default_factory=list)

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def line(self) -> str:
        """``certified exact: FAMILY (table prior; replica FIGURES; self-check FIGURES)``: the run's one line."""
        return f"certified exact: {self.family} ({'; '.join(s.summary() for s in self.stages)})"

    def to_json(self) -> dict:
        return {
            "family": self.family,
            "line": self.line(),
            "stages": [
                {"stage": s.name, "outcome": s.outcome, "detail": s.detail, "cached": s.cached} for s in self.stages
            ],
        }
