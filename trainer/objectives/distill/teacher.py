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

import logging
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from trainer.collate import Batch
from trainer.config import LOCAL_PATH_PREFIXES, ConfigError, JobConfig, ModelConfig, stated_context
from trainer.data.tokenizer import pretrained_tokenizer
from trainer.library_log import library_load
from trainer.model import DTYPES, AttentionNeeds, build_model, resolve_backend
from trainer.model.wrapper import VarlenCausalLM
from trainer.model_config import model_config
from trainer.objectives.distill.loss import HeadTeacher
from trainer.objectives.distill.topk import top_k_rows

log = logging.getLogger(__name__)


def teacher_model_config(cfg: JobConfig) -> ModelConfig:
    """The teacher's ``ModelConfig``: ``distill.teacher``'s folder, in the student's master dtype, through the
    student's attention setting."""
    return ModelConfig(
        name_or_path=cfg.distill.teacher,
        tokenizer=None,
        dtype=cfg.model.dtype,
        attention=cfg.model.attention,
        trust_remote_code=cfg.model.trust_remote_code,
    )


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


def load_teacher(
    cfg: JobConfig, tokenizer: PreTrainedTokenizerBase, student: VarlenCausalLM, device: torch.device
) -> VarlenCausalLM:
    """``distill.teacher`` built, checked against ``student`` (the unsharded model, its loss picked), frozen, in
    eval mode, on ``device``, its chunked head in use."""
    name = cfg.distill.teacher  # set: DistillConfig.check_job
    if name.startswith(LOCAL_PATH_PREFIXES) and not Path(name).expanduser().is_dir():
        raise ConfigError(
            f"distill.teacher={name}: no such folder; train and export the teacher first (a recipe "
            "that names one gives the command on its first line; docs/distill.md)"
        )
    check_same_vocabulary(tokenizer, name, cfg.model.trust_remote_code)
    model_cfg = teacher_model_config(cfg)
    with library_load(f"distill.teacher={name}"):  # what its attention needs: the backend for it (as the student's)
        needs = AttentionNeeds.of(model_config(model_cfg))
    backend = resolve_backend(model_cfg.attention, device, DTYPES[cfg.parallel.param_dtype], needs=needs)
    teacher = build_model(model_cfg, tokenizer, backend, cfg.seed).to(device)
    what = f"distill.teacher={name}"
    rows, student_rows = (m.model.get_output_embeddings().weight.shape[0] for m in (teacher, student))
    if rows != student_rows:
        raise ConfigError(
            f"{what}: its head has {rows} output rows, the student's {student_rows}: the two "
            "distributions must be over the same rows"
        )
    context, longest = stated_context(teacher.config), cfg.max_example_length(stated_context(student.config))
    if context and context < longest:
        raise ConfigError(
            f"{what}: its context is {context} tokens, the run keeps examples of up to {longest} "
            f"(set data.max_length<={context})"
        )
    loss = teacher.use_loss("chunked", cfg.loss.chunk_tokens)
    if not loss.startswith("chunked"):
        raise ConfigError(
            f"{what}: {loss.removeprefix('naive (chunked refused: ').rstrip(')')}; distillation runs "
            "the teacher's head a chunk of tokens at a time and cannot reproduce its logits"
        )
    log.info("teacher %s: attention %s (packed), head chunked", name, backend.name)
    return teacher.requires_grad_(False).eval()


def live_teacher(teacher: torch.nn.Module, batch: Batch, temperature: float) -> HeadTeacher:
    """The teacher's label positions of ``batch`` and its head (no grad): its own pass over the same layout. Under
    FSDP2 its root (the head) stays gathered after the pass (``set_reshard_after_forward(False)`` on the root) until
    the caller reshards it, after the student's loss."""
    with torch.no_grad():
        head = teacher.label_hidden(**batch.model_inputs(), labels=batch.labels, fn=lambda head: head)
    return HeadTeacher(head.hidden, head.weight, head.bias, head.transform, temperature)


def teacher_top_k(teacher: torch.nn.Module, batch: Batch, temperature: float, k: int):
    """``top_k_rows`` of ``batch``'s label tokens through the teacher's pass (inside its forward window)."""
    with torch.no_grad():
        return teacher.label_hidden(
            **batch.model_inputs(),
            labels=batch.labels,
            fn=lambda head: top_k_rows(
                head.hidden, head.weight, head.bias, head.transform, temperature, k, head.chunk_tokens
            ),
        )
