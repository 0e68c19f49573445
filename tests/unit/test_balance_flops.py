"""``packing.balance=flops``: bins dealt to data-parallel ranks by each example's model FLOPs (the matmuls'
linear term and causal attention's quadratic one, one ``TokenCost`` shared with the step's ``model_flops``)."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.config import PackingConfig
from trainer.data.synthetic import heavy_tailed_lengths
from trainer.packing import MicroBatchSampler, TokenCost, work_measure

COST = TokenCost(per_token=3.0e9, per_pair=1.3e5)  # Qwen2.5-0.5B-like: attention matches the matmuls at ~23k tokens


def _flops_skew(lengths: np.ndarray, balance: str, world: int = 8) -> float:
    cfg = PackingConfig(strategy="bfd", token_budget=32768, balance=balance)
    sampler = MicroBatchSampler(lengths, cfg, 0, world, seed=0, cost=COST)
    return sampler.balance_report(0, weight=lambda b: float(COST.of(lengths[b]).sum()))["skew"]


def test_flops_weighs_both_terms_and_needs_the_model_cost():
    sizes = np.array([1, 100, 10_000])
    assert np.allclose(work_measure("flops", COST)(sizes), 3.0e9 * sizes + 1.3e5 * sizes.astype(float) ** 2)
    with pytest.raises(ValueError, match="packing.balance=flops needs the model's FLOP sizes"):
        MicroBatchSampler(sizes, PackingConfig(token_budget=20_000, balance="flops"), 0, 1, seed=0)


def test_flops_balances_flops_better_than_tokens_or_attention_on_long_tailed_rows():
    lengths = heavy_tailed_lengths(6000, seed=2, scale=512, cap=32768)
    skew = {m: _flops_skew(lengths, m) for m in ("flops", "tokens", "attention")}
    assert skew["flops"] < skew["tokens"] / 3  # measured 1.2% vs 21.7% at W=16 (docs/packing.md)
    assert skew["flops"] <= skew["attention"]


def test_the_cost_comes_from_the_model_config_and_matches_the_step_flops():
    """Built on the meta device from the config alone, the same numbers the trained model gives; and a step's
    ``model_flops`` is the sum of its examples' ``TokenCost``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer.throughput import config_flop_params, flop_params, model_flops, token_cost

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=256)
    sizes = config_flop_params(config)
    assert sizes == flop_params(GPT2LMHeadModel(config))
    lengths = np.array([7, 120, 33])
    cost = token_cost(sizes)
    assert model_flops(lengths.sum(), (lengths**2).sum(), sizes) == pytest.approx(cost.of(lengths).sum())


def test_a_resume_under_another_model_cost_is_refused():
    """The deal depends on the model's sizes under flops: the sampler's fingerprint carries them."""
    lengths = heavy_tailed_lengths(500, seed=1, scale=64, cap=4096)
    cfg = PackingConfig(token_budget=4096, balance="flops")
    saved = MicroBatchSampler(lengths, cfg, 0, 2, seed=0, cost=COST).state_dict()
    MicroBatchSampler(lengths, cfg, 0, 2, seed=0, cost=COST).load_state_dict(saved)
    with pytest.raises(ValueError, match="different packing config"):
        MicroBatchSampler(lengths, cfg, 0, 2, seed=0, cost=TokenCost(1.0, 1.0)).load_state_dict(saved)


def test_the_pipeline_gives_the_sampler_the_models_cost(cache_dir):
    """``packing.balance=flops`` in a run's config: the trainer and the tools deal with the model's own sizes."""
    from trainer.compose import compose_job_config
    from trainer.pipeline import build_training_data

    cfg = compose_job_config(
        ["recipe=cpu_long_context", "packing.balance=flops", f"data.cache_dir={cache_dir}", "data.num_records=200"]
    )
    data = build_training_data(cfg)
    assert data.sampler.cost is not None and data.sampler.cost.per_pair == 6.0 * 2 * 128  # gpt2_tiny: 2 x 128
    assert data.sampler.microbatches_per_rank(0) > 0


def test_under_lora_every_base_weight_counts_as_frozen():
    """LoRA: the base's matmuls cost forward + activation gradient (4 per parameter and token), not 6."""
    from trainer.compose import compose_job_config
    from trainer.data import load_tokenizer
    from trainer.pipeline import balance_cost

    cfg = compose_job_config(["recipe=cpu_chat_lora", "packing.balance=flops"])
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    lora = balance_cost(cfg, tokenizer)
    full = balance_cost(compose_job_config(["recipe=cpu_chat_sft", "packing.balance=flops"]), tokenizer)
    assert lora.per_token == pytest.approx(full.per_token * 4 / 6) and lora.per_pair == full.per_pair
