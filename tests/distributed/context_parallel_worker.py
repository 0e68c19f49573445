"""Context-parallel cases on 4 gloo ranks (``tests.distributed.workers``): every case runs a packed row sharded
over CP groups of C ranks (C = 2: two groups, C = 4: one) and compares the group's logits, summed loss and
every parameter gradient with the same examples (or pieces) run one by one without CP, in fp32."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from trainer.collate import collate_packed
from trainer.model import VarlenCausalLM, resolve_backend
from trainer.parallel import cp_attention
from trainer.parallel.cp_layout import attention_cost, shard_batch
from trainer.parallel.route import ContextParallelRoute, CPRoute, step_skew

TOL = 1e-5


class Examples:
    """A dataset stand-in: ``example(i)`` -> (token ids, loss mask)."""

    def __init__(self, lengths: list[int], vocab: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.tokens = [rng.integers(1, vocab, n) for n in lengths]

    def example(self, i: int):
        tok = self.tokens[i]
        return tok, np.ones(len(tok), dtype=bool)


def tiny_model(family: str) -> VarlenCausalLM:
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(
                n_layer=2,
                n_embd=32,
                n_head=4,
                n_positions=256,
                vocab_size=97,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    else:  # GQA, layer 1 a sliding-window layer of 5 tokens
        model = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=97,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=256,
                use_sliding_window=True,
                sliding_window=5,
                max_window_layers=1,
                layer_types=["full_attention", "sliding_attention"],
                tie_word_embeddings=False,
            )
        )
    return VarlenCausalLM(model.float(), resolve_backend("sdpa_varlen", torch.device("cpu")))


def grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def reference(model, data: Examples, items) -> tuple[torch.Tensor, float, dict]:
    """Logits (row order), summed loss and gradients of every item run alone."""
    model.zero_grad(set_to_none=True)
    logits, total = [], 0.0
    for item in items:
        batch = collate_packed(data, np.asarray([item]))
        logits.append(model(**batch.model_inputs())[0].detach())
        loss = model.token_loss(**batch.model_inputs(), labels=batch.labels)
        loss.backward()
        total += float(loss.detach())
    return torch.cat(logits), total, grads(model)


def context_parallel(model, data: Examples, items, cp: int, split: str, group) -> tuple[torch.Tensor, float, dict]:
    """The CP group's logits (row order), summed loss and summed gradients of the same items as one row."""
    model.zero_grad(set_to_none=True)
    row = collate_packed(data, np.asarray(items))
    local = shard_batch(row, cp, dist.get_rank(group), split, group, "sdpa_varlen")
    logits = model(**local.model_inputs())[0].detach()
    loss = model.token_loss(**local.model_inputs(), labels=local.labels)
    loss.backward()
    g = grads(model)
    for t in g.values():
        dist.all_reduce(t, group=group)
    parts = [torch.empty_like(logits) for _ in range(cp)]
    dist.all_gather(parts, logits.contiguous(), group=group)
    index = [torch.empty_like(local.shard.index) for _ in range(cp)]
    dist.all_gather(index, local.shard.index, group=group)
    full = torch.zeros(int(row.cu_seqlens[-1]), logits.shape[-1])
    for part, idx in zip(parts, index, strict=True):
        full[idx[idx >= 0]] = part[idx >= 0]
    total = torch.tensor([float(loss)], dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return full, float(total), g


def pieces_of(lengths: list[int], cut: int) -> list[list[int]]:
    """``bfd_split``-like pieces: each example cut every ``cut`` tokens."""
    return [[e, s, min(n, s + cut)] for e, n in enumerate(lengths) for s in range(0, n, cut)]


CASES = {
    # name: (lengths, items or None for whole examples)
    "one_example_divisible": ([48], None),
    "one_example_not_divisible": ([37], None),
    "fifty_short": ([int(x) for x in np.random.default_rng(3).integers(1, 6, 50)], None),
    "start_on_last_slot": ([7, 9, 8], None),  # 24 tokens: an example starts on a rank's last slot (cp=4: 6/rank)
    "one_token_at_boundary": ([6, 1, 5, 12], None),
    "window_crossing_ranks": ([3, 29, 4], None),
    "bfd_split_pieces": ([30, 11], "pieces"),
    "row_shorter_than_cp": ([1, 2], None),
    "filler": ([1], None),
}


def run_cases(cache: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = {c: [dist.new_group(list(range(g, g + c))) for g in range(0, world, c)] for c in (2, 4)}
    results = {}
    for family in ("gpt2", "qwen2"):
        model = tiny_model(family)
        for name, (lengths, how) in CASES.items():
            data = Examples(lengths, 97, seed=len(results))
            items = pieces_of(lengths, 8) if how == "pieces" else list(range(len(lengths)))
            ref_logits, ref_loss, ref_grads = reference(model, data, items)
            for cp in (2, 4):
                group = groups[cp][rank // cp]
                for split in ("contiguous", "balanced"):
                    logits, loss, g = context_parallel(model, data, items, cp, split, group)
                    worst = max(float((g[n] - ref_grads[n]).abs().max()) for n in g)
                    results[f"{family}/{name}/cp{cp}/{split}"] = {
                        "logits": float((logits - ref_logits).abs().max()),
                        "loss": abs(loss - ref_loss) / max(abs(ref_loss), 1.0),
                        "grad": worst,
                    }
    results |= step_skew_cases(groups)
    results |= self_check_cases(groups)
    results |= eval_cases(groups)
    results |= composition_cases(groups)
    return results


def composition_cases(groups) -> dict:
    """cp=2 composed with activation checkpointing (the K/V all-gather runs again in the recompute) and LoRA
    (adapter gradients), each against the same examples one by one. (Compile is not here: 4 ranks compiling
    on this 2-core machine took 130 s of the launch.)"""
    from trainer.config import ModelConfig, ParallelConfig, PeftConfig
    from trainer.model.lora import apply_peft
    from trainer.parallel import apply_activation_checkpointing

    rank, out, cp = dist.get_rank(), {}, 2
    group = groups[cp][rank // cp]
    rows = [[23, 4, 9], [31, 2]]

    def compare(model, name, lengths, seed):
        data = Examples(lengths, 97, seed=seed)
        items = list(range(len(lengths)))
        ref_logits, ref_loss, ref_grads = reference(model, data, items)
        logits, loss, g = context_parallel(model, data, items, cp, "balanced", group)
        out[name] = {
            "logits": float((logits - ref_logits).abs().max()),
            "loss": abs(loss - ref_loss) / max(abs(ref_loss), 1.0),
            "grad": max(float((g[n] - ref_grads[n]).abs().max()) for n in g),
        }

    model = tiny_model("qwen2")
    apply_activation_checkpointing(model.decoder_layers(), ParallelConfig(activation_checkpointing="full"))
    calls, gather = [], cp_attention.gather_tokens
    cp_attention.gather_tokens = lambda x, grp: calls.append(torch.is_grad_enabled()) or gather(x, grp)
    try:
        compare(model, "compose/activation_checkpointing", rows[0], 21)
    finally:
        cp_attention.gather_tokens = gather
    # two forwards (logits, loss) x 2 layers x (K, V), plus the loss forward's recompute in backward
    out["compose/activation_checkpointing"]["no_recompute_gather"] = float(calls.count(True) != 3 * 2 * 2)

    model = apply_peft(tiny_model("qwen2"), PeftConfig(method="lora", rank=4), ModelConfig(family="qwen2"), seed=0)
    with torch.no_grad():  # B starts at zero: give the adapters a non-trivial state
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    compare(model, "compose/lora", rows[1], 22)
    return out


def eval_cases(groups) -> dict:
    """Packed eval under cp: rows of cp x budget dealt to the data-parallel groups and sharded over each group
    give the eval loss of cp=1, and no rank runs more than its shard of a row."""
    from trainer.evaluate import evaluate

    lengths = [int(x) for x in np.random.default_rng(5).integers(1, 60, 24)]
    data = Examples(lengths, 97, seed=13)
    data.lengths = np.asarray(lengths)
    model = tiny_model("gpt2")
    seen = []
    model.model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    budget, out = 64, {}
    ref = evaluate(model, data, budget, torch.device("cpu"))["eval_loss"]
    for cp in (2, 4):
        seen[:] = []
        route = ContextParallelRoute(cp, "balanced", group=groups[cp][dist.get_rank() // cp], kernel="sdpa_varlen")
        loss = evaluate(model, data, cp * budget, torch.device("cpu"), route=route)["eval_loss"]
        out[f"eval/cp{cp}"] = {"loss": abs(loss - ref), "unsharded": float(max(seen) > 1.5 * budget)}
    return out


def self_check_cases(groups) -> dict:
    """The startup self-check on the CP route (``CPRoute``): the check row sharded over the real group passes
    (logits and gradients vs one by one), and a CP attention that reads the wrong keys is caught."""
    from trainer.model.certification import measure

    rank, out = dist.get_rank(), {}
    lengths = [29, 1, 6, 3]
    data = Examples(lengths, 97, seed=11)
    row = collate_packed(data, np.arange(len(lengths)))
    model = tiny_model("qwen2")
    gather = cp_attention.gather_tokens
    for cp in (2, 4):
        group = groups[cp][rank // cp]
        route = CPRoute(model, cp, dist.get_rank(group), "balanced", group, "sdpa_varlen")
        good = measure(model, row, route=route)
        cp_attention.gather_tokens = lambda x, group: gather(x, group).flip(2)  # keys of the wrong tokens
        try:
            broken = measure(model, row, route=route)
        finally:
            cp_attention.gather_tokens = gather
        out[f"self_check/cp{cp}"] = {
            "failed": float(not good.ok),
            "broken_passed": float(broken.ok),
            "grad_gap": good.grad_gap if good.grad_gap < 1e-4 else 1.0,
        }
    return out


def step_skew_cases(groups) -> dict:
    """The step metrics' ``cp_skew``: one all-reduce gives each group's attention-cost skew, counted once per
    group; it must equal the layout's own cost of the row (both groups hold the same row here)."""
    rank, out = dist.get_rank(), {}
    lengths = [37, 5, 3]
    row = collate_packed(Examples(lengths, 97, seed=9), np.arange(len(lengths)))
    for cp in (2, 4):
        for split in ("contiguous", "balanced"):
            group = groups[cp][rank // cp]
            local = shard_batch(row, cp, dist.get_rank(group), split, group, "sdpa_varlen")
            cost = attention_cost(lengths, cp, split)
            skew = step_skew([local, local], cp, torch.device("cpu"))  # two micro-batches: the same skew
            out[f"step_skew/cp{cp}/{split}"] = {"err": abs(skew - (cost.max() / cost.mean() - 1))}
            if split == "contiguous":
                out[f"step_skew/cp{cp}/{split}"]["not_trivial"] = float(skew < 0.05)  # contiguous is skewed
    return out
