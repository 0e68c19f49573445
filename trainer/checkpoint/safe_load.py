"""Loading tensors from disk without running pickled code, in one home: ``load_tensor_file`` for a single
file (safetensors, or ``torch.load(weights_only=True)``), and ``load_tensors`` for a DCP checkpoint (a
restricted unpickler for DCP's ``.metadata``, which builds DCP's metadata classes and nothing else, and a
planner that refuses pickled entries)."""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.serialization import _get_layout  # the name torch's own weights-only unpickler allows for a layout

from trainer.checkpoint.discovery import CheckpointError, dcp_failure
from trainer.safety import UnsafeFileError


def load_tensor_file(path: str | Path, map_location: Any = "cpu") -> Any:
    """Load the tensors of one file without ever unpickling arbitrary objects.

    ``.safetensors`` files go through safetensors; anything else through ``torch.load(weights_only=True)``,
    which refuses a pickle that references anything beyond tensors and plain containers. The refusal is
    re-raised as ``UnsafeFileError`` naming the file.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        return load_file(str(path), device=str(map_location))
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises UnpicklingError (or RuntimeError) on a refused global
        if "weights_only" in str(e) or "Unsupported global" in str(e) or type(e).__name__ == "UnpicklingError":
            raise UnsafeFileError(
                f"{path}: refused to load: it is a pickle that is not plain tensors (it could run code on load). "
                "Only safetensors or torch.save'd tensors are loaded"
            ) from None
        raise


def _metadata_classes() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {}
    for module in (dcp_metadata, dcp_filesystem):
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
            "_StorageInfo",
        ):
            if hasattr(module, name):
                allowed[(module.__name__, name)] = getattr(module, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "strided",
        "sparse_coo",
        "contiguous_format",
        "channels_last",
        "preserve_format",
        "channels_last_3d",
        "Size",
    ):
        if hasattr(torch, name):
            allowed[("torch", name)] = getattr(torch, name)
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
    try:
        dcp.load(state, storage_reader=reader, planner=TensorOnlyLoadPlanner())
    except CheckpointException as e:
        raise dcp_failure(e, f"loading {path}") from None


def read_full_tensors(path: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint whose flat key starts with ``prefix``, as full (unsharded) CPU
    tensors keyed by flat name (``model.<param fqn>``, ``optim.<param fqn>.<state>``). No process group
    needed: this is how export consolidates a sharded checkpoint."""
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
