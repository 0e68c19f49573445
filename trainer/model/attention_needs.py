"""What a model's attention asks of a packed backend beyond plain causal attention, and the guard that
refuses a kernel argument a backend does not implement.

transformers passes such arguments to the attention function: ``softcap`` (Gemma2's attention logit
softcapping, ``softcap * tanh(scores / softcap)`` before the softmax), ``s_aux`` (learned per-head
attention sinks: an extra logit in every softmax's denominator, e.g. gpt-oss; ``trainer.model.sinks``),
and selections no packed backend implements (``UNHONOURED``). A backend that ignored one would train a
different model without a word, so ``resolve_backend`` refuses it at start from the model's config
(``AttentionNeeds.of``), and each backend refuses the argument again if it arrives anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.model.packed_layout import AttentionBackendError

SINK_FAMILIES = frozenset(
    {
        "gpt_oss",
        "flint",
        "granite_swa",
        "granitemoe_swa",
        "hy_v4",
        "hy_v4_vl",
        "deepseek_v4",
        "openai_privacy_filter",
        "mimo_v2_flash",
    }
)
"""Model types whose attention passes ``s_aux`` (transformers 5.x). Their configs carry no field for it: the
sinks are a parameter of every attention layer, so the family is the only sign before the model is built."""


def attention_dropout(config) -> float:
    """The attention-probability dropout a transformers config asks for (0 when it has none)."""
    for key in ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob"):
        value = getattr(config, key, None)
        if value:
            return float(value)
    return 0.0


@dataclass(frozen=True)
class AttentionNeeds:
    """What a model's attention asks of the packed backend, read from its transformers config (no weights)."""

    family: str = "the model"
    """The config's ``model_type``, named in refusals."""
    dropout: float = 0.0
    """Attention-probability dropout."""
    softcap: float | None = None
    """Attention logit softcapping (``attn_logit_softcapping``), ``None`` when off."""
    sinks: bool = False
    """Learned attention sinks (``s_aux``)."""
    head_dim: int | None = None
    """The smallest head dim of its queries, keys and values (MLA: ``qk_nope + qk_rope`` and ``v_head_dim``),
    ``None`` when the config does not say."""
    chunk: int | None = None
    """The chunk of chunked-attention layers (``attention_chunk_size`` where ``layer_types`` has
    ``chunked_attention``, shorter than the context), ``None`` without: cut into finer boundaries
    (``trainer.model.layer_relay``)."""

    @property
    def needs_eager_reference(self) -> bool:
        """Whether only transformers' eager attention computes this model's attention as configured (SDPA
        has no softcap and no sinks): the padded path and the self-check's reference then run eager."""
        return self.softcap is not None or self.sinks

    @classmethod
    def of(cls, config) -> AttentionNeeds:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        family = getattr(text, "model_type", None) or getattr(config, "model_type", None) or "the model"
        softcap = getattr(text, "attn_logit_softcapping", None)
        chunk = getattr(text, "attention_chunk_size", None)
        context = getattr(text, "max_position_embeddings", None)
        chunked = "chunked_attention" in (getattr(text, "layer_types", None) or []) and (not context or chunk < context)
        return cls(
            family=family,
            dropout=attention_dropout(text),
            softcap=float(softcap) if softcap else None,
            sinks=family in SINK_FAMILIES or getattr(config, "model_type", None) in SINK_FAMILIES,
            head_dim=_smallest_head_dim(text),
            chunk=int(chunk) if chunk and chunked else None,
        )

    def context_parallel_refusal(self, cp: int) -> str | None:
        """Why ``parallel.cp=cp`` cannot run this attention (its kernels apply neither sinks nor chunks), or None."""
        if cp <= 1:
            return None
        if self.sinks:
            return f"parallel.cp={cp} cannot honour {self.family}'s attention sinks (s_aux): use parallel.cp=1"
        if self.chunk:
            return (
                f"parallel.cp={cp} cannot honour {self.family}'s chunked attention "
                f"(attention_chunk_size={self.chunk}): use parallel.cp=1"
            )
        return None


def _smallest_head_dim(config) -> int | None:
    """The smallest head dim a config's attention computes with (queries and keys, values), or None."""
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if isinstance(nope, int) and isinstance(rope, int):  # multi-head latent attention
        dims = [nope + rope, getattr(config, "v_head_dim", None)]
    elif isinstance(getattr(config, "head_dim", None), int):
        dims = [config.head_dim]
    else:
        hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
        dims = [hidden // heads] if isinstance(hidden, int) and isinstance(heads, int) and heads else []
    dims = [d for d in dims if isinstance(d, int) and d > 0]
    return min(dims) if dims else None


UNHONOURED = {
    "indices": "the key selection of its DSA indexer (indices)",
    "block_indices": "the key-block selection of its sparse-attention indexer (block_indices)",
    "sinks": "its attention sinks (sinks)",
    "position_bias": "its position bias (position_bias)",
}
"""Attention-function arguments of transformers 5.x families that no packed backend implements, with what
they carry. Their families are refused at build (``trainer.model.families``); a backend refuses them again."""


def refuse_unhonoured(backend: str, kwargs: dict, *, softcap: bool = False, sinks: bool = False) -> None:
    """Raise ``AttentionBackendError`` if transformers passed ``softcap`` (unless the backend implements it,
    ``softcap=True``), ``s_aux`` unless the backend applies sinks (``sinks=True``), or an argument of
    ``UNHONOURED``: the second line of defence behind ``resolve_backend``, so the startup self-check stops a
    run that got past it."""
    if kwargs.get("softcap") is not None and not softcap:
        raise AttentionBackendError(
            f"model.attention={backend} cannot honour the model's attention softcapping (softcap={kwargs['softcap']})"
        )
    if kwargs.get("s_aux") is not None and not sinks:
        raise AttentionBackendError(f"model.attention={backend} cannot honour the model's attention sinks (s_aux)")
    for name, what in UNHONOURED.items():
        if kwargs.get(name) is not None:
            raise AttentionBackendError(
                f"model.attention={backend} cannot honour {what}: no packed backend implements it"
            )


__all__ = ["SINK_FAMILIES", "UNHONOURED", "AttentionNeeds", "attention_dropout", "refuse_unhonoured"]
