"""The varlen-aware model wrapper: one forward for packed and padded batches.

``VarlenCausalLM`` holds a transformers causal LM and picks its attention per batch:
- a packed batch (``cu_seqlens`` given) runs the configured packed backend, with ``position_ids``
  restarting per example and no ``attention_mask`` (the boundaries travel as ``cu_seq_lens_*`` kwargs);
- a padded batch (``attention_mask`` given) runs transformers' own SDPA path with the padding mask (eager
  for a family without one, ``padded_attention``).
Each pass an objective can ask for is a method of its own (``VarlenCausalLM``): logits, the summed token loss
(``trainer.loss``: naive or chunked), per-sequence log-probs, or the label positions' hidden states and the head
for an objective's own chunked loss; the router statistic rides along with the token loss where asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from trainer.data.examples import IGNORE_INDEX
from trainer.loss import (
    HeadLoss,
    LabelHidden,
    LogitTransform,
    chunk_tokens_for,
    chunked_token_logps,
    head_matches_logits,
    label_positions,
    liger_available,
    naive_summed_loss,
    naive_token_logps,
    sequence_of_labels,
)
from trainer.model.attention import AttentionBackend
from trainer.model.attention_needs import AttentionNeeds
from trainer.model.packed_layout import packed_attention_kwargs
from trainer.router_aux import RouterAux

PADDED_ATTENTION = "sdpa"
T = TypeVar("T")


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
    """A transformers causal LM that runs packed rows, padded batches and (``layout``) a rank's share of a row
    laid over several ranks (context parallelism). Each pass is its own method, and an objective asks for the
    one it needs:

    - ``forward``: the logits ``[batch, seq, vocab]`` (the self-check's reference, tools);
    - ``token_loss``: the summed token cross-entropy (fp32 scalar), through the loss ``use_loss`` picked;
    - ``sequence_logps``: each sequence's summed label log-probability ``[sequences]`` (preference pairs);
    - ``label_hidden``: ``fn(LabelHidden)`` of the hidden states that predict a label and the head that turns
      them into logits, for an objective's own chunked loss (``trainer.loss.LabelHidden``);
    - ``router_statistics``: the router statistic of a forward's real tokens (``trainer.router_aux``).

    Each runs its loss inside this root module's forward window: ``parallelize`` registers them
    (``FORWARD_METHODS``) with FSDP2, which holds the head's parameters gathered while one runs.
    """

    FORWARD_METHODS = ("token_loss", "sequence_logps", "label_hidden", "router_statistics")
    """The passes besides ``forward`` that FSDP2 must treat as forwards (``register_fsdp_forward_method``)."""

    def __init__(self, model: nn.Module, backend: AttentionBackend) -> None:
        super().__init__()
        self.model = model
        self.backend = backend
        self.padded_attention = padded_attention(model)
        self.loss = HeadLoss()
        """The loss ``token_loss`` runs: naive until ``use_loss`` picks one."""
        self.router_aux: RouterAux | None = None
        """The router aux loss the config asks for (``trainer.router_aux.use_router_aux``); ``None``: none."""
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
        layout=None,
    ) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``."""
        return self.model(**self.inputs(input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask, layout)).logits

    def token_loss(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        layout=None,
        *,
        labels: torch.Tensor,
        router: bool = False,
    ):
        """The summed token loss (fp32 scalar) through the loss implementation ``use_loss`` picked; the trainer
        normalises it by the global label count. With ``router`` (``self.router_aux`` set), ``(that,
        RouterStats of the batch's real tokens)``, from the router logits the decoder records on the same pass."""
        inputs = self.inputs(input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask, layout)
        if self.router_aux is not None:  # recorded only where asked (not in eval, nor a reference's pass)
            inputs["output_router_logits"] = router
        if self.loss.impl == "naive":
            outputs = self.model(**inputs)
            if layout is not None:  # labels already shifted before the row was laid over the ranks
                loss = F.cross_entropy(
                    outputs.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
                )
            else:
                loss = naive_summed_loss(outputs.logits, labels)
        else:
            outputs = decoder_of(self.model)(**inputs)
            head = self.label_head(outputs.last_hidden_state, labels, shifted=layout is not None)
            loss = self.loss(head.hidden, head.weight, head.bias, head.targets)
        if not router:
            return loss
        return loss, self.router_aux.statistics(getattr(outputs, "router_logits", None), attention_mask)

    def sequence_logps(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        """Summed label log-probabilities per sequence (a packed segment or a padded row), fp32 ``[sequences]``:
        the chunked head (``trainer.loss.chunked_token_logps``, never full logits) unless ``loss.impl=naive``."""
        inputs = self.inputs(input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask)
        if self.loss.impl == "naive":
            token_logps = naive_token_logps(self.model(**inputs).logits, labels)
        else:
            head = self.label_head(decoder_of(self.model)(**inputs).last_hidden_state, labels)
            token_logps = chunked_token_logps(
                head.hidden, head.weight, head.bias, head.targets, head.transform, head.chunk_tokens
            )
        sequences = labels.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        out = torch.zeros(sequences, dtype=torch.float32, device=token_logps.device)
        return out.index_add(0, sequence_of_labels(labels, cu_seqlens), token_logps)

    def label_hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        layout=None,
        *,
        labels: torch.Tensor,
        fn: Callable[[LabelHidden], T],
    ) -> T:
        """``fn`` of the hidden states that predict a label and the head that makes their logits (``LabelHidden``),
        run here, inside the forward window, so an objective's chunked loss reads the head's gathered weight.
        ``fn`` returns a tensor or a tuple of tensors (FSDP2 hooks the backward on them)."""
        inputs = self.inputs(input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask, layout)
        return fn(
            self.label_head(decoder_of(self.model)(**inputs).last_hidden_state, labels, shifted=layout is not None)
        )

    def router_statistics(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ):
        """``RouterStats`` of one forward's real tokens (the self-check's one-by-one reference of the router aux
        loss): the decoder's router logits, no loss."""
        inputs = self.inputs(input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask)
        inputs["output_router_logits"] = True
        return self.router_aux.statistics(getattr(self.model(**inputs), "router_logits", None), attention_mask)

    def label_head(self, hidden: torch.Tensor, labels: torch.Tensor, shifted: bool = False) -> LabelHidden:
        """The positions of ``hidden`` that predict a label, their targets and the output head. ``shifted``: the
        labels are already the targets of their own positions (a context-parallel shard): one dummy position after
        the last makes ``label_positions``' shift a no-op. The head reads the label rows in its own dtype, as
        transformers' heads do (Mamba keeps its residual stream in fp32 and casts it to the bf16 head under mixed
        precision); every consumer of the head's input gets it from here."""
        if shifted:
            hidden, labels = F.pad(hidden, (0, 0, 0, 1)), F.pad(labels, (1, 0), value=IGNORE_INDEX)
        hidden, targets = label_positions(hidden, labels)
        head = self.model.get_output_embeddings()
        return LabelHidden(
            hidden.to(head.weight.dtype),
            targets,
            head.weight,
            head.bias,
            self.loss.transform,
            chunk_tokens_for(head.weight.shape[0], self.loss.chunk_tokens),
        )

    def inputs(
        self, input_ids, position_ids, cu_seqlens=None, max_seqlen=None, attention_mask=None, layout=None
    ) -> dict:
        """The transformers call's keyword arguments for the batch: a packed row (``cu_seqlens``), a padded batch
        (``attention_mask``), or one rank's share of a row laid over several ranks (``layout``, the parallel stage's:
        ``trainer.parallel.cp_layout.CPShard``; it names the attention that runs it and what that attention reads;
        its labels are already shifted, each rank's first label predicted by the previous rank's last position)."""
        if layout is not None:
            self.model.config._attn_implementation = layout.implementation
            return dict(input_ids=input_ids, position_ids=position_ids, use_cache=False, **layout.attention_kwargs())
        return self.attention_inputs(input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask)

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
