"""The routes a packed call takes through a token mixer (``trainer.model.mixers``), behind one interface.

A route has ``run(module, forward, boundaries, args, kwargs)``: ``forward`` is the mixer's own (class)
forward bound to ``module``, ``boundaries`` the packed call's ``cu_seq_lens_q`` / ``max_length_q``, ``args`` /
``kwargs`` what the mixer was called with (its input ``[1, T, ...]``, one flat packed row). It returns what
``forward`` returns for the row, each example computed as if alone.

- ``PerExample`` (any device, any installed kernel): the mixer's own forward on each example alone. Examples
  of one length share one call, stacked as rows (``[rows, length, ...]``): nothing is padded, so nothing but
  the example itself reaches a row, whatever the mixer computes. Every tensor argument laid out along the
  row's tokens (the hidden states, ``position_ids``, rotary ``position_embeddings``, a convolution input
  ``[1, channels, T]``) is cut the same way; the boundary kwargs are dropped; the outputs laid out along
  the tokens are put back in row order, other outputs (a final recurrent state, which a training forward
  discards) come back as ``None``.
- ``VarlenKernels`` (``trainer.model.mixer_kernels``): CUDA, with flash-linear-attention / causal-conv1d /
  mamba_ssm installed: the mixer's own forward over the whole row, its kernels handed the boundaries.
"""

from __future__ import annotations

from typing import Protocol

import torch

from trainer.config import ConfigError
from trainer.model.mixer_kernels import VarlenKernels, fla_refusal, kernels_run_on, varlen_names
from trainer.model.packed_layout import PackedLayout, SlotPlan, length_buckets
from trainer.model.relay import BOUNDARY_KWARGS


class MixerError(RuntimeError):
    """A token mixer's packed call cannot be kept apart per example (an input it cannot cut)."""


class MixerRoute(Protocol):
    name: str

    def describe(self) -> str: ...

    def run(self, module, forward, boundaries: dict, args: tuple, kwargs: dict): ...


def _token_dim(t: torch.Tensor, total: int) -> int | None:
    """The dimension of ``t`` along the packed row's ``total`` tokens (``[1, T, ...]`` or ``[1, ..., T]``)."""
    if t.dim() < 2 or t.shape[0] != 1:
        return None
    if t.shape[1] == total:
        return 1
    return t.dim() - 1 if t.shape[-1] == total else None


class _Cutter:
    """Cuts the row's token-laid tensors into the plan's rectangles and puts outputs back in row order."""

    def __init__(self, plan: SlotPlan, total: int) -> None:
        self.plan = plan
        self.total = total

    def cut(self, value):
        """``value`` per rectangle: a list (one entry per rectangle) of the value cut, or ``[value] * n``."""
        n = len(self.plan.shapes)
        if isinstance(value, torch.Tensor):
            dim = _token_dim(value, self.total)
            if dim is None:
                return [value] * n
            flat = value.squeeze(0).movedim(dim - 1, 0)  # squeeze: a view, its backward no full-size copy
            return [p.movedim(1, dim).contiguous() for p in self.plan.to_rectangles(flat)]
        if isinstance(value, (tuple, list)):
            cut = [self.cut(v) for v in value]
            return [type(value)(c[r] for c in cut) for r in range(n)]
        return [value] * n

    def join(self, outputs: list):
        """The rectangles' outputs back as one row's."""
        first = outputs[0]
        if isinstance(first, torch.Tensor):
            rows, width = self.plan.shapes[0]
            dim = (
                1
                if first.dim() > 1 and first.shape[1] == width
                else (first.dim() - 1 if first.shape[-1] == width else None)
            )
            if first.dim() < 2 or first.shape[0] != rows or dim is None:
                return None  # a state of the rows, not laid along the tokens: no row-level meaning
            tokens = self.plan.from_rectangles([o.movedim(dim, 1) for o in outputs], row=False)
            return tokens.movedim(0, dim - 1).unsqueeze(0)
        if isinstance(first, (tuple, list)):
            return type(first)(self.join([o[i] for o in outputs]) for i in range(len(first)))
        if first is None:
            return None
        raise MixerError(
            f"a token mixer returned a {type(first).__name__}, which packfsdp cannot put back in row order"
        )


class PerExample:
    """Each example through the mixer's own forward alone, equal lengths batched (see the module docstring)."""

    name = "per_example"

    def __init__(self, why: str = "") -> None:
        self.why = why
        """Why not the varlen kernels (on CUDA), for the log."""

    def describe(self) -> str:
        why = f"; varlen kernels not used: {self.why}" if self.why else ""
        return f"per_example (the mixer's own forward on each example alone; examples of one length batched{why})"

    def run(self, module, forward, boundaries: dict, args: tuple, kwargs: dict):
        return _per_example(forward, boundaries, args, kwargs)


@torch.compiler.disable  # loops over the boundaries on the host, as the SDPA backends do
def _per_example(forward, boundaries: dict, args: tuple, kwargs: dict):
    layout = PackedLayout.of(boundaries["cu_seq_lens_q"])
    kwargs = {k: v for k, v in kwargs.items() if k not in BOUNDARY_KWARGS}
    primary = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    if primary is None or _token_dim(primary, layout.total) is None:
        shape = None if primary is None else tuple(primary.shape)
        raise MixerError(
            f"a token mixer got no input laid along the packed row's {layout.total} tokens (first tensor: {shape})"
        )
    if len(layout.lengths) == 1:
        return forward(*args, **kwargs)
    groups = length_buckets(layout.lengths, 0.0)  # one length per call, one example per row
    plan = layout.plan("mixer:equal", [[[i] for i in g] for g in groups], primary.device)
    cutter = _Cutter(plan, layout.total)
    cut_args = [cutter.cut(a) for a in args]
    cut_kwargs = {k: cutter.cut(v) for k, v in kwargs.items()}
    outputs = [
        forward(*(a[r] for a in cut_args), **{k: v[r] for k, v in cut_kwargs.items()}) for r in range(len(groups))
    ]
    return cutter.join(outputs)


def choose_route(module, device: torch.device | None, kinds: set[str]) -> MixerRoute:
    """The route of ``module``'s class on ``device``: the varlen kernels where they run and cover ``kinds``
    (what the mixer does: ``convolution``, ``recurrence``), else per example (``PerExample.why`` says why
    not the kernels, for the log)."""
    if not kernels_run_on(device):
        return PerExample()
    if refusal := fla_refusal(module, device):
        raise ConfigError(refusal)
    names, why_not = varlen_names(module, kinds)
    return VarlenKernels(names, kinds) if why_not is None else PerExample(why_not)


__all__ = ["MixerError", "MixerRoute", "PerExample", "choose_route"]
