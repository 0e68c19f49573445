"""Multimodal checkpoints fine-tuned on text: the language model trained as the causal LM of its text family.

A folder of a multimodal family (Gemma 3/4, Llama 4, Qwen3.5, Mistral 3, LLaVA, ...: a language model, a
vision or audio tower and a projector; ``trainer.model_config.language_model_config`` tells it from its
config) is loaded whole, with the class transformers' multimodal-LM mapping gives its config (the one its
``config.json`` names), then split (``split``):

- the language model becomes the causal LM of the text config's family (``Gemma3ForCausalLM`` for
  ``gemma3_text``) built around the multimodal model's own decoder and LM head modules, not copies of them
  (``language_model_of``). It is what the trainer holds: the same family table, config verdict, self-check,
  packed path, FSDP units, optimizer and checkpoint as a text-only model of that family;
- everything else (the vision or audio tower, the projector) is left out of the step: never run, never
  sharded, never in the optimizer. Rank 0 keeps its tensors on the CPU (``KeptParts``) and writes them into
  each checkpoint (``hf/multimodal/``: the whole model's config, these tensors, the folder's processor
  files), so that ``packfsdp export`` writes the input's architecture back (``rebuild``): the kept tensors
  as they were loaded, the trained language model under the multimodal model's own parameter names.

The split is checked on what it gives, not assumed from the family: the language model's logits on a short
text must equal the whole model's (``language_model_mismatch``), or the folder is refused in one line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForMultimodalLM, GenerationConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MULTIMODAL_LM_MAPPING
from transformers.utils import (
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_NAME,
    IMAGE_PROCESSOR_NAME,
    LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE,
    PROCESSOR_NAME,
    VIDEO_PROCESSOR_NAME,
    cached_file,
)

from trainer import distributed
from trainer.config import ConfigError
from trainer.errors import first_line
from trainer.loss import head_matches_logits
from trainer.model_config import language_model_config

log = logging.getLogger(__name__)

MULTIMODAL_DIR = "multimodal"
"""In a checkpoint's ``hf/``: the whole model's ``config.json``, ``FROZEN_WEIGHTS`` and the folder's
``CARRIED_FILES``."""
FROZEN_WEIGHTS = "frozen.safetensors"
"""The tensors left out of the step, under the multimodal model's names."""
CARRIED_FILES = (
    PROCESSOR_NAME,
    IMAGE_PROCESSOR_NAME,
    VIDEO_PROCESSOR_NAME,
    CHAT_TEMPLATE_FILE,
    LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_NAME,
)
"""The folder's files that serving it needs besides the weights, config and tokenizer (the processor's, the
chat template, the generation settings), copied into the checkpoint and the export as they were."""


class MultimodalError(ConfigError):
    """A multimodal folder whose language model cannot be trained as its text family."""


@dataclass
class KeptParts:
    """What a run on a multimodal model's language model keeps for export."""

    config: PretrainedConfig
    """The whole model's config (its text config is the trained model's, the same object)."""
    frozen: dict[str, torch.Tensor] | None
    """The tensors left out of the step, by their names in the whole model; rank 0 only (``None`` elsewhere:
    only rank 0 writes them into a checkpoint)."""
    files: dict[str, bytes]
    """``CARRIED_FILES`` the folder has."""


def multimodal_class(config: PretrainedConfig) -> type[nn.Module]:
    """The transformers class of a multimodal model (its multimodal-LM auto mapping's)."""
    return MODEL_FOR_MULTIMODAL_LM_MAPPING[type(config)]


def load(source: str, config: PretrainedConfig, **kwargs) -> tuple[nn.Module, KeptParts]:
    """The language model of the multimodal model in ``source`` (loaded with ``config`` and ``kwargs``, as
    ``from_pretrained`` takes them) and the parts kept for export."""
    cls = multimodal_class(config)
    stated = getattr(config, "architectures", None) or [cls.__name__]
    if cls.__name__ not in stated:
        raise MultimodalError(
            f"{source} holds a {', '.join(stated)}; packfsdp trains the language model of a {cls.__name__} "
            "(the class export writes back) only"
        )
    whole = AutoModelForMultimodalLM.from_pretrained(source, config=config, **kwargs)
    model, frozen = split(whole)
    files = {}
    for name in CARRIED_FILES:
        if path := cached_file(source, name, _raise_exceptions_for_missing_entries=False):
            files[name] = Path(path).read_bytes()
    kept = KeptParts(whole.config, unaliased(frozen) if distributed.rank() == 0 else None, files)
    log.info(
        "%s: %s; training its language model as %s (%.2fM parameters); left out of the step, frozen and written "
        "back by export: %s (%.2fM parameters)",
        source,
        cls.__name__,
        type(model).__name__,
        sum(p.numel() for p in model.parameters()) / 1e6,
        ", ".join(frozen_modules(whole, model)),
        sum(t.numel() for t in frozen.values()) / 1e6,
    )
    return model, kept


def unaliased(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` detached, those sharing storage with an earlier one copied (safetensors stores no alias;
    a tie is made again when the model is rebuilt, ``tie_weights``)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.detach().clone() if ptr in seen else tensor.detach()
        seen.add(ptr)
    return out


def frozen_modules(whole: nn.Module, model: nn.Module) -> list[str]:
    """The outermost modules of ``whole`` that hold none of ``model``'s tensors (``model.vision_tower``,
    ``model.multi_modal_projector``, ...)."""
    held = {id(t) for t in chain(model.parameters(), model.buffers())}
    shared = {
        prefix for name, t in whole.state_dict(keep_vars=True).items() if id(t) in held for prefix in _prefixes(name)
    }
    return sorted(
        {
            next(p for p in _prefixes(name) if p not in shared)
            for name, t in whole.state_dict(keep_vars=True).items()
            if id(t) not in held
        }
    )


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts) + 1)]


def split(whole: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``whole``'s language model (``language_model_of``), checked against ``whole`` on a short text
    (``language_model_mismatch``), and the tensors of ``whole``'s state dict it does not hold (vision or
    audio tower, projector), by name."""
    model = language_model_of(whole)
    if mismatch := language_model_mismatch(whole, model):
        raise MultimodalError(mismatch)
    held = {id(t) for t in chain(model.parameters(), model.buffers())}
    frozen = {k: t for k, t in whole.state_dict(keep_vars=True).items() if id(t) not in held}
    for tensor in frozen.values():
        tensor.requires_grad_(False)
    return model, frozen


def language_model_of(whole: nn.Module) -> nn.Module:
    """The causal LM of ``whole``'s text family holding ``whole``'s own decoder and LM head modules (shared,
    never copied): the module ``whole`` already holds where it has one (Llama 4), else one built on the meta
    device around ``whole.get_decoder()`` and ``whole.get_output_embeddings()``, with the decoder's config."""
    text_config = language_model_config(whole.config)
    if text_config is None:
        raise MultimodalError(
            f"{type(whole).__name__} is not a multimodal model with a language model packfsdp can train"
        )
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)]
    for module in whole.modules():
        if type(module) is cls:
            return module
    decoder, head = whole.get_decoder(), whole.get_output_embeddings()
    with torch.device("meta"):
        model = cls(text_config)
    prefix = model.base_model_prefix
    if type(getattr(model, prefix, None)) is not type(decoder) or type(model.get_output_embeddings()) is not type(head):
        raise MultimodalError(
            f"{type(whole).__name__}'s language model is not a {cls.__name__}'s: its decoder is a "
            f"{type(decoder).__name__}, its head a {type(head).__name__}"
        )
    setattr(model, prefix, decoder)
    model.set_output_embeddings(head)
    model.config = decoder.config  # one config object: the attention the trainer selects reaches the layers
    whole_tensors = {id(t) for t in chain(whole.parameters(), whole.buffers())}
    if left := [
        name for name, t in chain(model.named_parameters(), model.named_buffers()) if id(t) not in whole_tensors
    ]:
        raise MultimodalError(f"{cls.__name__} has weights {type(whole).__name__} does not: {', '.join(left[:3])}")
    return model


@torch.no_grad()
def language_model_mismatch(whole: nn.Module, model: nn.Module, tokens: int = 8) -> str | None:
    """Why ``model`` (``language_model_of(whole)``) does not compute what ``whole`` computes on a text-only
    input, or ``None``: their logits on ``tokens`` ordinary tokens (none of the config's special token ids),
    to the dtype's precision (``head_matches_logits``)."""
    special = {
        v for k, v in whole.config.to_dict().items() if k.endswith(("token_id", "token_index")) and isinstance(v, int)
    }
    vocab = model.get_input_embeddings().num_embeddings
    ids = [i for i in range(3, vocab) if i not in special][:tokens]
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    was_training = whole.training
    whole.eval()
    try:
        reference = whole(input_ids=input_ids, use_cache=False).logits
        ours = model(input_ids=input_ids, use_cache=False).logits
    except Exception as e:  # noqa: BLE001 -- a model that cannot run text alone: refused in one line, with why
        return f"{type(whole).__name__} cannot run a text-only input ({type(e).__name__}: {first_line(e)})"
    finally:
        whole.train(was_training)
    if reference.shape == ours.shape and head_matches_logits(reference, ours):
        return None
    gap = (reference.float() - ours.float()).abs().max() if reference.shape == ours.shape else float("nan")
    return (
        f"{type(whole).__name__} computes text otherwise than its language model as {type(model).__name__} "
        f"(max |logit difference| {gap:.3g} on a text-only input): packfsdp cannot train it as its text family"
    )


def save_multimodal_assets(model: nn.Module, directory: Path, redact=lambda tree: tree) -> None:
    """A multimodal run's kept parts (``KeptParts``, ``model.multimodal``) in a checkpoint's ``hf/``, where
    ``rebuild`` reads them; nothing for any other model. ``redact`` cleans the config's fields (secrets)."""
    kept: KeptParts | None = getattr(model, "multimodal", None)
    if kept is None:
        return
    if kept.frozen is None:
        raise RuntimeError("only rank 0 keeps a multimodal model's frozen parts: save them there")
    out = directory / MULTIMODAL_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(redact(kept.config.to_dict()), indent=2, sort_keys=True) + "\n")
    save_file({k: t.contiguous() for k, t in kept.frozen.items()}, str(out / FROZEN_WEIGHTS))
    for name, data in kept.files.items():
        (out / name).write_bytes(data)


def is_multimodal_checkpoint(hf_dir: Path) -> bool:
    return (hf_dir / MULTIMODAL_DIR / "config.json").is_file()


def rebuild(hf_dir: Path, attn_implementation: str | None = None) -> tuple[nn.Module, nn.Module]:
    """The multimodal model a checkpoint's language model belongs to, from ``hf/multimodal/``: built from
    its config with the kept tensors in place, and its language model (``language_model_of``; shared
    modules) to load the trained weights into. Returns (whole, language model)."""
    folder = hf_dir / MULTIMODAL_DIR
    config = AutoConfig.from_pretrained(folder)
    config.get_text_config(decoder=True).use_cache = True  # training turned the KV cache off; generation wants it
    whole = AutoModelForMultimodalLM.from_config(config, attn_implementation=attn_implementation)
    if (folder / GENERATION_CONFIG_NAME).is_file():  # the folder's generation settings, not defaults from the config
        whole.generation_config = GenerationConfig.from_pretrained(folder)
    model = language_model_of(whole)
    missing, unexpected = whole.load_state_dict(load_file(str(folder / FROZEN_WEIGHTS)), strict=False, assign=True)
    held = {id(t) for t in chain(model.parameters(), model.buffers())}
    state = whole.state_dict(keep_vars=True)
    if lost := [k for k in missing if id(state[k]) not in held] + unexpected:
        raise ValueError(f"the kept weights do not fit {type(whole).__name__}: {', '.join(lost[:5])}")
    return whole, model


def carried_files(hf_dir: Path) -> list[Path]:
    """The folder's ``CARRIED_FILES`` a multimodal checkpoint holds."""
    return [hf_dir / MULTIMODAL_DIR / name for name in CARRIED_FILES if (hf_dir / MULTIMODAL_DIR / name).is_file()]


__all__ = [
    "CARRIED_FILES",
    "FROZEN_WEIGHTS",
    "MULTIMODAL_DIR",
    "KeptParts",
    "MultimodalError",
    "carried_files",
    "is_multimodal_checkpoint",
    "language_model_mismatch",
    "language_model_of",
    "load",
    "rebuild",
    "save_multimodal_assets",
    "split",
    "unaliased",
]
