"""Rotary embeddings whose frequencies depend on the sequence length, computed per example in a packed row.

transformers' ``dynamic`` (NTK) and ``longrope`` rope types pick their frequencies from ``max(position_ids)
+ 1`` over the whole input (``dynamic_rope_update``). In a packed row that is the longest example's length,
so every short example beside it would be rotated as if it were long (Phi-3 long-context checkpoints, Llama
with dynamic scaling): silently different logits and gradients. In a padded batch the longest row likewise
sets them for every row. ``dynamic`` is even stateful: it keeps grown frequencies across calls.

``apply_per_example_rope`` replaces the forward of such rotary modules (only those: plain, linear, yarn and
llama3 rope do not depend on the length and stay untouched) with one that gives each token the cos/sin its
example would get run alone through a fresh model: the frequencies of that example's length, computed by
transformers' own ``ROPE_INIT_FUNCTIONS``, with transformers' own (undecorated) rotary forward. The example
boundaries come from ``cu_seq_lens_q`` (packed), the ``attention_mask`` (padded), and wherever
``position_ids`` do not count up by one; the first two from the call in progress, as the boundary relay
(``trainer.model.relay``) keeps it for the causal LM and for its decoder stack, which the chunked loss calls
directly.
"""

from __future__ import annotations

import copy
import inspect
import logging

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from trainer.config import ConfigError
from trainer.model.relay import BoundaryRelay

log = logging.getLogger(__name__)


class RopeError(ConfigError):
    """A length-dependent rope type in a rotary module whose forward this module does not know."""


def length_dependent(rope_type: str) -> bool:
    """True for rope types whose frequencies depend on the sequence length (as ``dynamic_rope_update`` reads)."""
    return "dynamic" in rope_type or rope_type == "longrope"


def rope_types(module: nn.Module) -> dict[str | None, str]:
    """``{layer_type: rope_type}`` of a rotary module (``{None: rope_type}`` when it has one for all layers)."""
    kind = getattr(module, "rope_type", None)
    if isinstance(kind, dict):
        return dict(kind)
    return {None: kind} if isinstance(kind, str) else {}


_DYNAMIC_UPDATE_CODE = dynamic_rope_update(lambda self, x, position_ids: None).__code__
"""The code of ``dynamic_rope_update``'s wrapper, shared by every forward it decorates."""


def _uses_dynamic_update(forward) -> bool:
    """The class forward is wrapped by transformers' ``dynamic_rope_update`` (the code this module replaces)."""
    while forward is not None:
        if getattr(forward, "__code__", None) is _DYNAMIC_UPDATE_CODE:
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def example_lengths(
    position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, T]``: for every token, the length its example runs with alone (its segment's largest position
    + 1; a split piece keeps its offset). Segments start at ``cu_seqlens`` offsets and wherever the
    positions do not count up by one; a 2-D ``attention_mask`` makes each row one example (pads excluded)."""
    pos = position_ids.long()
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape == pos.shape:
        real = torch.where(attention_mask.bool(), pos, torch.full_like(pos, -1))
        return (real.amax(dim=1, keepdim=True) + 1).expand_as(pos)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if cu_seqlens is not None and pos.shape[0] == 1:
        offsets = cu_seqlens[:-1].long().to(pos.device)
        starts[0, offsets[offsets < pos.shape[1]]] = True
    segment = starts.flatten().cumsum(0) - 1  # segment ids run on across rows: every row starts one
    top = torch.full((int(segment[-1]) + 1,), -1, dtype=pos.dtype, device=pos.device)
    top = top.scatter_reduce(0, segment, pos.flatten(), reduce="amax")
    return (top[segment] + 1).view_as(pos)


class PerExampleRope:
    """The replacement forward of one rotary module (see the module docstring)."""

    def __init__(self, module: nn.Module, relay: BoundaryRelay) -> None:
        self.module = module
        self.relay = relay
        """The call in progress: its boundaries (``cu_seq_lens_q``) and its ``attention_mask``."""
        self.original = module.forward
        self.raw = inspect.unwrap(type(module).forward)  # without dynamic_rope_update (and its no_grad)
        self.types = rope_types(module)

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        rope_type = self.types.get(layer_type)
        if rope_type is None or not length_dependent(rope_type):
            return (
                self.original(x, position_ids, layer_type) if layer_type is not None else self.original(x, position_ids)
            )
        lengths = example_lengths(position_ids, self.relay.current().get("cu_seq_lens_q"), self.relay.mask)
        groups: list[tuple[torch.Tensor, float, torch.Tensor]] = []  # (inv_freq, scaling, tokens using them)
        for length in lengths.unique().tolist():
            extra = {"layer_type": layer_type} if layer_type is not None else {}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](
                self.module.config, x.device, seq_len=int(length), **extra
            )
            mask = lengths == length
            for k, (seen, seen_scaling, seen_mask) in enumerate(groups):
                if seen_scaling == scaling and torch.equal(seen, inv_freq):  # longrope: two sets for all lengths
                    groups[k] = (seen, seen_scaling, seen_mask | mask)
                    break
            else:
                groups.append((inv_freq, scaling, mask))
        cos = sin = None
        for inv_freq, scaling, mask in groups:
            c, s = self._run_with(inv_freq, scaling, x, position_ids, layer_type)
            sel = mask.view(*mask.shape, *([1] * (c.dim() - mask.dim())))
            cos = c if cos is None else torch.where(sel, c, cos)
            sin = s if sin is None else torch.where(sel, s, sin)
        return cos, sin

    @torch.no_grad()
    def _run_with(self, inv_freq, scaling, x, position_ids, layer_type):
        """transformers' rotary forward with the frequencies of one example length swapped in."""
        prefix = f"{layer_type}_" if layer_type is not None else ""
        saved = getattr(self.module, f"{prefix}inv_freq"), getattr(self.module, f"{prefix}attention_scaling")
        setattr(self.module, f"{prefix}inv_freq", inv_freq.to(saved[0].device, saved[0].dtype))
        setattr(self.module, f"{prefix}attention_scaling", scaling)
        try:
            extra = (layer_type,) if layer_type is not None else ()
            return self.raw(self.module, x, position_ids, *extra)
        finally:
            setattr(self.module, f"{prefix}inv_freq", saved[0])
            setattr(self.module, f"{prefix}attention_scaling", saved[1])


def length_dependent_rope_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every rotary module with a length-dependent rope type; raises ``RopeError`` for one
    whose forward is not transformers' ``dynamic_rope_update`` kind (its length rule is unknown here)."""
    found = []
    for name, module in model.named_modules():
        kinds = [k for k in rope_types(module).values() if k and length_dependent(k)]
        if not kinds:
            continue
        if not _uses_dynamic_update(type(module).forward) or not hasattr(module, "config"):
            family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise RopeError(
                f"{family}: rope type {kinds[0]!r} in {type(module).__name__} depends on the sequence length in a "
                "way packfsdp cannot compute per packed example"
            )
        found.append((name, module))
    return found


def verify_alone(module: nn.Module, per_example: PerExampleRope, family: str) -> None:
    """Raise ``RopeError`` unless ``per_example`` gives a lone example the cos/sin transformers' own forward
    gives it in a fresh module, at lengths on both sides of the rope's threshold (a family whose rotary
    forward reads the length its own way, e.g. Phi-3.5-MoE's longrope ``mscale``, fails here: refused)."""
    threshold = int(
        (getattr(module.config, "rope_parameters", None) or {}).get("original_max_position_embeddings")
        or getattr(module, "original_max_seq_len", 0)
        or module.config.max_position_embeddings
    )
    x = torch.zeros(1, dtype=torch.float32)
    lengths = sorted({1, threshold, threshold + 1, threshold + 7})
    row = torch.cat([torch.arange(n) for n in lengths])[None]  # one packed row: every length side by side
    for layer_type, rope_type in rope_types(module).items():
        extra = (layer_type,) if layer_type is not None else ()
        got = per_example(x, row, *extra)
        start = 0
        for n in lengths:
            expected = copy.deepcopy(module)(x, torch.arange(n)[None], *extra)  # fresh: dynamic rope keeps state
            if not all(
                torch.allclose(e[0], g[0, start : start + n], rtol=1e-5, atol=1e-6)
                for e, g in zip(expected, got, strict=True)
            ):
                raise RopeError(
                    f"{family}: rope type {rope_type!r} in {type(module).__name__} depends on the sequence length "
                    f"in a way packfsdp cannot compute per packed example (an example of {n} tokens differs)"
                )
            start += n


def apply_per_example_rope(
    model: nn.Module, relay: BoundaryRelay, modules: list[tuple[str, nn.Module]] | None = None
) -> list[str]:
    """Give every length-dependent rotary module of ``model`` (a transformers causal LM;
    ``length_dependent_rope_modules`` unless given) per-example frequencies, reading the call in progress from
    ``relay`` (attached to the model and its decoder stack); returns the names of the modules changed (empty
    for plain rope: nothing is touched)."""
    modules = length_dependent_rope_modules(model) if modules is None else modules
    if not modules:
        return []
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    for _, module in modules:
        per_example = PerExampleRope(module, relay)
        verify_alone(module, per_example, family)
        module.forward = per_example  # an instance attribute: nn.Module calls it
    names = [name for name, _ in modules]
    log.info("rope computed per example (length-dependent rope type) in %s", ", ".join(names))
    return names


__all__ = [
    "PerExampleRope",
    "RopeError",
    "apply_per_example_rope",
    "example_lengths",
    "length_dependent",
    "length_dependent_rope_modules",
]
