"""The MoE router's auxiliary (load-balancing) loss: the term a model's config asks transformers to add to its
loss, trained on packed and padded micro-batches alike (``docs/families.md#moe-auxiliary-loss``).

With ``config.output_router_logits`` true, a transformers MoE causal LM (Mixtral, OLMoE, Qwen2/3-MoE, ...:
every family whose ``*ForCausalLM`` holds a ``router_aux_loss_coef``) trains

    loss = mean token cross-entropy + coef * aux,      aux = E * sum_e f_e * P_e

``f_e``: the share of top-k assignments that went to expert ``e``; ``P_e``: the mean router probability of
``e``; both over every real token and every MoE layer of the batch (the router logits the decoder records,
one ``[tokens, E]`` tensor per MoE layer; pads masked out with the attention mask): Switch Transformer's
load-balancing loss, as every decoder-only family's ``load_balancing_loss_func`` computes it (transformers
5.17 to 5.25; no decoder-only family has a router z-loss). ``f`` carries no gradient (a top-k count), so
once the counts are known ``aux`` is linear in the summed probabilities: the statistic of a union of tokens
is their ``RouterStats`` added up, and its gradient can be taken one example at a time with the union's
counts (what the startup self-check's reference does).

packfsdp takes the same statistic from the router logits the decoder returns on the run's own path
(``VarlenCausalLM.token_loss(..., router=True)``: the naive or the chunked loss, a packed row or a padded
batch) over each micro-batch's real tokens, and the step trains

    sum_m token_loss_m / labels  +  coef * sum_m (tokens_m / tokens) * aux_m

over the micro-batches ``m`` of the step on every rank (``labels``, ``tokens``: the step's label and real
tokens, all-reduced). On one micro-batch that is transformers' own ``outputs.loss``; over several, each
micro-batch's statistic weighs by its share of the step's real tokens (a filler micro-batch weighs nothing),
so micro-batches of equal size average equally, as Megatron's per-micro-batch aux does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
import transformers
from torch import nn

from trainer import distributed
from trainer.errors import ConfigError

log = logging.getLogger(__name__)

COEF_ATTRIBUTES = ("router_aux_loss_coef", "aux_loss_coef")
"""Where a transformers ``*ForCausalLM`` keeps the coefficient its forward multiplies the aux loss by (JetMoE:
``aux_loss_coef``); a causal LM with neither adds no aux loss (DeepSeek-V3, Llama 4, ...: they record router
logits, and train nothing from them)."""
UNTRAINED_LOSSES = ("z_loss_coefficient", "router_z_loss_coef")
"""Config fields of other auxiliary losses transformers adds in a ``*ForCausalLM.forward`` that packfsdp does
not train (Bamba's z-loss on the logits of every position): refused when non-zero, never dropped silently."""


class NoRouterLogits(RuntimeError):
    """The decoder returned no router logits where they were asked for."""


class RouterStats(NamedTuple):
    """What the load-balancing loss needs of a set of tokens; additive over disjoint sets of tokens."""

    counts: torch.Tensor
    """``[E]`` fp32: top-k assignments per expert, summed over the tokens and MoE layers (no gradient)."""
    probs: torch.Tensor
    """``[E]`` fp32: router probabilities per expert, summed over the same (differentiable)."""
    rows: torch.Tensor
    """Scalar fp32: tokens x MoE layers."""

    def balance_loss(self) -> torch.Tensor:
        """``E * sum_e f_e * P_e`` with ``f = counts / rows`` and ``P = probs / rows`` (transformers' aux)."""
        return self.with_counts_of(self)

    def with_counts_of(self, total: RouterStats) -> torch.Tensor:
        """This part's share of ``total.balance_loss()``, whose counts are fixed: the shares of disjoint parts sum
        to it, and so do their gradients (the counts carry none)."""
        rows = total.rows.clamp_min(1.0)
        return total.counts.numel() * torch.sum((total.counts / rows) * (self.probs / rows))

    @staticmethod
    def merged(parts: list[RouterStats]) -> RouterStats:
        """The statistics of the union of ``parts`` (disjoint token sets)."""
        return RouterStats(*(torch.stack(list(field)).sum(0) for field in zip(*parts, strict=True)))


@dataclass(frozen=True)
class RouterAux:
    """The load-balancing loss a model's config asks for: its coefficient, expert count and top-k, read from the
    built ``*ForCausalLM`` (the attributes its own forward passes to ``load_balancing_loss_func``)."""

    coef: float
    num_experts: int
    top_k: int

    def describe(self) -> str:
        return f"{self.coef:g} x load-balancing loss ({self.num_experts} experts, top-{self.top_k})"

    @staticmethod
    def step_share(stats: RouterStats, tokens: float, step_tokens: float) -> torch.Tensor:
        """A micro-batch's part of the step's aux loss: its statistic weighed by its share of the step's real
        tokens (``tokens`` of ``step_tokens``, all micro-batches and ranks)."""
        return stats.balance_loss() * (tokens / max(step_tokens, 1.0))

    def statistics(
        self,
        router_logits: tuple[torch.Tensor, ...] | None,
        attention_mask: torch.Tensor | None,
    ) -> RouterStats:
        """``RouterStats`` of the real tokens from the router logits the decoder recorded (one tensor per MoE
        layer, its rows the batch's positions in order): every position of a packed row, the positions a padded
        batch's ``attention_mask`` marks. Probabilities in fp32."""
        if not router_logits:
            raise NoRouterLogits("the decoder returned no router logits (output_router_logits was not honoured)")
        device = router_logits[0].device
        mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        probs = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        rows = torch.zeros((), dtype=torch.float32, device=device)
        for layer in router_logits:
            p = torch.softmax(layer.reshape(-1, self.num_experts).float(), dim=-1)
            weight = torch.ones(p.shape[0], device=device) if mask is None else mask
            if weight.numel() != p.shape[0]:
                raise RuntimeError(f"router logits of {p.shape[0]} rows for a batch of {weight.numel()} positions")
            chosen = torch.topk(p.detach(), self.top_k, dim=-1).indices.reshape(-1)
            counts = counts.index_add(0, chosen, weight.repeat_interleave(self.top_k))
            probs = probs + (p * weight[:, None]).sum(0)
            rows = rows + weight.sum()
        return RouterStats(counts, probs, rows)


def refuse_untrained_losses(config) -> None:
    """A non-zero auxiliary-loss setting packfsdp does not train is refused in one line (``UNTRAINED_LOSSES``)."""
    for name in UNTRAINED_LOSSES:
        if getattr(config, name, None):
            raise ConfigError(
                f"{name}={getattr(config, name)} ({config.model_type}'s auxiliary loss on the logits of every "
                f"position): packfsdp does not train it; set model.config_overrides.{name}=0"
            )


def router_aux_of(model: nn.Module) -> RouterAux | None:
    """What ``model`` (a transformers ``*ForCausalLM``) trains besides the token loss in transformers' own
    forward, from its config and the built object: ``None`` when it trains nothing more, saying so once
    where the config names a router loss that does not apply."""
    config = model.config
    refuse_untrained_losses(config)
    coef_name = next((name for name in COEF_ATTRIBUTES if hasattr(model, name)), None)
    asked = bool(getattr(config, "output_router_logits", False))
    if coef_name is None:
        if asked:
            log.warning(
                "output_router_logits=true: transformers' %s adds no auxiliary loss to its loss, so neither "
                "does packfsdp (nothing extra is trained)",
                type(model).__name__,
            )
        return None
    coef = float(getattr(model, coef_name) or 0.0)
    if not asked:
        if coef:
            log.info(
                "router aux loss: off (%s=%g applies only with output_router_logits=true, as in transformers)",
                coef_name,
                coef,
            )
        return None
    return RouterAux(coef, int(model.num_experts), int(model.num_experts_per_tok))


class RouterAuxTerm:
    """The router aux loss as an additive term of an objective's step (``trainer.objectives.sft`` carries it): each
    micro-batch adds ``coef x`` its share of the step's aux loss (``RouterAux.step_share``, by its part of the
    step's real tokens) to what backward runs, and the step logs the aux loss apart from the token loss."""

    def __init__(self, aux: RouterAux) -> None:
        self.aux = aux
        self.aux_sum: torch.Tensor | None = None
        """The step's aux shares so far on this rank (detached)."""

    def share(self, stats: RouterStats, tokens: float, step_tokens: float) -> torch.Tensor:
        """``coef x`` a micro-batch's share of the step's aux loss (``tokens`` of the step's ``step_tokens``)."""
        share = self.aux.step_share(stats, tokens, step_tokens)
        self.aux_sum = share.detach() if self.aux_sum is None else self.aux_sum + share.detach()
        return self.aux.coef * share

    def step_metrics(self, token_loss: float, device: torch.device) -> dict[str, float]:
        """The step's aux loss over every rank (one all-reduce): ``loss`` (what was trained: ``token_loss + coef x
        aux``), ``token_loss`` and ``aux_loss``; the next step starts from 0."""
        local = 0.0 if self.aux_sum is None else self.aux_sum.item()
        self.aux_sum = None
        aux = distributed.all_reduce_sum([local], device)[0]
        return {"loss": token_loss + self.aux.coef * aux, "token_loss": token_loss, "aux_loss": aux}


def use_router_aux(model: nn.Module, cp: int, objective: str) -> RouterAux | None:
    """Set ``model`` (a ``VarlenCausalLM``, unsharded) to return its router statistics where asked, and return
    what the step adds (``None``: nothing). Refused in one line where packfsdp cannot train it exactly; a tiny
    probe checks that the decoder returns router logits on the run's path."""
    aux = router_aux_of(model.model)
    if aux is None:
        return None
    what = f"output_router_logits=true ({type(model.model).__name__}'s router aux loss)"
    if cp > 1:
        raise ConfigError(
            f"{what} with parallel.cp={cp}: a row's load-balancing statistic spans its context-parallel "
            "shards, which packfsdp does not gather; use parallel.cp=1 or output_router_logits=false"
        )
    if objective != "sft":
        raise ConfigError(
            f"{what} with objective={objective}: packfsdp adds the router aux loss to the token loss "
            "only; set model.config_overrides.output_router_logits=false"
        )
    model.router_aux = aux
    if not probe_router_logits(model):
        model.router_aux = None
        raise ConfigError(
            f"{what}: {model.config.model_type}'s decoder records no router logits on transformers "
            f"{transformers.__version__}, so the aux loss cannot be computed; "
            "set output_router_logits=false"
        )
    if aux.coef == 0:
        log.warning("%s with coefficient 0: the load-balancing loss is logged, not trained", what)
    else:
        log.info("router aux loss: %s of each micro-batch's real tokens, added to the objective", aux.describe())
    return aux


@torch.no_grad()
def probe_router_logits(model: nn.Module, tokens: int = 8) -> bool:
    """Does ``model`` (a ``VarlenCausalLM``) return router statistics of every token through its loss path?"""
    device = model.model.get_output_embeddings().weight.device
    positions = torch.arange(tokens, device=device)[None]
    ids = positions % model.config.vocab_size
    was_training = model.training
    model.eval()
    try:
        _, stats = model.token_loss(ids, positions, attention_mask=torch.ones_like(ids), labels=ids, router=True)
    except NoRouterLogits:
        return False
    finally:
        model.train(was_training)
    return bool(stats.rows > 0) and float(stats.counts.sum()) == float(stats.rows) * model.router_aux.top_k
