"""Token mixers outside attention, kept per example in a packed row.

Hybrid models mix tokens outside attention too: short causal convolutions (LFM2's ``conv`` layers, the
depthwise convolution in front of every Mamba / gated delta-rule layer), state-space scans (Mamba, Mamba-2:
Nemotron-H, Falcon-H1, Granite 4, Bamba, Zamba, Jamba) and linear-attention recurrences (gated delta rule:
Qwen3-Next, Qwen3.5, OLMo-hybrid; KDA: Kimi Linear; lightning attention: MiniMax). Run over a packed row as
transformers wrote them, each carries its convolution window and its recurrent state from one example into
the next. Here every such module sees each example alone: its state starts at zero at every boundary.

``find_token_mixers`` finds them in the built model, from what the modules are, not from the family's name:
a module that owns a ``Conv1d`` with a kernel longer than one token (a convolution along the sequence), or a
parameter or buffer only a recurrence over the sequence has (``RECURRENT_TENSORS``: a state-space / gated
decay ``A_log`` / ``dt_bias``, lightning attention's ``slope_rate``, RWKV's ``time_decay``). The outermost
such module under a decoder layer is the unit kept apart (a Kimi delta attention owns its convolutions and
its forget gate). ``KNOWN_MIXERS`` is a per-family prior for the few the rule cannot see (xLSTM's mLSTM
layer, RWKV's token-shifting feed-forward); the config verdict and the startup self-check stop any mixer
both miss.

The route a packed call takes through a mixer (``trainer.model.mixer_routes``): ``per_example`` everywhere,
exact by construction: the mixer's own forward runs on each example alone, examples of one length batched
into one call; on CUDA with flash-linear-attention / causal-conv1d / mamba_ssm installed, ``varlen_kernels``
instead: the mixer's own forward over the whole row, its kernels handed the boundaries (``cu_seqlens`` /
``seq_idx``). A padded or one-example call runs the mixer as transformers wrote it: right padding never
reaches a real token of a causal mixer (see docs/attention.md). The boundaries come from the mixer's own
keyword arguments or, for a mixer transformers calls without them, from ``trainer.model.relay``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from trainer.model.mixer_routes import MixerRoute, choose_route
from trainer.model.relay import BoundaryRelay, boundary_kwargs

RECURRENT_TENSORS = frozenset({"A_log", "dt_bias", "slope_rate", "time_decay", "time_first"})
"""Parameters / buffers that only a recurrence over the sequence has: the state-space (Mamba) and gated
linear-attention decay (``A_log``, ``dt_bias``), lightning attention's decay rate (``slope_rate``), RWKV's
``time_decay`` / ``time_first``."""

KNOWN_MIXERS: dict[str, frozenset[str]] = {
    "rwkv": frozenset({"RwkvFeedForward"}),
    "xlstm": frozenset({"xLSTMLayer"}),
}
"""A fast prior (STYLE habit 18): per family, classes that mix tokens with nothing ``find_token_mixers``'s rule
sees (RWKV's feed-forward shifts the sequence by one token through a padding layer; xLSTM's mLSTM layer
keeps its gates in plain linear layers)."""


@dataclass(frozen=True)
class TokenMixer:
    name: str
    """The module's name in the model."""
    module: nn.Module
    traits: tuple[str, ...]
    """What makes it one: ``short convolution``, ``recurrent state`` (or, from ``KNOWN_MIXERS``,
    ``token shift / recurrence``)."""


def _traits(module: nn.Module, known: frozenset[str]) -> tuple[str, ...]:
    found = []
    if any(isinstance(c, nn.Conv1d) and c.kernel_size[0] > 1 for c in module.children()):
        found.append("short convolution")
    own = {n for n, _ in module.named_parameters(recurse=False)} | {n for n, _ in module.named_buffers(recurse=False)}
    if own & RECURRENT_TENSORS:
        found.append("recurrent state")
    if not found and type(module).__name__ in known:
        found.append("token shift / recurrence")
    return tuple(found)


def kinds_of(module: nn.Module) -> set[str]:
    """What a mixer does, over all its modules (Kimi's recurrence sits in its forget gate): ``convolution``,
    ``recurrence`` (the kinds of varlen kernel it needs)."""
    kinds = set()
    for m in module.modules():
        traits = _traits(m, frozenset())
        kinds |= {"convolution"} if "short convolution" in traits else set()
        kinds |= {"recurrence"} if "recurrent state" in traits else set()
    return kinds


def find_token_mixers(model: nn.Module) -> list[TokenMixer]:
    """The outermost modules of ``model`` that mix tokens outside attention (see the module docstring)."""
    known = KNOWN_MIXERS.get(getattr(getattr(model, "config", None), "model_type", None), frozenset())
    found: list[TokenMixer] = []
    for name, module in model.named_modules():
        if any(name.startswith(m.name + ".") for m in found):
            continue  # inside a mixer already kept apart
        if traits := _traits(module, known):
            found.append(TokenMixer(name, module, traits))
    return found


class PackedMixerForward:
    """The forward of one token mixer (an instance attribute: ``nn.Module.__call__`` calls it): a packed call
    goes through ``route``, anything else through the class's own forward."""

    def __init__(self, module: nn.Module, relay: BoundaryRelay, route: MixerRoute) -> None:
        self.module = module
        self.relay = relay
        self.route = route

    @torch.compiler.disable  # reads the relay's state per call: a compiled block must not bake it in
    def __call__(self, *args, **kwargs):
        boundaries = boundary_kwargs(kwargs) or self.relay.current()
        forward = type(self.module).forward.__get__(self.module)
        if not boundaries:
            return forward(*args, **kwargs)
        return self.route.run(self.module, forward, boundaries, args, kwargs)


def keep_mixers_apart(
    mixers: list[TokenMixer], relay: BoundaryRelay, device: torch.device | None = None
) -> list[TokenMixer]:
    """Route every token mixer of a model (``find_token_mixers``) so that a packed call keeps its examples
    apart (the route chosen per mixer class for ``device``); returns them (``describe`` says which, for the log)."""
    routes: dict[type, MixerRoute] = {}
    for mixer in mixers:
        cls = type(mixer.module)
        if cls not in routes:
            routes[cls] = choose_route(mixer.module, device, kinds_of(mixer.module))
        mixer.module.forward = PackedMixerForward(mixer.module, relay, routes[cls])
    return mixers


def describe(mixers: list[TokenMixer]) -> list[str]:
    """One line per mixer class: how many, what makes them mixers, the route their packed calls take."""
    counts = Counter(type(m.module) for m in mixers)
    first = {type(m.module): m for m in reversed(mixers)}
    return [
        f"token mixer {cls.__name__} x{n} ({' + '.join(first[cls].traits)}): packed rows through "
        f"{first[cls].module.forward.route.describe()}"
        for cls, n in counts.items()
    ]


__all__ = [
    "KNOWN_MIXERS",
    "RECURRENT_TENSORS",
    "PackedMixerForward",
    "TokenMixer",
    "describe",
    "find_token_mixers",
    "keep_mixers_apart",
]
