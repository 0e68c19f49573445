"""Checkpoints that never lose a step: torch.distributed.checkpoint (DCP), complete-only, checksummed.

Layout of one checkpoint (``<run_dir>/checkpoints/step_00000100/``)::

    .metadata, __0_0.distcp, ...   DCP: model parameters and optimizer state (sharded; any world size loads them)
    hf/                            the model's transformers config and the tokenizer (for export)
    trainer_state.json             step, tokens seen, sampler position, scheduler, optimizer hyper-parameters
    rng/rank_00000.safetensors     each rank's RNG states (torch, CUDA, numpy, python)
    data/rank_00000.safetensors    streaming only: each rank's stream position and packing buffer
    manifest.json                  size and SHA-256 of every file above; written last

A checkpoint is written to ``step_XXXXXXXX.tmp/`` and renamed to its final name only after every rank has
finished and the manifest is written, so a crash at any point of a save leaves the previous checkpoint as
the latest complete one (``.tmp`` folders are never loaded, and the next save removes them).

Loading never unpickles arbitrary data: the JSON and safetensors files hold no code, DCP's tensor files are
read with ``torch.load(weights_only=True)`` (DCP's own choice), and DCP's ``.metadata`` pickle is read with a
restricted unpickler that only builds DCP's metadata classes. Before any of that, the files are checked
against the manifest, because DCP alone would load a flipped byte silently.
"""

from trainer.checkpoint.checkpointer import Checkpointer, Restored, TrainingState
from trainer.checkpoint.discovery import (
    FORMAT_VERSION,
    HF_DIR,
    MANIFEST,
    TRAINER_STATE,
    CheckpointError,
    complete_checkpoints,
    find_checkpoint,
    latest_checkpoint,
)
from trainer.checkpoint.manifest import verify_checkpoint
from trainer.checkpoint.safe_load import load_tensor_file, load_tensors, read_full_tensors

__all__ = [
    "FORMAT_VERSION",
    "HF_DIR",
    "MANIFEST",
    "TRAINER_STATE",
    "CheckpointError",
    "Checkpointer",
    "Restored",
    "TrainingState",
    "complete_checkpoints",
    "find_checkpoint",
    "latest_checkpoint",
    "load_tensor_file",
    "load_tensors",
    "read_full_tensors",
    "verify_checkpoint",
]
