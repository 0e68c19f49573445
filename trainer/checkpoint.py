"""Checkpoints that never lose a step: torch.distributed.checkpoint (DCP), complete-only, checksummed.

Layout of one checkpoint (``<run_dir>/checkpoints/step_00000100/``)::

    .metadata, __0_0.distcp, ...   DCP: model parameters and optimizer state (sharded; any world size loads them)
    hf/                            the model's transformers config and the tokenizer (for export)
    trainer_state.json             step, tokens seen, sampler position, scheduler, optimizer hyper-parameters
    rng/rank_00000.safetensors     each rank's RNG states (torch, CUDA, numpy, python)
    manifest.json                  size and SHA-256 of every file above; written last

A checkpoint is written to ``step_XXXXXXXX.tmp/`` and renamed to its final name only after every rank has
finished and the manifest is written, so a crash at any point of a save leaves the previous checkpoint as
the latest complete one (``.tmp`` folders are never loaded, and the next save removes them).

Loading never unpickles arbitrary data: the JSON and safetensors files hold no code, DCP's tensor files are
read with ``torch.load(weights_only=True)`` (DCP's own choice), and DCP's ``.metadata`` pickle is read with a
restricted unpickler that only builds DCP's metadata classes. Before any of that, the files are checked
against the manifest, because DCP alone would load a flipped byte silently.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.fsdp import FSDPModule
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer import dist
from trainer.config import CheckpointConfig
from trainer.safety import redact_tree

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
HF_DIR = "hf"
_NAME = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit this run."""


@dataclass
class TrainingState:
    """What a checkpoint saves and restores, besides the step counters."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: Any
    """Anything with ``state_dict()`` / ``load_state_dict()`` returning/taking plain JSON-able data."""
    tokenizer: Any = None
    """Saved with the model's transformers config under ``hf/`` so that export needs only the checkpoint."""


@dataclass
class Restored:
    step: int
    tokens_seen: int
    path: Path


# ------------------------------------------------------------------------------------------ finding them
def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints under ``directory`` (those with a manifest), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)) and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def find_checkpoint(spec: str | Path) -> Path:
    """A checkpoint from a path: the checkpoint itself, or the latest complete one in a checkpoints
    directory or in a run directory (``<run>/checkpoints``)."""
    path = Path(spec).expanduser()
    if (path / MANIFEST).is_file():
        return path
    for directory in (path, path / "checkpoints"):
        latest = latest_checkpoint(directory)
        if latest is not None:
            return latest
    if path.name.endswith(".tmp") or (path.is_dir() and _NAME.match(path.name)):
        raise CheckpointError(f"{path} is an incomplete checkpoint (no {MANIFEST}): a save did not finish")
    raise CheckpointError(f"no complete checkpoint at {path}")


# ----------------------------------------------------------------------------------- manifest, checksums
def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _payload_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path, step: int) -> None:
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in _payload_files(directory)
    }
    manifest = {"format": FORMAT_VERSION, "step": step, "files": files, "created": time.time()}
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)


def verify_checkpoint(directory: str | Path) -> dict:
    """Check every file of a checkpoint against its manifest; raise ``CheckpointError`` naming the first
    file that is missing, truncated, grown or changed. Returns the manifest."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{directory}: unreadable {MANIFEST} ({e}); the checkpoint is incomplete or damaged")
    for rel, expected in files.items():
        path = directory / rel
        if not path.is_file():
            raise CheckpointError(f"{directory}: file {rel} listed in the manifest is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{directory}: file {rel} has {size} bytes, the manifest says {expected['bytes']} (truncated or "
                "partially copied); use an earlier checkpoint"
            )
        if sha256_file(path) != expected["sha256"]:
            raise CheckpointError(
                f"{directory}: file {rel} does not match its SHA-256 in the manifest (corrupted on disk or in "
                "transfer); use an earlier checkpoint"
            )
    unlisted = [str(p.relative_to(directory)) for p in _payload_files(directory) if str(p.relative_to(directory)) not in files]
    if unlisted:
        raise CheckpointError(f"{directory}: files not in the manifest: {', '.join(unlisted[:5])}")
    return manifest


# ----------------------------------------------------------------------- loading DCP without arbitrary pickle
def _metadata_classes() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {}
    for module in (metadata, filesystem):
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING", "_StorageInfo"):
            if hasattr(module, name):
                allowed[(module.__name__, name)] = getattr(module, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                 "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "strided", "sparse_coo",
                 "contiguous_format", "channels_last", "preserve_format", "channels_last_3d", "Size"):
        if hasattr(torch, name):
            allowed[("torch", name)] = getattr(torch, name)
    import collections
    import pathlib

    from torch.serialization import _get_layout

    # Harmless constructors: a layout looked up by name, the checkpoint's own path, an ordered dict.
    allowed[("torch.serialization", "_get_layout")] = _get_layout
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else (the "restricting globals" recipe of the pickle docs)."""

    allowed = _metadata_classes()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            raise pickle.UnpicklingError("DCP metadata must not contain tensors")
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            except pickle.UnpicklingError as e:
                raise CheckpointError(f"{path}: refusing to load DCP metadata: {e}") from e
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """Refuses pickled (non-tensor) entries: DCP would ``torch.load(weights_only=False)`` them."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn} is a pickled object; refusing to load it")


def load_tensors(state: dict, path: str | Path) -> None:
    """Fill ``state`` (nested dicts of tensors / DTensors) in place from the DCP checkpoint at ``path``.
    Works in a process group of any size and without one (full tensors)."""
    reader = SafeFileSystemReader(str(path))
    reader.read_metadata()  # refused metadata raises CheckpointError here, not wrapped inside DCP's errors
    dcp.load(state, storage_reader=reader, planner=TensorOnlyLoadPlanner())


def read_full_tensors(path: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint whose flat key starts with ``prefix``, as full (unsharded) CPU
    tensors keyed by flat name (``model.<param fqn>``, ``optim.<param fqn>.<state>``). No process group
    needed: this is how export consolidates a sharded checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeFileSystemReader(str(path)).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        load_tensors(state, path)
    return state


# ---------------------------------------------------------------------------------------- RNG states
def rng_tensors() -> dict[str, torch.Tensor]:
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    out = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos_gauss": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_cached_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
        "python": torch.tensor(py_state, dtype=torch.int64),
        "python_meta": torch.tensor([py_version, py_gauss is not None], dtype=torch.int64),
        "python_gauss": torch.tensor([py_gauss or 0.0], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_tensors(t: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(t["torch"])
    if "cuda" in t and torch.cuda.is_available():
        torch.cuda.set_rng_state(t["cuda"])
    pos, has_gauss = t["numpy_pos_gauss"].tolist()
    np.random.set_state(("MT19937", t["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, float(t["numpy_cached_gauss"])))
    version, py_has_gauss = t["python_meta"].tolist()
    gauss = float(t["python_gauss"]) if py_has_gauss else None
    random.setstate((version, tuple(t["python"].tolist()), gauss))


def save_hf_assets(state: TrainingState, directory: Path) -> None:
    """The transformers config of the model (no weights) and the tokenizer."""
    config = getattr(state.model, "config", None)
    if config is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    # Secrets passed through model.config_overrides (hub tokens, keys) never reach the saved config.
    (directory / "config.json").write_text(json.dumps(redact_tree(config.to_dict()), indent=2, sort_keys=True) + "\n")
    if state.tokenizer is not None:
        state.tokenizer.save_pretrained(str(directory))


# ------------------------------------------------------------------------------------------ the checkpointer
class Checkpointer:
    """Saves and restores a run's complete state with DCP; every method is collective (all ranks call it).

    Args:
        cfg: the checkpoint config.
        run_dir: the run directory (checkpoints go to ``<run_dir>/checkpoints`` unless ``cfg.dir`` is set).
        seed: the run's seed (re-seeds RNGs when a checkpoint was taken on a different world size).
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, seed: int = 0) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"
        self.seed = seed
        self.rank, self.world_size = dist.rank(), dist.world_size()

    def due(self, step: int, last_step: bool) -> bool:
        """Whether to save after ``step`` (``last_step``: the loop ends after this step)."""
        periodic = self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        return periodic or (last_step and self.cfg.at_end)

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint to resume from for ``resume`` = none | auto | a path (same answer on all ranks)."""
        if resume in ("none", "", None):
            return None
        if resume == "auto":
            path = latest_checkpoint(self.dir) if dist.is_rank0() else None
        else:
            path = find_checkpoint(resume) if dist.is_rank0() else None
        path = dist.broadcast_object(str(path) if path else None)
        if resume == "auto" and path is None:
            log.info("resume=auto: no complete checkpoint in %s; starting from scratch", self.dir)
        return Path(path) if path else None

    # ------------------------------------------------------------------------------------------------ save
    def save(self, step: int, state: TrainingState, tokens_seen: int, total_steps: int) -> Path:
        start = time.perf_counter()
        final = self.dir / checkpoint_name(step)
        tmp = final.with_name(final.name + ".tmp")
        if dist.is_rank0():
            for stale in self.dir.glob("step_*.tmp"):  # left by a save that crashed
                shutil.rmtree(stale, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()

        # A forward under no_grad (eval) leaves blocks with reshard_after_forward=False gathered; save the
        # sharded parameters the optimizer holds, in the same layout every time.
        for module in state.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        model_sd = get_model_state_dict(state.model)
        optim_sd = get_optimizer_state_dict(state.model, state.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd["state"]}, storage_writer=FileSystemWriter(str(tmp)))
        save_file(rng_tensors(), str(tmp / "rng" / f"rank_{self.rank:05d}.safetensors"))
        if dist.is_rank0():
            scheduler = {k: v for k, v in state.scheduler.state_dict().items() if k != "lr_lambdas"}
            trainer_state = {
                "format": FORMAT_VERSION,
                "step": step,
                "tokens_seen": tokens_seen,
                "total_steps": total_steps,
                "world_size": self.world_size,
                "sampler": state.sampler.state_dict(),
                "scheduler": scheduler,
                "optimizer_param_groups": optim_sd["param_groups"],
            }
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1, default=_jsonable))
            save_hf_assets(state, tmp / HF_DIR)
        dist.barrier()  # every rank's files are on disk

        def finalize() -> None:
            try:
                self._finalize(tmp, final, step)
            except Exception as e:  # noqa: BLE001 -- raised on every rank by on_rank0_then_all, never a hang
                raise CheckpointError(f"saving checkpoint {final} failed: {type(e).__name__}: {e}") from e

        dist.on_rank0_then_all(finalize)
        log.info("checkpoint %s saved in %.2f s", final, time.perf_counter() - start)
        return final

    def _finalize(self, tmp: Path, final: Path, step: int) -> None:
        """Rank 0: manifest, then the atomic rename that makes the checkpoint count, then pruning."""
        write_manifest(tmp, step)
        replaced = None
        if final.exists():  # the same step saved again: keep the old copy until the new one is in place
            replaced = final.with_name(final.name + ".replaced")
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        if self.cfg.keep_last > 0:
            for old in complete_checkpoints(self.dir)[: -self.cfg.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ load
    def load(self, path: Path, state: TrainingState, total_steps: int) -> Restored:
        """Restore ``state`` from ``path``; returns the step and tokens seen to continue from."""
        start = time.perf_counter()
        def verify() -> None:  # rank 0 reads every file once; a bad checkpoint fails on every rank
            if self.cfg.verify:
                verify_checkpoint(path)
            elif not (path / MANIFEST).is_file():
                raise CheckpointError(f"{path} is incomplete (no {MANIFEST})")

        dist.on_rank0_then_all(verify)

        saved = json.loads((path / TRAINER_STATE).read_text())
        if saved.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: checkpoint format {saved.get('format')} is not {FORMAT_VERSION}")
        model_sd = get_model_state_dict(state.model)
        optim_sd = get_optimizer_state_dict(state.model, state.optimizer)
        tensors = {"model": model_sd, "optim": optim_sd["state"]}
        load_tensors(tensors, path)
        set_model_state_dict(state.model, tensors["model"])
        set_optimizer_state_dict(
            state.model, state.optimizer, {"state": tensors["optim"], "param_groups": saved["optimizer_param_groups"]}
        )
        state.scheduler.load_state_dict(saved["scheduler"] | {"lr_lambdas": [None] * len(state.optimizer.param_groups)})
        try:
            state.sampler.load_state_dict(saved["sampler"])
        except ValueError as e:
            raise CheckpointError(f"{path}: the data sampler cannot resume here: {e}") from e
        self._restore_rng(path, saved["world_size"], saved["step"])
        if saved["total_steps"] != total_steps and dist.is_rank0():
            log.warning(
                "the checkpoint's schedule spans %d steps, this run's %d: the learning-rate schedule changes "
                "from here on (set max_steps to keep it)", saved["total_steps"], total_steps,
            )
        log.info(
            "resumed from %s: step %d, %d tokens seen, saved on %d rank(s), now %d (%.2f s)",
            path, saved["step"], saved["tokens_seen"], saved["world_size"], self.world_size,
            time.perf_counter() - start,
        )
        return Restored(step=saved["step"], tokens_seen=saved["tokens_seen"], path=path)

    def _restore_rng(self, path: Path, saved_world_size: int, step: int) -> None:
        if saved_world_size == self.world_size:
            set_rng_tensors(load_file(str(path / "rng" / f"rank_{self.rank:05d}.safetensors")))
            return
        # Ranks do not map one to one: give each rank a fresh stream that is still a function of the run.
        seed = (self.seed * 1_000_003 + step * 1_009 + self.rank) % 2**31
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        log.warning("RNG states re-seeded: the checkpoint was saved on %d rank(s), this run has %d",
                    saved_world_size, self.world_size)


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop ``metrics.jsonl`` records after ``step`` (logged by an attempt that died before its next
    checkpoint): the resumed run logs those steps again, once."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:  # a line cut short when the attempt died
            continue
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    """numpy scalars and arrays (e.g. in a sampler's state) as plain JSON numbers and lists."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable (checkpoint trainer state)")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
