"""The varlen-aware model wrapper: one forward for packed and padded batches.

``VarlenCausalLM`` holds a transformers causal LM and picks its attention per batch:
- a packed batch (``cu_seqlens`` given) runs the configured packed backend, with ``position_ids``
  restarting per example and no ``attention_mask`` (the boundaries travel as ``cu_seq_lens_*`` kwargs);
- a padded batch (``attention_mask`` given) runs transformers' own SDPA path with the padding mask (eager
  for a family without one, ``padded_attention``).
The wrapper returns logits, or with ``labels`` the summed token loss (``trainer.loss``: naive or chunked); the
trainer normalises it by the global label count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.collate import IGNORE_INDEX
from trainer.loss import (
    HeadLoss, LogitTransform, chunked_token_logps, head_matches_logits, label_positions, liger_available,
    naive_summed_loss, naive_token_logps, sequence_of_labels,
)
from trainer.model.attention import AttentionBackend
from trainer.model.attention_needs import AttentionNeeds
from trainer.model.packed_layout import packed_attention_kwargs

PADDED_ATTENTION = "sdpa"


def padded_attention(model: nn.Module) -> str:
    """transformers' attention for padded batches and the self-check's one-by-one reference, chosen from
    what the model's CONFIG asks of attention (``AttentionNeeds``), not from class flags, which change
    between releases (transformers 5.17 marks Gemma2 ``_supports_sdpa``; SDPA cannot softcap there):
    eager, transformers' reference, when the config softcaps or has sinks, which SDPA cannot apply; SDPA
    otherwise (it honours dropout, and windows live in the mask transformers builds for both). A class that
    says it has no SDPA path gets eager: the flag may only move the choice towards the reference, never away."""
    if AttentionNeeds.of(model.config).needs_eager_reference:
        return "eager"
    return PADDED_ATTENTION if getattr(type(model), "_supports_sdpa", True) else "eager"


def decoder_of(model: nn.Module) -> nn.Module:
    """The causal LM's decoder stack (the module whose output the head reads): ``base_model``, or the
    ``model`` attribute where ``base_model`` is the causal LM itself (Llama 4 text: prefix ``language_model``)."""
    for candidate in (model.base_model, getattr(model, "model", None)):
        if isinstance(candidate, nn.Module) and candidate is not model:
            return candidate
    raise RuntimeError(f"cannot find the decoder of {type(model).__name__} (the chunked loss needs its hidden states)")


class VarlenCausalLM(nn.Module):
    def __init__(self, model: nn.Module, backend: AttentionBackend) -> None:
        super().__init__()
        self.model = model
        self.backend = backend
        self.padded_attention = padded_attention(model)
        self.loss = HeadLoss()
        """The loss ``forward(..., labels=...)`` runs: naive until ``use_loss`` picks one."""
        self.cp_group = None
        """Context parallel: the process group a sharded row's keys/values are gathered over."""
        self.cp_gather = None
        """Context parallel, one process (tests, GPU check): replaces the all-gather."""
        self.token_mixers: list = []
        """The modules that mix tokens outside attention, kept per example (``trainer.model.mixers``)."""

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
        labels: torch.Tensor | None = None,
        cp_shard=None,
        per_sequence: bool = False,
    ) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``; with ``labels``, the summed token loss (fp32 scalar) instead,
        through the loss implementation ``use_loss`` picked. The loss runs here, inside the root module's
        forward, because that is where FSDP2 holds the head's parameters gathered. With ``per_sequence``
        (the preference objective), each sequence's summed label log-probability ``[sequences]`` instead."""
        if per_sequence:
            return self.sequence_logps(input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask, labels)
        if cp_shard is not None:
            inputs = self.context_parallel_inputs(input_ids, position_ids, cp_shard)
        else:
            inputs = self.attention_inputs(input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask)
        if labels is None or self.loss.impl == "naive":
            logits = self.model(**inputs).logits
            if labels is None:
                return logits
            if cp_shard is not None:  # labels already shifted before the row was sharded
                return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            return naive_summed_loss(logits, labels)
        hidden = decoder_of(self.model)(**inputs).last_hidden_state
        if cp_shard is not None:  # pre-shifted: one dummy position after the last makes label_positions' shift a no-op
            hidden, labels = F.pad(hidden, (0, 0, 0, 1)), F.pad(labels, (1, 0), value=IGNORE_INDEX)
        hidden, targets = label_positions(hidden, labels)
        head = self.model.get_output_embeddings()
        return self.loss(hidden, head.weight, head.bias, targets)

    def sequence_logps(self, input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask, labels) -> torch.Tensor:
        """Summed label log-probabilities per sequence (a packed segment or a padded row), fp32: the chunked
        head (``trainer.loss.chunked_token_logps``, never full logits) unless ``loss.impl=naive``."""
        inputs = self.attention_inputs(input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask)
        if self.loss.impl == "naive":
            token_logps = naive_token_logps(self.model(**inputs).logits, labels)
        else:
            hidden, targets = label_positions(decoder_of(self.model)(**inputs).last_hidden_state, labels)
            head = self.model.get_output_embeddings()
            token_logps = chunked_token_logps(hidden, head.weight, head.bias, targets, self.loss.transform,
                                              self.loss.chunk_tokens)
        sequences = labels.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        out = torch.zeros(sequences, dtype=torch.float32, device=token_logps.device)
        return out.index_add(0, sequence_of_labels(labels, cu_seqlens), token_logps)

    def context_parallel_inputs(self, input_ids, position_ids, cp_shard) -> dict:
        """A rank's shard of a context-parallel row (``trainer.context_parallel``): the CP attention all-gathers
        keys/values over ``cp_group`` and runs the configured backend's kernel with separate q/k boundaries."""
        from trainer.context_parallel import CP_ATTENTION

        self.model.config._attn_implementation = CP_ATTENTION
        return dict(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, cp_shard=cp_shard,
            cp_group=self.cp_group, cp_gather=self.cp_gather, cp_kernel=self.backend.name,
        )

    def attention_inputs(self, input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask) -> dict:
        """The transformers call's keyword arguments; selects the attention for a packed or padded batch."""
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("a packed batch carries cu_seqlens, not an attention_mask")
            self.model.config._attn_implementation = self.backend.hf_name
            return dict(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                **packed_attention_kwargs(cu_seqlens, input_ids.shape[-1]),  # host work here, not in the blocks
            )
        self.model.config._attn_implementation = self.padded_attention
        return dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False)

    def use_loss(self, impl: str, chunk_tokens: int | None = None) -> str:
        """Pick the loss implementation (``loss.impl``) and return its name for the start-up log. ``chunked``
        runs Liger's kernel on CUDA when installed, else torch's; it falls back to ``naive``, saying why,
        for a family whose logits are not the (scaled, softcapped) head output, found by a probe forward."""
        self.loss = HeadLoss()
        if impl == "naive":
            return self.loss.describe()
        transform = LogitTransform.of(self.config)
        mismatch = self.head_mismatch(transform)
        if mismatch:
            return f"naive (chunked refused: {mismatch})"
        device = self.model.get_output_embeddings().weight.device
        kernel = "liger" if liger_available(device) else "torch"
        self.loss = HeadLoss(impl, kernel, transform, chunk_tokens)
        return self.loss.describe()

    @torch.no_grad()
    def head_mismatch(self, transform: LogitTransform, tokens: int = 8) -> str | None:
        """Why the chunked loss cannot reproduce this model's logits, or ``None`` when it can: an 8-token
        probe compares the model's logits with ``transform(head(base model's hidden states))``."""
        head = self.model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            return f"the output head is a {type(head).__name__}, not a Linear"
        if own := sorted(set(dict(head.named_parameters())) - {"weight", "bias"}):
            # Dory's logit_scale: its init leaves the logits unchanged (so the probe below agrees), but the
            # chunked loss would never train it and would drift from the model's own logits once it moves.
            return f"the output head {type(head).__name__} has parameters of its own ({', '.join(own)})"
        positions = torch.arange(tokens, device=head.weight.device)[None]
        ids = positions % head.out_features
        inputs = self.attention_inputs(ids, positions, None, None, torch.ones_like(ids))
        was_training = self.training
        self.eval()
        try:
            reference = self.model(**inputs).logits
            hidden = decoder_of(self.model)(**inputs).last_hidden_state
        finally:
            self.train(was_training)
        ours, _ = transform.apply(nn.functional.linear(hidden, head.weight, head.bias).float())
        if head_matches_logits(reference, ours):
            return None
        return f"{type(self.model).__name__}'s logits are not its head's output ({transform})"

    def decoder_layers(self) -> list[nn.Module]:
        """The repeated transformer blocks (the units FSDP shards and checkpointing wraps): the outermost
        modules of the classes transformers lists in ``_no_split_modules`` (Mamba lists its mixer too, which
        sits inside its block)."""
        names = set(getattr(self.model, "_no_split_modules", None) or [])
        layers = [m for m in self.model.modules() if type(m).__name__ in names]
        inner = {id(c) for layer in layers for c in layer.modules() if c is not layer}
        layers = [m for m in layers if id(m) not in inner]
        if not layers:
            raise RuntimeError(f"cannot find the decoder layers of {type(self.model).__name__}")
        return layers
