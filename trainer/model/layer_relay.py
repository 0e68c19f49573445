"""What a family keeps out of its attention call, handed to its layers for packed rows.

transformers builds a padded batch's attention mask from the config, and some families rely on that mask
alone for a layer's locality, where a packed row has no mask: the packed attention would see the whole
example. ``relay_layer_settings`` hooks the layers of such a family so that packed attention gets it:

- **a sliding window** (``families.WINDOW_DROPPED``: Phi-3.5-MoE on every layer, Qwen2-MoE on its
  ``sliding_attention`` layers): ``sliding_window`` joins the attention call's keyword arguments, as the
  families that pass it do (every backend honours it, ``trainer.model.packed_layout``);
- **attention chunks** (``families.CHUNK_DROPPED``: Llama 4's ``chunked_attention`` layers): a token's chunk
  is ``position // attention_chunk_size`` within its example (positions restart per example, and alone an
  example's positions are its row indices), so a chunked layer's attention is causal attention inside each
  chunk: the layer gets boundaries cut at every chunk (``chunk_boundaries``), made once per forward on the
  decoder stack, outside compiled blocks. Not under ``parallel.cp`` (refused in one line).

Llama 4's attention temperature (``attn_temperature_tuning`` on its NoPE layers) scales each query by
``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` where ``p`` is the token's *row index*: in a
packed row longer than ``floor_scale`` an example's tokens would get the scale of their place in the row.
For a packed call the layer's ``floor_scale`` becomes, per token, a divisor that gives the same floor from
its row index as ``floor_scale`` gives from its position (``per_token_floor_scale``); transformers' own
formula then computes each token's scale as alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.model.families import CHUNK_DROPPED, TEMPERATURE_BY_ROW, WINDOW_DROPPED
from trainer.model.packed_layout import AttentionBackendError, PackedLayout, packed_attention_kwargs


def chunk_boundaries(cu_seqlens: torch.Tensor, chunk: int) -> torch.Tensor:
    """``cu_seqlens`` cut at every ``chunk`` tokens of each example (a chunk never spans two examples)."""
    layout = PackedLayout.of(cu_seqlens)

    def make() -> torch.Tensor:
        bounds, start = [0], 0
        for n in layout.lengths:
            bounds += [start + min(n, c + chunk) for c in range(0, n, chunk)]
            start += n
        return torch.tensor(bounds, dtype=cu_seqlens.dtype).to(cu_seqlens.device, non_blocking=True)

    return layout.cached(f"chunks:{chunk}", make)


def per_token_floor_scale(position_ids: torch.Tensor, floor_scale: float) -> torch.Tensor:
    """``[T]`` divisors ``F_t`` with ``floor((t + 1) / F_t) == floor((p_t + 1) / floor_scale)`` for the row
    index ``t`` and the position ``p_t``: ``F_t = (t + 1) / (m_t + 1/2)``, which lands mid-way between two
    integers, so the floor is ``m_t`` whatever the float rounding."""
    positions = position_ids.reshape(-1).float()
    floors = torch.floor((positions + 1.0) / floor_scale)
    rows = torch.arange(1, len(positions) + 1, device=positions.device, dtype=torch.float32)
    return rows / (floors + 0.5)


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def relay_layer_settings(model, decoder, is_attention: Callable[[type], bool]) -> int:
    """Hook the attention modules (``is_attention(their class)``) of ``model`` (its decoder stack
    ``decoder``) whose family keeps a setting out of the attention call (the module doc); returns how many
    were hooked."""
    config = _text_config(model)
    family = getattr(config, "model_type", None)
    if family not in WINDOW_DROPPED | CHUNK_DROPPED | TEMPERATURE_BY_ROW:
        return 0
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None) if family in WINDOW_DROPPED else None
    chunk = getattr(config, "attention_chunk_size", None) if family in CHUNK_DROPPED else None
    classes = {cls for cls in {type(m) for m in model.modules()} if is_attention(cls)}
    per_forward: dict = {}
    hooked, tempered = 0, False
    for module in (m for m in model.modules() if type(m) in classes):
        kind = layer_types[module.layer_idx] if layer_types and hasattr(module, "layer_idx") else None
        if window and kind in (None, "sliding_attention"):
            module.register_forward_pre_hook(_window_hook(int(window)), with_kwargs=True)
            hooked += 1
        if chunk and kind == "chunked_attention":
            module.register_forward_pre_hook(_chunk_hook(int(chunk), per_forward), with_kwargs=True)
            hooked += 1
        no_rope = not getattr(module, "use_rope", True)
        if family in TEMPERATURE_BY_ROW and getattr(module, "attn_temperature_tuning", False) and no_rope:
            module.register_forward_pre_hook(_temperature_hook(per_forward), with_kwargs=True)
            module.register_forward_hook(_restore_floor_scale, always_call=True)
            hooked, tempered = hooked + 1, True
    if hooked:
        floor_scale = getattr(config, "floor_scale", None) if tempered else None
        decoder.register_forward_pre_hook(_per_forward(per_forward, chunk, floor_scale), with_kwargs=True)
        decoder.register_forward_hook(lambda *_: per_forward.clear(), with_kwargs=True, always_call=True)
    return hooked


def _per_forward(per_forward: dict, chunk: int | None, floor_scale):
    """The decoder stack's pre-hook: what the hooked layers need, made once per forward from its inputs
    (host work here, outside compiled blocks)."""

    def remember(_module, _args, kwargs):
        per_forward.clear()
        per_forward["cp"] = kwargs.get("cp_shard") is not None
        cu = kwargs.get("cu_seq_lens_q")
        if chunk and cu is not None:
            per_forward["chunks"] = packed_attention_kwargs(chunk_boundaries(cu, chunk), PackedLayout.of(cu).total)
        positions = kwargs.get("position_ids")
        if floor_scale and positions is not None and positions.shape[0] == 1:  # padded rows: row index == position
            per_forward["floor_scale"] = per_token_floor_scale(positions, float(floor_scale))

    return remember


def _window_hook(window: int):
    def hand_over(_module, args, kwargs):
        return args, {**kwargs, "sliding_window": window}

    return hand_over


def _chunk_hook(chunk: int, per_forward: dict):
    def hand_over(_module, args, kwargs):
        if per_forward.get("cp"):
            raise AttentionBackendError(
                f"chunked attention (attention_chunk_size={chunk}) is not packed under parallel.cp: use parallel.cp=1"
            )
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None:  # a padded batch: transformers' mask has the chunks
            return args, kwargs
        if "chunks" not in per_forward:  # called outside the decoder stack's forward: made here
            per_forward["chunks"] = packed_attention_kwargs(chunk_boundaries(cu, chunk), PackedLayout.of(cu).total)
        return args, {**kwargs, **per_forward["chunks"]}

    return hand_over


def _temperature_hook(per_forward: dict):
    def per_token(module, args, kwargs):
        if "floor_scale" in per_forward:
            module._packfsdp_floor_scale = module.floor_scale
            module.floor_scale = per_forward["floor_scale"]
        return args, kwargs

    return per_token


def _restore_floor_scale(module, _args, _output):
    if "_packfsdp_floor_scale" in module.__dict__:
        module.floor_scale = module.__dict__.pop("_packfsdp_floor_scale")


__all__ = ["chunk_boundaries", "per_token_floor_scale", "relay_layer_settings"]
