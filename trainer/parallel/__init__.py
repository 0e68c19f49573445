"""Stage 5: the parallel stage, the one place that knows how the model and its rows are laid over the ranks.

- ``fsdp``: the device mesh, FSDP2 (or HSDP), mixed precision, activation checkpointing, compile
  (``parallelize``);
- ``route``: how a micro-batch runs over the ranks, entered by the step as one context (``build_route``):
  whole rows (``Route``) or, with ``parallel.cp > 1``, context parallelism (``ContextParallelRoute``);
- ``cp_layout``: how a row is split over a CP group (``plan_shards``, ``shard_batch``);
- ``cp_attention``: a shard's attention against the row's gathered keys.
"""

from trainer.parallel.fsdp import (
    apply_activation_checkpointing,
    apply_compile,
    build_mesh,
    parallelize,
    set_gradient_sync,
)
from trainer.parallel.route import ContextParallelRoute, Route, build_route

__all__ = [
    "ContextParallelRoute",
    "Route",
    "apply_activation_checkpointing",
    "apply_compile",
    "build_mesh",
    "build_route",
    "parallelize",
    "set_gradient_sync",
]
