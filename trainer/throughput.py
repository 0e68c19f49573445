"""What a step cost and what it would have cost padded: padded-equivalent positions, model FLOPs, MFU.

- **Padded-equivalent positions** of a micro-batch: the positions a padded micro-batch of the *same*
  sequences would compute (rows x longest, ``trainer.packing.padded_positions``, the count ``packfsdp
  analyze`` uses too; a preference pair is two rows), counted by the collate on the host
  (``Batch.padded_positions``). A packed run logs it next to ``positions`` so its saving is visible without
  running the baseline; for a padded batch it equals ``positions``.
- **Model FLOPs** count the work on real tokens only (pads are waste, not model work), forward + backward:
  ``6 * N`` per token for the trainable matmul parameters ``N`` (everything but the position table) and
  ``4 * N_frozen`` for frozen ones (a LoRA base: forward and the activation gradient, no weight gradient), plus causal
  attention ``6 * n_layer * d_model * len^2`` per example (QK^T and AV, halved by the causal mask, x3 for
  the backward). MFU divides the achieved rate by the peak of the hardware used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM

from trainer import distributed
from trainer.collate import Batch
from trainer.packing.balance import TokenCost

log = logging.getLogger("trainer")

# Dense bf16 peak TFLOP/s per device (vendor datasheets, no sparsity).
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 70.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,
    "T4": 65.0,
}


@dataclass
class StepCounts:
    """What one optimizer step's micro-batches hold, summed over them (and over ranks by ``all_reduced``)."""

    label_tokens: float
    """Tokens that carry a label (the loss is computed on them)."""
    tokens: float
    """Real tokens, label or not (positions minus pads and filler)."""
    positions: float
    """Positions the model computes, pads and filler included."""
    padded_equivalent_positions: float
    """Positions padded micro-batches of the same examples would compute."""
    sum_squared_lengths: float
    """Sum of squared example lengths (the attention part of the model FLOPs)."""
    units: float = 0.0
    """What the objective divides its summed loss by (``Objective.units``: label tokens, preference pairs)."""

    @classmethod
    def of(cls, batches: list[Batch], units: Callable[[Batch], float] = lambda b: b.num_label_tokens) -> StepCounts:
        """This rank's counts (``units``: what a micro-batch adds to the objective's denominator)."""
        return cls(
            sum(b.num_label_tokens for b in batches),
            sum(b.num_tokens for b in batches),
            sum(b.num_positions for b in batches),
            sum(b.padded_positions for b in batches),
            sum(b.sum_squared_lengths for b in batches),
            sum(units(b) for b in batches),
        )

    def all_reduced(self, device: torch.device) -> StepCounts:
        """The counts summed over all ranks (one collective)."""
        return StepCounts(*distributed.all_reduce_sum(list(astuple(self)), device))


class FlopParams(NamedTuple):
    """What model FLOPs depend on: matmul parameters (all, and the frozen ones), layers, model width."""

    params: int
    frozen: int
    layers: int
    width: int


def flop_params(model: torch.nn.Module) -> FlopParams:
    """The FLOP-relevant sizes of a transformers causal LM (wrapped or not).

    Parameter counts of FSDP2's DTensors are global, so every rank gets the full model's numbers.
    """
    config = model.config
    n_layer = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", 0)
    d_model = getattr(config, "n_embd", None) or getattr(config, "hidden_size", 0)
    n = frozen = 0
    for name, p in model.named_parameters():
        if "wpe" in name or "position_embedding" in name:
            continue  # a table lookup, no matmul
        n += p.numel()
        frozen += 0 if p.requires_grad else p.numel()
    return FlopParams(n, frozen, int(n_layer), int(d_model))


def token_cost(sizes: FlopParams) -> TokenCost:
    """Forward + backward FLOPs per token (matmuls) and per squared example length (causal attention):
    the two numbers ``model_flops`` and the ``packing.balance=flops`` deal both use."""
    matmul = 6.0 * (sizes.params - sizes.frozen) + 4.0 * sizes.frozen
    return TokenCost(per_token=matmul, per_pair=6.0 * sizes.layers * sizes.width)


def model_flops(tokens: float, sum_sq_lengths: float, sizes: FlopParams) -> float:
    """Forward + backward model FLOPs on real tokens (see the module docstring)."""
    cost = token_cost(sizes)
    return cost.per_token * tokens + cost.per_pair * sum_sq_lengths


def config_flop_params(config, trust_remote_code: bool = False) -> FlopParams:
    """``flop_params`` of the model a transformers config builds, without weights: the model is built on the
    meta device (no memory, no init), so every family's own layer shapes are counted, not a formula's guess."""
    with torch.device("meta"):
        return flop_params(AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code))


def peak_tflops(device: torch.device, configured: float | None = None) -> tuple[float, str]:
    """Peak TFLOP/s of one device and where the number comes from; NaN (no MFU) where none is known. A CPU
    has none: vendors publish no peak a run could be held to (it moves with the ISA, the dtype, the cores a
    process gets), and a rate measured on a shared machine can fall below what the run itself achieves."""
    if configured:
        return configured, "configured (logger.peak_tflops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in sorted(GPU_PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])):
            if key in name:
                return value, f"datasheet bf16 dense peak of {name}"
        return float("nan"), f"unknown GPU {name}; logger.peak_tflops sets one"
    return float("nan"), "no peak known for a CPU; logger.peak_tflops sets one"
