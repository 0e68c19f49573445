"""Cases of tests/distributed/test_parallelize.py, run under torchrun with 2 gloo ranks on CPU
(``tests.distributed.workers``).

For every ``parallelize`` option (FSDP, HSDP 2x1 and 1x2, activation checkpointing full / every k-th, CPU
offload, no resharding, compile, mixed precision) it runs one global batch of 4 packed micro-batches: on an
unsharded single-process model (what one rank computes with ``grad_accum=4``), and sharded over 2 ranks
(2 micro-batches each, gradient sync on the last), both through ``summed_token_loss`` (the trainer's loss) divided
by the global label count. ``run_cases`` returns one record per case.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor

from trainer import distributed
from trainer.collate import collate_packed
from trainer.config import DataConfig, ModelConfig, ParallelConfig
from trainer.data import load_dataset, load_tokenizer
from trainer.loss import summed_token_loss
from trainer.model import build_model, resolve_backend
from trainer.parallel import build_mesh, parallelize, set_gradient_sync

FP32 = ParallelConfig(device="cpu", backend="gloo", param_dtype="float32", reduce_dtype="float32")
CASES = {
    "fsdp": FP32,
    "hsdp_2x1": replace(FP32, dp_replicate=2),
    "hsdp_1x2": replace(FP32, dp_replicate=1),
    "ac_full": replace(FP32, activation_checkpointing="full"),
    "ac_every_2": replace(FP32, activation_checkpointing="every_k", activation_checkpointing_every=2),
    "cpu_offload": replace(FP32, cpu_offload=True),
    "no_reshard": replace(FP32, reshard_after_forward=False),
    "compile_ac": replace(FP32, compile=True, compile_backend="aot_eager", activation_checkpointing="full"),
    "bf16_mixed": replace(FP32, param_dtype="bfloat16", reduce_dtype="float32", output_dtype="float32"),
}


def run_cases(cache: str) -> dict[str, dict]:
    device = torch.device("cpu")
    rank = distributed.rank()
    data_cfg = DataConfig(num_records=300, cache_dir=cache)
    model_cfg = ModelConfig(
        family="gpt2",
        config_overrides=dict(
            n_layer=3, n_embd=32, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        ),
    )
    tokenizer = load_tokenizer(model_cfg, data_cfg)
    dataset = load_dataset(data_cfg, tokenizer, max_length=256)
    backend = resolve_backend("sdpa_varlen", device)
    pad = tokenizer.pad_token_id
    microbatches = [collate_packed(dataset, list(range(4 * i, 4 * i + 4)), pad) for i in range(4)]
    global_labels = float(sum(b.num_label_tokens for b in microbatches))
    mine = microbatches[2 * rank : 2 * rank + 2]

    base = build_model(model_cfg, tokenizer, backend, seed=7)
    reference = copy.deepcopy(base)
    ref_loss = 0.0
    for b in microbatches:
        loss = summed_token_loss(reference, b)
        (loss / global_labels).backward()
        ref_loss += float(loss)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    results = {}
    for name, cfg in CASES.items():
        torch._dynamo.reset()
        t0 = time.perf_counter()
        if rank == 0:
            print("case", name, flush=True)
        model = copy.deepcopy(base)
        attn_calls = [0]
        for layer in model.decoder_layers():
            layer.attn.register_forward_hook(lambda *_, calls=attn_calls: calls.__setitem__(0, calls[0] + 1))
        mesh = build_mesh(device, distributed.world_size(), cfg)
        model = parallelize(model, mesh, cfg)
        loss = 0.0
        for i, batch in enumerate(mine):
            set_gradient_sync(model, i == len(mine) - 1)
            batch_loss = summed_token_loss(model, batch)
            (batch_loss / global_labels).backward()
            loss += float(batch_loss)
        calls = attn_calls[0]
        (loss,) = distributed.all_reduce_sum([loss], device)
        worst, worst_name = 0.0, ""
        placements = None
        for n, p in model.named_parameters():
            if p.grad is None:
                raise RuntimeError(
                    f"{name}: no gradient for {n}: missing {[m for m, q in model.named_parameters() if q.grad is None]}"
                )
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            diff = float((grad.float() - ref_grads[n]).abs().max())
            if diff > worst:
                worst, worst_name = diff, n
            placements = [str(pl) for pl in p.placements]
        param_device = str(next(model.parameters()).to_local().device)
        logits_dtype = None
        if cfg.output_dtype:  # after reading the gradients: the last block stays unsharded after this
            with torch.no_grad():
                logits_dtype = str(model(**mine[0].model_inputs()).dtype)
        results[name] = {
            "max_grad_diff": worst,
            "worst_param": worst_name,
            "loss_diff": abs(loss - ref_loss),
            "mesh_shape": list(mesh.shape),
            "placements": placements,
            # forward calls of block attention on this rank for 2 micro-batches, recomputations included
            "attn_calls": calls,
            "logits_dtype": logits_dtype,
            "param_device": param_device,
            "seconds": time.perf_counter() - t0,
            "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        }
        tdist.barrier()
    return results
