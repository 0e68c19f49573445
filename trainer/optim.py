"""Optimizer and learning-rate schedule (linear warmup, then cosine to ``lr * min_lr_ratio``)."""

from __future__ import annotations

import math

import torch
from hydra.utils import instantiate
from torch import nn

from trainer.config import ConfigError, OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Weight decay on every parameter of 2 or more dimensions (matrices and embedding tables, position
    embeddings included, as nanoGPT and torchtitan do), none on biases and norm weights.

    Only trainable parameters are handed over: a LoRA run's frozen base gets no optimizer state.
    ``cfg.optimizer`` is instantiated as given: its ``_target_`` was checked against the allowlist by
    ``trainer.compose.to_job_config`` (``trainer.safety``), before anything was built.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError("the model has no trainable parameter (peft.target_modules matched nothing to train?)")
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return instantiate(cfg.optimizer, params=groups, lr=cfg.lr, _convert_="all")


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at ``step`` (0-based): linear warmup, then cosine decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )
