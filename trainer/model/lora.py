"""LoRA through the ``peft`` library, under FSDP2 and the varlen wrapper.

``apply_peft`` injects ``peft``'s LoRA layers *in place* into the transformers model the wrapper holds
(``peft.inject_adapter_in_model``), rather than wrapping it in a ``PeftModel``: parameter names keep their
transformers paths (plus ``.base_layer`` / ``.lora_A.default`` where an adapter sits), ``model.base_model``
and ``get_output_embeddings()`` keep their transformers meaning, the packed kwargs (``cu_seq_lens_*``)
reach attention untouched, and ``decoder_layers()`` finds the same blocks, so FSDP2 shards each block's
frozen weights and its adapters together (one group, mixed ``requires_grad``; frozen weights get no
gradient and no reduce-scatter). A ``PeftModel`` is built only by the exporter, to write ``peft``'s format.

The base model is not checkpointed: it comes back from ``model.name_or_path`` or from the seeded random
init. ``hf/lora_base.json`` in each checkpoint records where it came from and a SHA-256 of its weights, so
export rebuilds exactly that base or refuses.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from trainer.config import ConfigError, ModelConfig, PeftConfig
from trainer.model.loading import DTYPES
from trainer.model.multimodal import MULTIMODAL_DIR, is_multimodal_checkpoint
from trainer.model.multimodal import load as load_multimodal
from trainer.model.wrapper import VarlenCausalLM

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
"""``peft``'s name for the adapter's config, saved in a checkpoint's ``hf/`` folder."""
LORA_BASE = "lora_base.json"
"""Where the frozen base of a LoRA checkpoint comes from (``LoraBase``), next to ``ADAPTER_CONFIG``."""
ADAPTER_NAME = "default"
TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Checkpoints skip frozen parameters (a LoRA run's base model): they come back from where it was built.
Loading is not strict, as the frozen keys are missing on purpose; the trainable ones cannot be, as DCP's
load fails on any key of the model's state dict that a checkpoint lacks."""


@dataclass
class LoraBase:
    """How to rebuild the frozen base model a LoRA checkpoint's adapters belong to."""

    name_or_path: str | None
    """Pretrained weights, or ``None`` for a random init from ``hf/config.json`` under ``seed``."""
    seed: int
    dtype: str
    sha256: str
    """Of the base weights before the adapters were injected (``base_fingerprint``)."""


def base_fingerprint(model: nn.Module) -> str:
    """SHA-256 over the names and bytes of every tensor of ``model``'s state dict, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def lora_config(cfg: PeftConfig, model: nn.Module):
    """``peft``'s ``LoraConfig`` for ``cfg`` (``fan_in_fan_out`` for GPT-2's transposed ``Conv1D`` layers)."""
    from peft import LoraConfig  # noqa: PLC0415 -- peft is optional (the lora extra): only LoRA runs get here

    targets = cfg.target_modules
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules="all-linear" if list(targets) == ["all-linear"] else list(targets),
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
        bias="none",
    )


def apply_peft(model: VarlenCausalLM, cfg: PeftConfig, model_cfg: ModelConfig, seed: int) -> VarlenCausalLM:
    """Freeze ``model`` and inject LoRA adapters (``cfg.method == "lora"``); unchanged for ``none``.

    Call it after ``build_model`` (the adapters' random init then follows the seeded base init, identical
    on every rank) and before ``parallelize``. ``cfg.modules_to_save`` are unfrozen in place and trained
    fully.
    """
    if not cfg.enabled:
        return model
    from peft import inject_adapter_in_model  # noqa: PLC0415 -- peft is optional (the lora extra): only LoRA runs get here

    hf_model = model.model
    model.lora_base = LoraBase(model_cfg.name_or_path, seed, model_cfg.dtype, base_fingerprint(hf_model))
    try:
        inject_adapter_in_model(lora_config(cfg, hf_model), hf_model, adapter_name=ADAPTER_NAME)
    except ValueError as e:  # peft names the target modules it could not find
        raise ConfigError(f"peft.target_modules={list(cfg.target_modules)}: {e}") from None
    unfreeze(hf_model, cfg.modules_to_save)
    log_trainable(model)
    return model


def unfreeze(model: nn.Module, names: list[str]) -> None:
    """Train the modules named (or ending in) ``names`` fully; an unknown name is a config error."""
    for wanted in names:
        found = [m for path, m in model.named_modules() if path == wanted or path.endswith(f".{wanted}")]
        if not found:
            raise ConfigError(f"peft.modules_to_save: {type(model).__name__} has no module {wanted!r}")
        for module in found:
            module.requires_grad_(True)


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights counted once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def log_trainable(model: nn.Module) -> None:
    trainable, total = trainable_counts(model)
    log.info(
        "LoRA: %d trainable parameters of %d (%.3f%%); the base model is frozen",
        trainable,
        total,
        100 * trainable / max(total, 1),
    )


def save_lora_assets(model: nn.Module, directory: Path) -> None:
    """A LoRA model's ``adapter_config.json`` (``peft``'s) and ``lora_base.json`` in a checkpoint's ``hf/``."""
    base = getattr(model, "lora_base", None)
    if base is None:
        return
    config = model.model.peft_config[ADAPTER_NAME]
    config.base_model_name_or_path = base.name_or_path
    config.save_pretrained(str(directory))
    (directory / LORA_BASE).write_text(json.dumps(asdict(base), indent=1) + "\n")


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict without frozen parameters, tied aliases of them included (a LoRA run's
    checkpoint holds adapters, not GPT-2's or Qwen's frozen tied embedding under its ``lm_head`` name)."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in get_model_state_dict(model, options=TRAINABLE_ONLY).items() if k not in frozen}


def base_mismatch(model: nn.Module, hf_dir: Path) -> str | None:
    """Why the checkpoint in ``hf_dir`` cannot resume ``model`` (LoRA on another base, or LoRA vs full
    fine-tuning), or ``None``."""
    base = getattr(model, "lora_base", None)
    saved = json.loads((hf_dir / LORA_BASE).read_text()) if is_lora_checkpoint(hf_dir) else None
    if (base is None) != (saved is None):
        return "it was saved by a " + ("full fine-tuning" if saved is None else "LoRA") + " run; this run is not one"
    if base is not None and saved["sha256"] != base.sha256:
        return "its LoRA adapters were trained on another base model (the weights' SHA-256 differs)"
    return None


def is_lora_checkpoint(hf_dir: Path) -> bool:
    return (hf_dir / LORA_BASE).is_file()


def rebuild_base(hf_dir: Path, attn_implementation: str | None = None) -> nn.Module:
    """The frozen base model of a LoRA checkpoint, verified against its recorded SHA-256."""
    base = LoraBase(**json.loads((hf_dir / LORA_BASE).read_text()))
    config = AutoConfig.from_pretrained(hf_dir)
    torch.manual_seed(base.seed)  # as build_model: the random init (and any resized rows) follow the seed
    if base.name_or_path and is_multimodal_checkpoint(hf_dir):  # the language model of the multimodal model there
        whole = AutoConfig.from_pretrained(hf_dir / MULTIMODAL_DIR)
        model, _ = load_multimodal(
            base.name_or_path,
            whole,
            dtype=DTYPES[base.dtype],
            weights_only=True,
            attn_implementation=attn_implementation,
        )
    elif base.name_or_path:
        model = AutoModelForCausalLM.from_pretrained(
            base.name_or_path,
            config=config,
            dtype=DTYPES[base.dtype],
            weights_only=True,
            attn_implementation=attn_implementation,
        )
    else:
        model = AutoModelForCausalLM.from_config(
            config, dtype=DTYPES[base.dtype], attn_implementation=attn_implementation
        )
    if base_fingerprint(model) != base.sha256:
        where = base.name_or_path or f"a random init under seed {base.seed}"
        raise ValueError(f"the base model rebuilt from {where} is not the one the adapters were trained on")
    return model


def peft_model_with(base: nn.Module, hf_dir: Path, trained: dict[str, torch.Tensor], modules_to_save: bool):
    """A ``PeftModel`` over ``base`` holding the ``trained`` tensors (keys as the trainer names them in the
    transformers model). ``modules_to_save=False`` loads fully trained modules into the base itself (for
    merging); ``True`` wraps them as ``peft``'s ``modules_to_save`` (for the adapter format)."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 -- peft is optional (the lora extra): only LoRA runs get here

    config = LoraConfig.from_pretrained(str(hf_dir))
    full = sorted({key.rsplit(".", 1)[0] for key in trained if ".lora_" not in key})
    config.modules_to_save = full if modules_to_save and full else None
    model = get_peft_model(base, config, adapter_name=ADAPTER_NAME)
    target = model.base_model.model
    names = set(target.state_dict())

    def peft_key(key: str) -> str:
        module, _, param = key.rpartition(".")
        wrapped = f"{module}.modules_to_save.{ADAPTER_NAME}.{param}"
        return wrapped if modules_to_save and wrapped in names else key

    tensors = {peft_key(k): v for k, v in trained.items()}
    unexpected = sorted(set(tensors) - names)
    if unexpected:
        raise ValueError(f"the checkpoint's adapters do not fit the base model: {unexpected[:5]}")
    # load_state_dict copies into the existing parameters, in their dtype (the base's).
    target.load_state_dict(tensors, strict=False)
    return model
