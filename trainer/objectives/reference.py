"""The reference log-probs of ``objective=dpo`` (``dpo.reference``), for the config actually run:

- ``live``, full fine-tuning: ``frozen_copy`` of the starting policy, FSDP2-sharded like it (same mesh, same
  mixed precision), its weights held in the compute dtype, no grad, no optimizer state (``LiveReference``);
- ``live`` with ``peft=lora``: the policy itself with its adapters switched off for the reference pass
  (``LiveReference(lora_base=True)``): the base is the reference, no second copy;
- ``precompute``: one pass of the starting policy over every pair of the data cache folder before training
  (``precompute_reference``: bins dealt to ranks like eval, the result all-reduced), stored next to the
  cache's arrays as ``ref_logps_<fingerprint>.npy`` (checksummed), keyed by the reference weights, the
  compute dtype, the attention backend and the loss implementation; a later run with the same reference
  reads it. The batches then carry it (``Batch.ref_logps``) and a run holds one model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging

import torch
from torch.distributed.fsdp import FSDPModule

from trainer import distributed
from trainer.collate import Batch, collate_packed
from trainer.data.cache_integrity import load_hashes, save_hashes
from trainer.data.examples import TokenizedDataset
from trainer.evaluate import eval_microbatches

log = logging.getLogger(__name__)


def sequence_logps(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Summed label log-probabilities of every sequence of ``batch``, fp32 ``[sequences]`` (pair ``k``:
    entries ``2k`` chosen and ``2k + 1`` rejected). ``model`` is a ``VarlenCausalLM`` (FSDP2-wrapped or not): it
    computes them inside its forward window, through the chunked fused head (full logits never exist); a
    sequence's first token carries no label, so each sum equals that of the sequence run alone. The policy's
    pass (``trainer.objectives.dpo``) and the reference's (no grad) are this one."""
    return model.sequence_logps(**batch.model_inputs(), labels=batch.labels)


class LiveReference:
    """The reference run live: a frozen copy of the starting policy (sharded by the caller like the policy),
    or, with ``lora_base``, the policy itself with its adapters off."""

    def __init__(self, model: torch.nn.Module, lora_base: bool = False) -> None:
        self.model, self.lora_base = model, lora_base

    def describe(self) -> str:
        if self.lora_base:
            return "live (the LoRA base: the policy with its adapters off, no copy)"
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return f"live (a frozen FSDP2-sharded copy of the starting policy, held in {dtype})"

    @torch.no_grad()
    def logps(self, batch: Batch) -> torch.Tensor:
        if self.lora_base:
            with adapters_off(self.model):
                return sequence_logps(self.model, batch).double()
        out = sequence_logps(self.model, batch).double()
        reshard(self.model)
        return out


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters of a no-grad forward: no backward comes to reshard them (FSDP2 keeps
    the root and the last block gathered after forward for the backward it expects)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The reference of full fine-tuning: the unsharded starting policy, copied, frozen, in eval mode, its
    parameters in ``dtype`` (the compute dtype). FSDP2's mixed precision casts the policy's fp32 weights to that
    dtype for every forward; a frozen copy needs nothing else, so holding it cast gives the same forward
    (the same rounding, once) in half the memory under bf16. Buffers keep their dtype (RoPE's inverse
    frequencies stay fp32, as in the policy). The parameters are cast as they are copied (``deepcopy``'s memo
    holds their cast copies), so setup holds the policy plus the cast copy, never two policies; tied weights
    stay tied (one memo entry per parameter object)."""
    memo = {
        id(p): torch.nn.Parameter(p.detach().to(dtype or p.dtype, copy=True), requires_grad=False)
        for p in model.parameters()
    }
    reference = copy.deepcopy(model, memo)
    reference.requires_grad_(False)
    return reference.eval()


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """The LoRA layers of ``model`` pass their base layer's output only (``peft``'s own switch, flipped
    without touching ``requires_grad``, which FSDP2 must not see change), and eval mode, for the block."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: PLC0415 -- peft is optional (the lora extra): only LoRA runs get here

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    was = [m._disable_adapters for m in layers]
    was_training = model.training
    try:
        for m in layers:
            m._disable_adapters = True
        model.eval()
        yield
    finally:
        for m, w in zip(layers, was, strict=True):
            m._disable_adapters = w
        model.train(was_training)


class PrecomputedReference:
    """``dpo.reference=precompute``: the batches carry the stored log-probs."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint

    def describe(self) -> str:
        return f"precompute (stored in the data cache, {self.fingerprint})"

    def logps(self, batch: Batch) -> torch.Tensor | None:
        if batch.num_pairs and batch.ref_logps is None:
            raise RuntimeError("dpo.reference=precompute: a batch of pairs carries no reference log-probs")
        return batch.ref_logps


def reference_fingerprint(model: torch.nn.Module, *facts: str) -> str:
    """What the reference log-probs depend on: every weight of the unsharded starting model (names, dtypes,
    bytes) and ``facts`` (compute dtype, attention backend, loss implementation)."""
    h = hashlib.blake2b(digest_size=10)
    for fact in facts:
        h.update(fact.encode() + b"\0")
    for name, tensor in model.state_dict().items():
        h.update(name.encode() + str(tensor.dtype).encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def precompute_reference(
    model: torch.nn.Module,
    datasets: list[TokenizedDataset | None],
    fingerprint: str,
    token_budget: int,
    device: torch.device,
    pad_id: int = 0,
) -> PrecomputedReference:
    """Every pair's reference log-probs (all base examples of the cache folder, so the held-out split is
    covered too), read from the cache or computed once by ``model`` (the starting policy, as sharded for
    training: the same precision as a live reference) and stored; then attached to ``datasets``."""
    base = dataclasses.replace(datasets[0], rows=None)
    path = base.folder / f"ref_logps_{fingerprint}.npy" if base.folder is not None else None
    saved = load_hashes(path) if path is not None and path.is_file() else None
    if saved is not None and saved.shape != (len(base), 2):
        saved = None
    missing = distributed.all_reduce_max([float(saved is None)], device)[0]  # one rank missing it: all compute
    if missing:
        log.info("dpo.reference=precompute: one pass of the reference over %d pairs", len(base))
        values = torch.zeros((len(base), 2), dtype=torch.float64, device=device)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for indices in eval_microbatches(base.lengths, token_budget, distributed.rank(), distributed.world_size()):
                logps = sequence_logps(model, collate_packed(base, indices, pad_id).to(device)).double()
                if len(indices):
                    values[torch.as_tensor(indices, device=device)] = logps.view(-1, 2)
        model.train(was_training)
        reshard(model)  # the optimizer, built next, must see the sharded parameters
        if distributed.is_initialized():
            torch.distributed.all_reduce(values)
        saved = values.cpu().numpy()
        if path is not None and distributed.is_rank0():
            save_hashes(path, saved)
        distributed.barrier()
    else:
        log.info("dpo.reference=precompute: reference log-probs read from %s", path)
    for ds in datasets:
        if ds is not None:
            ds.stored_ref_logps = saved
    return PrecomputedReference(fingerprint)


@dataclasses.dataclass
class ReferencePlan:
    """What ``dpo.reference`` needs, taken from the unsharded starting policy before FSDP2 shards it (a
    copy, or the fingerprint of its weights), then ``build`` after: ``plan_reference`` makes it."""

    kind: str
    """``none`` (simpo), ``copy`` (live, full), ``adapters`` (live, LoRA) or ``precompute``."""
    copy: torch.nn.Module | None = None
    fingerprint: str = ""

    def build(
        self, policy: torch.nn.Module, shard, datasets: list, token_budget: int, device: torch.device, pad_id: int = 0
    ):
        """The reference object (``None`` for simpo). ``shard(model)``: FSDP2 as the policy got it."""
        if self.kind == "copy":
            return LiveReference(shard(self.copy))
        if self.kind == "adapters":
            return LiveReference(policy, lora_base=True)
        if self.kind == "precompute":
            return precompute_reference(policy, datasets, self.fingerprint, token_budget, device, pad_id)
        return None


def plan_reference(cfg, model: torch.nn.Module, *facts: str, dtype: torch.dtype | None = None) -> ReferencePlan:
    """``cfg``: the ``DPOConfig``; ``model``: the unsharded starting policy, on its device; ``facts``: what
    else its log-probs depend on (compute dtype, attention backend, loss implementation); ``dtype``: the
    compute dtype a frozen copy is held in."""
    if not cfg.needs_reference:
        return ReferencePlan("none")
    if cfg.reference == "precompute":
        return ReferencePlan("precompute", fingerprint=reference_fingerprint(model, *facts))
    if getattr(model, "lora_base", None) is not None:
        return ReferencePlan("adapters")
    return ReferencePlan("copy", copy=frozen_copy(model, dtype))
