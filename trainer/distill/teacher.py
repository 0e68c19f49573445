"""The teacher of ``objective=distill``: another model folder, loaded the way the student is, refused in one line
where it cannot be distilled from exactly.

``load_teacher`` builds it through ``trainer.model.build_model`` (so its family and config get the student's
verdicts: a teacher packfsdp cannot pack exactly is refused as a student would be), with a packed attention
backend resolved for its own attention needs, in the master dtype (the startup self-check runs it beside the
student, packed vs each example alone); ``setup`` casts it to the compute dtype and shards it like a frozen
DPO reference. What is refused:

- a tokenizer with another vocabulary than the student's (token -> id): the two distributions would be over
  different tokens;
- another number of output rows (a padded head of another size);
- a head whose logits are not ``transform(hidden @ W.T + b)`` (``VarlenCausalLM.use_loss``'s probe): its head
  runs a chunk at a time beside the student's, never as full logits;
- a context shorter than the longest example the run keeps.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from transformers import PreTrainedTokenizerBase

from trainer.config import ConfigError, JobConfig, ModelConfig, stated_context
from trainer.data.tokenizer import pretrained_tokenizer
from trainer.errors import library_load
from trainer.model import build_model
from trainer.model.wrapper import VarlenCausalLM
from trainer.pipeline import resolve_attention

log = logging.getLogger(__name__)


def teacher_model_config(cfg: JobConfig) -> ModelConfig:
    """The teacher's ``ModelConfig``: ``distill.teacher``'s folder, in the student's master dtype, through the
    student's attention setting."""
    return ModelConfig(name_or_path=cfg.distill.teacher, tokenizer=None, dtype=cfg.model.dtype,
                       attention=cfg.model.attention, trust_remote_code=cfg.model.trust_remote_code)


def check_same_vocabulary(student: PreTrainedTokenizerBase, name: str, trust_remote_code: bool = False) -> None:
    """Refuse a teacher whose tokenizer maps any token to another id than the student's."""
    with library_load(f"distill.teacher={name}'s tokenizer"):
        teacher = pretrained_tokenizer(name, trust_remote_code)
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours == theirs:
        return
    differs = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[0][0]
    raise ConfigError(
        f"distill.teacher={name}: its tokenizer is not the student's ({len(theirs)} tokens vs {len(ours)}; "
        f"{differs!r} is {theirs.get(differs)} there, {ours.get(differs)} here): distillation compares two "
        "distributions over one vocabulary"
    )


def load_teacher(cfg: JobConfig, tokenizer: PreTrainedTokenizerBase, student: VarlenCausalLM,
                 device: torch.device) -> VarlenCausalLM:
    """``distill.teacher`` built, checked against ``student`` (the unsharded model, its loss picked), frozen, in
    eval mode, on ``device``, its chunked head in use."""
    name = cfg.distill.teacher
    if not name:
        raise ConfigError("objective=distill needs a teacher: distill.teacher=DIR_OR_HUB_ID (a model with the "
                          "student's tokenizer)")
    check_same_vocabulary(tokenizer, name, cfg.model.trust_remote_code)
    teacher_cfg = dataclasses.replace(cfg, model=teacher_model_config(cfg))
    backend = resolve_attention(teacher_cfg, device)
    teacher = build_model(teacher_cfg.model, tokenizer, backend, cfg.seed).to(device)
    what = f"distill.teacher={name}"
    rows, student_rows = (m.model.get_output_embeddings().weight.shape[0] for m in (teacher, student))
    if rows != student_rows:
        raise ConfigError(f"{what}: its head has {rows} output rows, the student's {student_rows}: the two "
                          "distributions must be over the same rows")
    context, longest = stated_context(teacher.config), cfg.max_example_length(stated_context(student.config))
    if context and context < longest:
        raise ConfigError(f"{what}: its context is {context} tokens, the run keeps examples of up to {longest} "
                          f"(set data.max_length<={context})")
    loss = teacher.use_loss("chunked", cfg.loss.chunk_tokens)
    if not loss.startswith("chunked"):
        raise ConfigError(f"{what}: {loss.removeprefix('naive (chunked refused: ').rstrip(')')}; distillation runs "
                          "the teacher's head a chunk of tokens at a time and cannot reproduce its logits")
    log.info("teacher %s: attention %s (packed), head chunked", name, backend.name)
    return teacher.requires_grad_(False).eval()
