"""Which transformers causal-LM families packfsdp trains packed exactly, which it refuses, and why.

Every ``model_type`` of transformers' causal-LM auto mapping was probed with ``benchmarks/family_matrix.py``
(``trainer.model.family_probe``: a tiny 2-layer model, a packed row of examples of lengths 9, 1, 14, 5, 11,
3 against the same examples one by one; logits and every parameter's gradient, fp32, 1e-5). The verdicts:

- ``EXACT``: packed == one by one.
- ``REFUSED``: would be wrong or crash when packed; ``build_model`` refuses it with one line and the reason.
- ``SKIPPED``: not a decoder-only causal LM (an encoder-decoder's decoder, a bidirectional encoder, a
  multimodal model); refused too, with that reason.
- anything else is *untested* (a family newer than ``TESTED_WITH``): it trains only behind the startup
  self-check (``trainer.model.selfcheck``, a worst-case batch), which stops it on a mismatch.

One source for the docs table too: ``benchmarks/family_matrix.py --markdown`` prints it from here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainer.config import ConfigError

log = logging.getLogger(__name__)

TESTED_WITH = "5.24.0"
"""The transformers version the table was probed with."""


class FamilyRefusedError(ConfigError):
    """A model family (or its rope type) that packfsdp cannot train packed exactly."""


# Reasons, one per kind of failure the matrix found.
NO_INTERFACE = "its attention does not go through transformers' attention interface, so the example boundaries never reach it"
DROPS_KWARGS = "its decoder layer does not pass the attention keyword arguments on, so the example boundaries never reach the attention"
RECURRENT = "a recurrent / state-space / linear-attention layer carries its state across the packed row"
OWN_POSITIONS = "it derives positions from the row (not from position_ids), so every example after the first is shifted"
NOT_CAUSAL = "bidirectional encoder attention: a causal LM only as part of an encoder-decoder"
ENCODER_DECODER = "the decoder of an encoder-decoder model"
MULTIMODAL = "a multimodal model: packfsdp trains text-only causal LMs (use its text family)"

RELAY_BOUNDARIES = frozenset({"stablelm"})
"""Families whose decoder layers drop the attention keyword arguments: ``build_model`` hands the example
boundaries to their attention modules directly (``trainer.model.loading.relay_boundaries``); then exact."""

EXACT: frozenset[str] = frozenset()
REFUSED: dict[str, str] = {}
SKIPPED: dict[str, str] = {}


@dataclass(frozen=True)
class Verdict:
    family: str
    kind: str
    """``exact``, ``refused``, ``skipped`` or ``untested``."""
    reason: str = ""


def verdict(family: str) -> Verdict:
    """What the table says about ``family`` (a transformers ``model_type``)."""
    if family in EXACT:
        return Verdict(family, "exact")
    if family in REFUSED:
        return Verdict(family, "refused", REFUSED[family])
    if family in SKIPPED:
        return Verdict(family, "skipped", SKIPPED[family])
    return Verdict(family, "untested")


def refusal_line(family: str, reason: str) -> str:
    return f"model family {family!r} cannot be trained packed exactly: {reason}"


def check_family(config, self_check: bool = True) -> Verdict:
    """Raise ``FamilyRefusedError`` (one line: the family and the reason) for a refused or skipped family,
    and for an untested one when the startup self-check is off (it is then the only guard)."""
    family = getattr(config, "model_type", None) or "the model"
    found = verdict(family)
    if found.kind in ("refused", "skipped"):
        raise FamilyRefusedError(refusal_line(family, found.reason))
    if found.kind == "untested":
        if not self_check:
            raise FamilyRefusedError(
                f"model family {family!r} is untested with packing (not in packfsdp's table for transformers "
                f"{TESTED_WITH}); keep model.self_check=true so the startup self-check can vouch for it"
            )
        log.warning(
            "model family %r is untested with packing (table of transformers %s): the startup self-check decides",
            family, TESTED_WITH,
        )
    return found


__all__ = ["EXACT", "REFUSED", "SKIPPED", "TESTED_WITH", "FamilyRefusedError", "Verdict", "check_family", "verdict"]
