"""The example boundaries of the packed call in progress, for modules that transformers does not hand them to.

transformers passes a packed forward's ``cu_seq_lens_q`` / ``max_length_q`` keyword arguments from the
decoder down to each decoder layer and from there to the modules that take ``**kwargs``; some families'
layers drop them before their attention (StableLM, Nemotron), and most token mixers outside attention
(short convolutions, state-space scans) never take them. ``BoundaryRelay`` keeps them where such a module
can ask (``current``):

- pre-hooks on the causal LM and on its decoder stack remember what the packed call was given (the wrapper
  hands the causal LM the boundaries, which some families do not pass on to their stack; the chunked loss
  calls the stack directly); the outermost call's post-hook forgets them;
- a pre-hook on every decoder layer remembers them per layer input: under activation checkpointing a layer
  runs again in the backward pass, after the decoder's forward has returned, with the same input tensor
  (``torch.distributed._composable.checkpoint`` recomputes with the saved inputs), so the boundaries of that
  input are found again there.

A padded or one-example call has no boundaries: ``current`` is empty and the modules run as transformers
wrote them. The outermost call's 2-D ``attention_mask`` is kept apart (``mask``): per-example rope reads a
padded batch's rows from it (``trainer.model.rope``). The hooks are bound methods of the relay, so
``copy.deepcopy`` of the model (the preference reference) gets its own relay, bound to the copy's modules.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The keyword arguments of a packed forward that carry the example boundaries."""


class BoundaryRelay:
    """The boundaries of the packed call in progress (see the module docstring)."""

    def __init__(self) -> None:
        self.depth = 0
        """How many of the causal LM / decoder stack forwards are running (0: outside them, e.g. a
        checkpointed layer recomputed in the backward pass)."""
        self.call: dict = {}
        """The boundary kwargs of the outermost running call (empty: not a packed call)."""
        self.mask: torch.Tensor | None = None
        """The outermost running call's ``attention_mask`` (a padded batch's), ``None`` outside a call."""
        self.layer: dict = {}
        """Those of the decoder layer running now."""
        self.by_input: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Each decoder layer input's boundary kwargs, found again when a checkpointed layer recomputes."""

    def attach(self, model: nn.Module, decoder: nn.Module, layers: list[nn.Module]) -> BoundaryRelay:
        for outer in dict.fromkeys((model, decoder)):
            outer.register_forward_pre_hook(self.call_starts, with_kwargs=True)
            outer.register_forward_hook(self.call_ends, with_kwargs=True, always_call=True)
        for layer in layers:
            layer.register_forward_pre_hook(self.layer_starts, with_kwargs=True)
        return self

    def call_starts(self, _module, _args, kwargs) -> None:
        if self.depth == 0:
            self.call = boundary_kwargs(kwargs)
            self.mask = kwargs.get("attention_mask")
        self.depth += 1
        self.layer = self.call

    def call_ends(self, _module, _args, _kwargs, _output) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.call = self.layer = {}
            self.mask = None

    def layer_starts(self, _module, args, kwargs) -> None:
        found = boundary_kwargs(kwargs)
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if self.depth:  # the model's forward: remember this input's boundaries (none for a padded call)
            found = found or self.call
            if isinstance(hidden, torch.Tensor):
                self.by_input[hidden] = found
        elif not found and isinstance(hidden, torch.Tensor):
            if hidden not in self.by_input:
                return  # a module nested in a recomputed layer, its input recomputed: the layer's boundaries hold
            found = self.by_input[hidden]
        self.layer = found

    def current(self) -> dict:
        """The boundary kwargs of the packed call running now (empty when it is not packed)."""
        return self.layer or self.call


def boundary_kwargs(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in BOUNDARY_KWARGS if kwargs.get(k) is not None}


__all__ = ["BOUNDARY_KWARGS", "BoundaryRelay", "boundary_kwargs"]
