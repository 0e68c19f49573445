"""Cases of tests/distributed/test_chunked_loss_fsdp.py, run under torchrun with 2 gloo ranks on CPU
(``tests.distributed.workers``).

The chunked loss under FSDP2 (the LM head sharded with the root, gathered only inside the root's forward)
against the naive loss on one unsharded process: one global batch of 4 packed micro-batches (2 per rank),
tied and untied heads, fp32 and bf16 mixed precision, then eval through ``trainer.evaluate`` on both.
``run_cases`` returns one record per case.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor

from trainer import distributed
from trainer.collate import collate_packed
from trainer.config import DataConfig, ModelConfig, ParallelConfig
from trainer.data import load_dataset, load_tokenizer
from trainer.data.holdout import subset
from trainer.evaluate import evaluate
from trainer.loss import summed_token_loss
from trainer.model import build_model, resolve_backend
from trainer.parallel import build_mesh, parallelize, set_gradient_sync

FP32 = ParallelConfig(device="cpu", backend="gloo", param_dtype="float32", reduce_dtype="float32")
BF16 = replace(FP32, param_dtype="bfloat16")
CASES = {"tied_fp32": (True, FP32), "untied_fp32": (False, FP32), "tied_bf16": (True, BF16)}
GPT2 = dict(n_layer=2, n_embd=32, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def train_grads(model, batches, global_labels: float) -> tuple[float, dict[str, torch.Tensor]]:
    """Summed loss and full (gathered) gradients after one accumulated backward over ``batches``."""

    def accumulate(i: int, batch) -> float:
        set_gradient_sync(model, i == len(batches) - 1)  # reduce-scatter once, after the last micro-batch
        batch_loss = summed_token_loss(model, batch)
        (batch_loss / global_labels).backward()
        return float(batch_loss)

    loss = sum(accumulate(i, batch) for i, batch in enumerate(batches))
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return loss, grads


def run_case(tied: bool, cfg: ParallelConfig, tokenizer, dataset, cache: str) -> dict:
    device = torch.device("cpu")
    model_cfg = ModelConfig(family="gpt2", config_overrides=dict(GPT2, tie_word_embeddings=tied))
    base = build_model(model_cfg, tokenizer, resolve_backend("sdpa_varlen", device), seed=7)
    batches = [collate_packed(dataset, list(range(4 * i, 4 * i + 4)), tokenizer.pad_token_id) for i in range(4)]
    global_labels = float(sum(b.num_label_tokens for b in batches))
    reference = copy.deepcopy(base)
    reference.use_loss("naive")
    ref_loss, ref_grads = train_grads(reference, batches, global_labels)
    held_out = subset(dataset, list(range(16, 40)))
    ref_eval = evaluate(reference, held_out, 256, device, tokenizer.pad_token_id)["eval_loss"]

    model = copy.deepcopy(base)
    loss_line = model.use_loss("chunked", chunk_tokens=64)
    model = parallelize(model, build_mesh(device, distributed.world_size(), cfg), cfg)
    rank = distributed.rank()
    loss, grads = train_grads(model, batches[2 * rank : 2 * rank + 2], global_labels)
    (loss,) = distributed.all_reduce_sum([loss], device)
    worst = max((float((grads[n].float() - g).abs().max()), n) for n, g in ref_grads.items())
    return {
        "loss_line": loss_line,
        "head_sharded": isinstance(model.model.get_output_embeddings().weight, DTensor),
        "loss_rel_diff": abs(loss - ref_loss) / ref_loss,
        "max_grad_diff": worst[0],
        "worst_param": worst[1],
        "eval_diff": abs(evaluate(model, held_out, 256, device, tokenizer.pad_token_id)["eval_loss"] - ref_eval),
    }


def run_cases(cache: str) -> dict[str, dict]:
    data_cfg = DataConfig(num_records=300, cache_dir=cache)
    tokenizer = load_tokenizer(ModelConfig(family="gpt2"), data_cfg)
    dataset = load_dataset(data_cfg, tokenizer, max_length=256)
    return {name: run_case(tied, cfg, tokenizer, dataset, cache) for name, (tied, cfg) in CASES.items()}
