"""Export a sharded checkpoint as a Hugging Face model: ``packfsdp export checkpoint=PATH out=DIR``.

``checkpoint`` is a checkpoint (``.../checkpoints/step_00000100``), a checkpoints directory or a run
directory (its latest complete checkpoint is used). The checkpoint is verified against its manifest, its
model tensors are consolidated from however many shards were saved (no process group, no GPU needed) and
written with ``save_pretrained`` as safetensors, next to the transformers config and the tokenizer saved
in the checkpoint. ``AutoModelForCausalLM.from_pretrained(out)`` loads the result. A run that trained a
multimodal model's language model (``trainer.model.multimodal``) exports the whole multimodal model, its
kept vision / audio parts and the folder's processor files from the checkpoint's ``hf/multimodal/``:
``AutoModelForImageTextToText`` (or the class its ``config.json`` names) loads it.

A LoRA checkpoint (``peft.method=lora``) holds only the adapters: the exporter rebuilds the frozen base it
records (``model.name_or_path`` or the seeded random init, checked against the base's SHA-256) and writes
either the merged model (``format=merged``, the default: plain transformers weights) or the adapter in
peft's format (``format=adapter``: ``PeftModel.from_pretrained(base, out)`` loads it).

Options: ``dtype=float32|bfloat16|float16`` (default: the dtype the model was trained in, ``model.dtype``),
``attn_implementation=sdpa`` (what the exported config asks transformers for; the packed attention
backends are training-time only).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from trainer.checkpoint import (
    HF_DIR,
    TRAINER_STATE,
    CheckpointError,
    find_checkpoint,
    read_full_tensors,
    verify_checkpoint,
)
from trainer.model import DTYPES
from trainer.model.lora import is_lora_checkpoint, peft_model_with, rebuild_base
from trainer.model.multimodal import carried_files, is_multimodal_checkpoint
from trainer.model.multimodal import rebuild as rebuild_multimodal
from trainer.stop_signals import PREEMPTED_EXIT_CODE, Interrupted, exit_interrupted, signals_interrupt
from trainer.tools.export_folder import check_out, replace, write_record

log = logging.getLogger("trainer.tools.export")

FORMATS = ("merged", "adapter")
USAGE = (
    "usage: packfsdp export checkpoint=PATH out=DIR [format=merged|adapter] [dtype=float32|bfloat16|float16] "
    "[attn_implementation=sdpa] [overwrite=false]"
)
MODEL_PREFIX = "model.model."
"""Flat DCP keys of the model: the ``model`` group, then the wrapper's ``model`` attribute (the HF model)."""


def export(
    checkpoint: str | Path,
    out: str | Path,
    dtype: str | None = None,
    attn_implementation: str = "sdpa",
    format: str = "merged",
    overwrite: bool = False,
) -> Path:
    """Write ``out`` (safetensors weights, config, tokenizer) from ``checkpoint``; returns ``out``.

    ``out`` must be new or empty, or with ``overwrite`` an earlier export packfsdp wrote (``export_folder``):
    then it is replaced as a whole (written beside it and renamed into place, so no stale shard or index of
    the old model stays)."""
    out = Path(out).expanduser()
    check_out(out, overwrite)
    path = find_checkpoint(checkpoint)
    manifest = verify_checkpoint(path)
    hf_dir = path / HF_DIR
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{path} holds no {HF_DIR}/config.json (saved by an older packfsdp?)")
    tensors = {k[len(MODEL_PREFIX) :]: v for k, v in read_full_tensors(path, prefix=MODEL_PREFIX).items()}
    if format == "adapter" and is_multimodal_checkpoint(hf_dir):
        raise CheckpointError(
            f"{path} trained a multimodal model's language model: its adapter names the language model's modules, "
            "which the multimodal model does not; export it with format=merged"
        )
    if is_lora_checkpoint(hf_dir):
        model = lora_model(path, tensors, format, attn_implementation)
    elif format == "adapter":
        raise CheckpointError(f"{path} trained every weight (no LoRA adapters): export it with format=merged")
    else:
        model = full_model(path, tensors, attn_implementation)
    torch_dtype = DTYPES[dtype] if dtype else next(iter(model.parameters())).dtype
    model = model.to(torch_dtype).eval()

    final, out = out, out.with_name(f".{out.name}.export-{os.getpid()}")
    out.mkdir(parents=True)
    try:  # an error or a stop signal (Interrupted) leaves nothing half-written beside out
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out)
        for carried in carried_files(hf_dir):  # a multimodal model's processor files, where the export wrote none
            if not (out / carried.name).exists():
                shutil.copyfile(carried, out / carried.name)
        state = json.loads((path / TRAINER_STATE).read_text())
        write_record(
            out,
            {
                "checkpoint": str(path.resolve()),
                "step": state["step"],
                "tokens_seen": state["tokens_seen"],
                "format": format,
                "dtype": str(torch_dtype).removeprefix("torch."),
                "manifest_sha256": {
                    k: v["sha256"] for k, v in manifest["files"].items() if k.endswith((".distcp", ".metadata"))
                },
            },
        )
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    replace(final, out, overwrite)
    log.info("exported %s (step %d) to %s: %s, %s safetensors", path, state["step"], final, format, torch_dtype)
    return final


def full_model(path: Path, tensors: dict[str, torch.Tensor], attn_implementation: str) -> torch.nn.Module:
    """The transformers model of a full fine-tuning checkpoint, every weight from ``tensors``; of a
    multimodal model's language model, the whole multimodal model (``trainer.model.multimodal.rebuild``)."""
    # Built on the CPU (not on the meta device) so that buffers computed at init, such as rotary
    # frequencies, are right; the parameters are then replaced by the checkpoint's.
    if is_multimodal_checkpoint(path / HF_DIR):
        whole, model = multimodal_model(path, attn_implementation)
    else:
        config = AutoConfig.from_pretrained(path / HF_DIR)
        config.use_cache = True  # training turned the KV cache off; generation wants it
        whole = model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    whole.tie_weights()
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - {
        name for name, _ in model.named_parameters()
    }
    # Buffers that are rebuilt at init (e.g. rotary inv_freq) are not in a checkpoint either.
    buffers = {name for name, _ in model.named_buffers()}
    missing = [k for k in missing if k not in tied and k not in buffers]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: the checkpoint does not fit the saved config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return whole


def multimodal_model(path: Path, attn_implementation: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The multimodal model of a checkpoint that trained its language model, with its kept parts in place,
    and that language model (``trainer.model.multimodal.rebuild``)."""
    try:
        return rebuild_multimodal(path / HF_DIR, attn_implementation)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def lora_model(path: Path, tensors: dict[str, torch.Tensor], format: str, attn_implementation: str) -> torch.nn.Module:
    """A LoRA checkpoint's adapters on its rebuilt, verified base: merged into a transformers model, or as a
    ``PeftModel`` whose ``save_pretrained`` writes peft's adapter format."""
    try:
        base = rebuild_base(path / HF_DIR, attn_implementation)
        model = peft_model_with(base, path / HF_DIR, tensors, modules_to_save=format == "adapter")
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if format == "adapter":
        return model
    merged = model.merge_and_unload()
    merged.config.use_cache = True
    if is_multimodal_checkpoint(path / HF_DIR):  # the merged language model back into its multimodal model
        whole, language_model = multimodal_model(path, attn_implementation)
        language_model.load_state_dict(merged.state_dict(), assign=True)
        whole.tie_weights()
        return whole
    return merged


def parse_args(argv: list[str]) -> dict[str, str]:
    args = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in ("checkpoint", "out", "dtype", "attn_implementation", "format", "overwrite"):
            raise SystemExit(f"packfsdp export: unexpected argument {arg!r}\n{USAGE}")
        args[key] = value
    if "checkpoint" not in args or "out" not in args:
        raise SystemExit(USAGE)
    if args.get("format") not in (None, *FORMATS):
        raise SystemExit(f"packfsdp export: format must be one of {', '.join(FORMATS)}")
    if args.get("overwrite") not in (None, "true", "false"):
        raise SystemExit("packfsdp export: overwrite must be true or false")
    if args.get("dtype") not in (None, *DTYPES):
        raise SystemExit(f"packfsdp export: dtype must be one of {', '.join(DTYPES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(message)s", datefmt="%H:%M:%S")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with signals_interrupt(
            lambda name: (
                f"packfsdp export: stopped by {name}; {args['out']} left as it was: "
                f"run the export again (exit code {PREEMPTED_EXIT_CODE})"
            )
        ):
            export(
                args["checkpoint"],
                args["out"],
                args.get("dtype"),
                args.get("attn_implementation", "sdpa"),
                args.get("format", "merged"),
                overwrite=args.get("overwrite") == "true",
            )
    except Interrupted as e:
        exit_interrupted(e.line)
    except CheckpointError as e:
        print(f"packfsdp export: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
