"""Stage 5: the one place that knows FSDP.

``parallelize(model, mesh, cfg)`` applies, in this order (the order torchtitan uses, and the only one in
which the three compose):

1. activation checkpointing on every block or every k-th block (``torch.distributed._composable.checkpoint``:
   in place, so parameter names and checkpoints do not change);
2. ``torch.compile`` of each block's ``forward`` (optional; in place for the same reason, and FSDP's and
   checkpointing's hooks stay outside the compiled region);
3. FSDP2 (``fully_shard``) on every block, then on the root, under a ``MixedPrecisionPolicy`` and an
   optional ``CPUOffloadPolicy``.

The mesh is 1-D (``dp``: plain FSDP over all ranks) or 2-D (``dp_replicate`` x ``dp_shard``: HSDP, the model
replicated across groups -- typically nodes -- and sharded inside each). FSDP does not know about packing:
it shards parameters and the batch passes through untouched.

Gradients are *summed* across ranks (``set_gradient_divide_factor(1.0)``): the trainer already divides
each rank's summed token loss by the global label count, so the result is the mean over every label token
of the global batch, whatever the world size or mesh shape.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from trainer.config import ParallelConfig
from trainer.model import DTYPES, VarlenCausalLM

log = logging.getLogger(__name__)


def build_mesh(device: torch.device, world_size: int, cfg: ParallelConfig | None = None) -> DeviceMesh:
    """The data-parallel mesh: 1-D ``(dp,)`` for FSDP, or 2-D ``(dp_replicate, dp_shard)`` for HSDP when
    ``cfg.dp_replicate`` is set. Ranks are laid out shard-fastest, so with one process per GPU and
    ``dp_replicate = nodes`` every shard group lives inside one node (fast intra-node links carry the
    all-gathers and reduce-scatters; only the gradient all-reduce crosses nodes). That ``dp_replicate``
    divides the world size is checked before the process group starts (``JobConfig.validate_world``)."""
    if cfg is None or cfg.dp_replicate is None:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    replicate = cfg.dp_replicate
    return init_device_mesh(
        device.type, (replicate, world_size // replicate), mesh_dim_names=("dp_replicate", "dp_shard")
    )


def mixed_precision_policy(cfg: ParallelConfig, root: bool = True) -> MixedPrecisionPolicy:
    """The policy of the root (``root=True``) or of a block. Only the root casts its output to
    ``output_dtype``: a block that did would hand the next module activations in a dtype its parameters
    are not in (CPU kernels such as layer_norm refuse mixed dtypes)."""
    return MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype],
        reduce_dtype=DTYPES[cfg.reduce_dtype],
        output_dtype=DTYPES[cfg.output_dtype] if cfg.output_dtype and root else None,
    )


def checkpointed_block_ids(num_blocks: int, cfg: ParallelConfig) -> list[int]:
    """Indices of the blocks whose activations are recomputed in backward."""
    if cfg.activation_checkpointing == "none":
        return []
    every = 1 if cfg.activation_checkpointing == "full" else cfg.activation_checkpointing_every
    return [i for i in range(num_blocks) if i % every == 0]


def apply_activation_checkpointing(layers: list[nn.Module], cfg: ParallelConfig) -> list[int]:
    ids = checkpointed_block_ids(len(layers), cfg)
    for i in ids:
        # Non-reentrant, in place: parameter names stay as they are (checkpoints and export see no wrapper).
        checkpoint_activations(layers[i])
    return ids


def apply_compile(layers: list[nn.Module], cfg: ParallelConfig) -> None:
    """Compile each block's forward in place. Blocks share one code object, so dynamo compiles the graph
    once and reuses it. FSDP's and checkpointing's hooks run in ``__call__``, outside the compiled code."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=cfg.compile_backend, dynamic=True)


def offload_policy(cfg: ParallelConfig, device: torch.device) -> OffloadPolicy:
    if not cfg.cpu_offload:
        return OffloadPolicy()  # the no-offload default of fully_shard
    # Pinned host memory speeds up host<->GPU copies; there is nothing to pin for on a CPU-only machine.
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def parallelize(model: VarlenCausalLM, mesh: DeviceMesh, cfg: ParallelConfig, frozen: bool = False) -> VarlenCausalLM:
    """Apply activation checkpointing, compile and FSDP2/HSDP to ``model`` in place and return it.

    Each decoder block is its own FSDP unit; the root holds the rest (embeddings, final norm, LM head; tied
    weights stay together in the root).

    Args:
        model: the (unsharded) model, already on its device.
        mesh: from ``build_mesh``: 1-D (FSDP) or 2-D (HSDP).
        cfg: the parallel config (dtypes, checkpointing, offload, resharding, compile).
        frozen: a model that never runs backward (a DPO reference): sharded the same way, nothing to recompute,
            so no activation checkpointing.
    """
    if frozen:
        cfg = dataclasses.replace(cfg, activation_checkpointing="none")
    block_mp, root_mp = mixed_precision_policy(cfg, root=False), mixed_precision_policy(cfg)
    device = next(model.parameters()).device
    offload = offload_policy(cfg, device)
    layers = model.decoder_layers()
    ac_ids = apply_activation_checkpointing(layers, cfg)
    if cfg.compile:
        apply_compile(layers, cfg)
    for i, layer in enumerate(layers):
        # The last block's parameters are needed right away in backward: keep them gathered.
        reshard = cfg.reshard_after_forward and i < len(layers) - 1
        fully_shard(layer, mesh=mesh, mp_policy=block_mp, offload_policy=offload, reshard_after_forward=reshard)
    fully_shard(
        model, mesh=mesh, mp_policy=root_mp, offload_policy=offload, reshard_after_forward=cfg.reshard_after_forward
    )
    for method in model.FORWARD_METHODS:  # the wrapper's other passes (token loss, log-probs, ...) are forwards too
        register_fsdp_forward_method(model, method)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    shape = "x".join(str(s) for s in mesh.shape)
    log.info(
        "%s over %s ranks (%s): %d blocks + root | params %s, reduce %s, output %s | reshard_after_forward=%s | "
        "activation checkpointing on %d/%d blocks | cpu_offload=%s | compile=%s",
        "HSDP" if mesh.ndim == 2 else "FSDP2",
        shape,
        ",".join(mesh.mesh_dim_names or ()),
        len(layers),
        cfg.param_dtype,
        cfg.reduce_dtype,
        cfg.output_dtype or "unchanged",
        cfg.reshard_after_forward,
        len(ac_ids),
        len(layers),
        cfg.cpu_offload,
        cfg.compile_backend if cfg.compile else False,
    )
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the reduce-scatter on all but the last micro-batch of a step (gradient accumulation)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
