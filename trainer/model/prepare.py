"""Make a built transformers causal LM exact for packed rows: per-example rope, the boundary relay, token mixers
kept per example."""

from __future__ import annotations

import inspect

import torch

from trainer.model.attention import AttentionBackend
from trainer.model.families import RELAY_BOUNDARIES
from trainer.model.layer_relay import relay_layer_settings
from trainer.model.mixers import find_token_mixers, keep_mixers_apart
from trainer.model.relay import BoundaryRelay
from trainer.model.rope import apply_per_example_rope, length_dependent_rope_modules
from trainer.model.wrapper import VarlenCausalLM, decoder_of


def prepare_model(model: torch.nn.Module, backend: AttentionBackend) -> VarlenCausalLM:
    """A built transformers causal LM made exact for packed rows and wrapped for varlen batches: rope
    computed per example where its frequencies depend on the length (``trainer.model.rope``), the example
    boundaries handed to the attention modules of a family whose layers drop them
    (``families.RELAY_BOUNDARIES``), the windows / chunks a family keeps in its mask handed to its layers
    (``trainer.model.layer_relay``), and every token mixer outside attention (convolutions, state-space
    scans, linear-attention recurrences) run per example (``trainer.model.mixers``)."""
    ropes = length_dependent_rope_modules(model)
    wrapped = VarlenCausalLM(model, backend)
    relays = getattr(model.config, "model_type", None) in RELAY_BOUNDARIES
    mixers = find_token_mixers(model)
    if ropes or relays or mixers:
        relay = BoundaryRelay().attach(model, decoder_of(model), wrapped.decoder_layers())
        apply_per_example_rope(model, relay, ropes)
        if relays:
            relay_boundaries(model, relay)
        wrapped.token_mixers = keep_mixers_apart(mixers, relay, backend.device)
    relay_layer_settings(model, decoder_of(model), _calls_attention_interface)
    return wrapped


class _HandOver:
    """A pre-hook that adds the relay's boundaries to an attention module's call (a bound method's owner:
    ``deepcopy`` of the model copies it with its relay)."""

    def __init__(self, relay: BoundaryRelay) -> None:
        self.relay = relay

    def __call__(self, _module, args, kwargs):
        return args, {**self.relay.current(), **kwargs}


def relay_boundaries(model: torch.nn.Module, relay: BoundaryRelay) -> int:
    """Hand the packed boundaries the model was called with (``relay``) to every attention module (those that
    call transformers' attention interface) that did not receive them; returns how many modules were hooked."""
    hooked = [m for m in model.modules() if _calls_attention_interface(type(m))]
    hand_over = _HandOver(relay)
    for module in hooked:
        module.register_forward_pre_hook(hand_over, with_kwargs=True)
    return len(hooked)


def _calls_attention_interface(cls: type) -> bool:
    """The module's forward calls transformers' attention interface and takes ``**kwargs`` to pass on."""
    try:
        source = inspect.getsource(cls.forward)
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.forward).parameters.values())
    except (OSError, TypeError, ValueError):  # no source (a builtin module): not an attention layer of transformers
        return False
    return takes_kwargs and "ALL_ATTENTION_FUNCTIONS" in source
