"""Make a built transformers causal LM exact for packed rows: per-example rope, the boundary relay."""

from __future__ import annotations

import inspect

import torch

from trainer.model.attention import AttentionBackend
from trainer.model.families import RELAY_BOUNDARIES
from trainer.model.layer_relay import relay_layer_settings
from trainer.model.rope import apply_per_example_rope
from trainer.model.wrapper import VarlenCausalLM, decoder_of


def prepare_model(model: torch.nn.Module, backend: AttentionBackend) -> VarlenCausalLM:
    """A built transformers causal LM made exact for packed rows and wrapped for varlen batches: rope
    computed per example where its frequencies depend on the length (``trainer.model.rope``), the
    example boundaries handed to the attention modules of a family whose layers drop them
    (``families.RELAY_BOUNDARIES``), and the windows / chunks a family keeps in its mask handed to its
    layers (``trainer.model.layer_relay``)."""
    apply_per_example_rope(model)
    if getattr(model.config, "model_type", None) in RELAY_BOUNDARIES:
        relay_boundaries(model)
    relay_layer_settings(model, decoder_of(model), _calls_attention_interface)
    return VarlenCausalLM(model, backend)


BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def relay_boundaries(model: torch.nn.Module) -> int:
    """Hand the packed boundaries the model was called with to every attention module (those that call
    transformers' attention interface) that did not receive them; returns how many modules were hooked."""
    boundaries: dict = {}

    def remember(_module, _args, kwargs):
        boundaries.clear()
        boundaries.update({k: kwargs[k] for k in BOUNDARY_KWARGS if kwargs.get(k) is not None})

    def forget(_module, _args, _kwargs, _output):
        boundaries.clear()

    def hand_over(_module, args, kwargs):
        return args, {**boundaries, **kwargs}

    # On the decoder stack: the causal LM hands it the boundaries, and the chunked loss calls it directly.
    decoder = decoder_of(model)
    decoder.register_forward_pre_hook(remember, with_kwargs=True)
    decoder.register_forward_hook(forget, with_kwargs=True, always_call=True)
    hooked = [m for m in model.modules() if _calls_attention_interface(type(m))]
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
