"""Stage 5: the one place that knows FSDP.

``parallelize(model, mesh, cfg)`` applies FSDP2 (``fully_shard``) to every transformer block, then to the
root, under a ``MixedPrecisionPolicy``. FSDP does not know about packing: it shards parameters and the
batch passes through untouched. Correctness of packed batches lives in attention, position_ids and labels;
FSDP only needs every rank to run the same steps, which the sampler guarantees.

Gradients are *summed* across ranks (``set_gradient_divide_factor(1.0)``): the trainer already divides
each rank's summed token loss by the global label count, so the result is the mean over every label token
of the global batch, whatever the world size.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from trainer.config import ParallelConfig
from trainer.model import DTYPES, VarlenCausalLM

log = logging.getLogger(__name__)


def build_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    """A 1-D data-parallel mesh over all ranks."""
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))


def mixed_precision_policy(cfg: ParallelConfig) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype],
        reduce_dtype=DTYPES[cfg.reduce_dtype],
        output_dtype=DTYPES[cfg.output_dtype] if cfg.output_dtype else None,
    )


def parallelize(model: VarlenCausalLM, mesh: DeviceMesh, cfg: ParallelConfig) -> VarlenCausalLM:
    """Shard ``model`` in place with FSDP2: each decoder block is its own unit, the root holds the rest
    (embeddings, final norm, LM head; tied weights stay together in the root)."""
    mp = mixed_precision_policy(cfg)
    layers = model.decoder_layers()
    for i, layer in enumerate(layers):
        # The last block's parameters are needed right away in backward: keep them gathered.
        reshard = cfg.reshard_after_forward and i < len(layers) - 1
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    log.info(
        "FSDP2 over %d ranks: %d blocks + root, params %s, reduce %s, reshard_after_forward=%s",
        mesh.size(), len(layers), cfg.param_dtype, cfg.reduce_dtype, cfg.reshard_after_forward,
    )
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the reduce-scatter on all but the last micro-batch of a step (gradient accumulation)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
