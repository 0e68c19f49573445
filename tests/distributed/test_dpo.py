"""DPO under FSDP2 on 2 gloo ranks (tests/distributed/dpo_worker.py, in the shared workers launch): the
gradients of the global-pair-normalised loss equal one unsharded process's, full (a live reference sharded
like the policy, frozen) and LoRA (the base with the adapters off), GPT-2 and Qwen2; the precompute pass
stores the live reference's log-probs and leaves the policy sharded."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import worker_cases

pytestmark = pytest.mark.slow


def test_two_ranks_give_the_one_process_dpo_gradients(worker_results):
    cases = worker_cases(worker_results, "dpo_worker")
    precompute = cases.pop("precompute")
    assert precompute["policy_sharded_after"] and precompute["max_logp_rel_diff"] < 1e-2, precompute  # bf16
    assert set(cases) == {"gpt2_full", "gpt2_lora", "qwen2_full", "qwen2_lora"}
    for name, case in cases.items():
        assert case["params"] > 0 and case["reference"] == ("adapters" if "lora" in name else "copy"), (name, case)
        assert case["reference_frozen"] and (case["reference_sharded"] or "lora" in name), (name, case)
        assert case["max_grad_diff"] < 1e-5 and case["loss_diff"] < 1e-4, (name, case)
        assert 0.0 < case["loss"] < 5.0, (name, case)
