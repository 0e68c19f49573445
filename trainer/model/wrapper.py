"""The varlen-aware model wrapper: one forward for packed and padded batches.

``VarlenCausalLM`` holds a transformers causal LM and picks its attention per batch:
- a packed batch (``cu_seqlens`` given) runs the configured packed backend, with ``position_ids``
  restarting per example and no ``attention_mask`` (the boundaries travel as ``cu_seq_lens_*`` kwargs);
- a padded batch (``attention_mask`` given) runs transformers' own SDPA path with the padding mask (eager
  for a family without one, ``padded_attention``).
The wrapper returns logits; the loss lives in the trainer (summed, normalised by the global label count).
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.model.attention import AttentionBackend
from trainer.model.packed_layout import packed_attention_kwargs

PADDED_ATTENTION = "sdpa"


def padded_attention(model_class: type) -> str:
    """transformers' attention for padded batches and the self-check's one-by-one reference: SDPA, or eager
    for a family without an SDPA path (Gemma2: SDPA cannot softcap; gpt-oss: it has no sinks)."""
    return PADDED_ATTENTION if getattr(model_class, "_supports_sdpa", True) else "eager"


class VarlenCausalLM(nn.Module):
    def __init__(self, model: nn.Module, backend: AttentionBackend) -> None:
        super().__init__()
        self.model = model
        self.backend = backend
        self.padded_attention = padded_attention(type(model))

    @property
    def config(self):
        return self.model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("a packed batch carries cu_seqlens, not an attention_mask")
            self.model.config._attn_implementation = self.backend.hf_name
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                **packed_attention_kwargs(cu_seqlens, input_ids.shape[-1]),  # host work here, not in the blocks
            )
        else:
            self.model.config._attn_implementation = self.padded_attention
            out = self.model(
                input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
            )
        return out.logits

    def decoder_layers(self) -> list[nn.Module]:
        """The repeated transformer blocks (the units FSDP shards and checkpointing wraps)."""
        names = set(getattr(self.model, "_no_split_modules", None) or [])
        layers = [m for m in self.model.modules() if type(m).__name__ in names]
        if not layers:
            raise RuntimeError(f"cannot find the decoder layers of {type(self.model).__name__}")
        return layers
