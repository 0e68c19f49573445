"""The chunked loss under FSDP2 on 2 gloo ranks equals the naive loss on one process (train and eval).

One torchrun launch runs every case (tests/distributed/chunked_loss_worker.py, with the other workers).
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import worker_cases

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cases(worker_results):
    return worker_cases(worker_results, "chunked_loss_worker")


@pytest.mark.parametrize("name", ["tied_fp32", "untied_fp32"])
def test_fp32_chunked_under_fsdp_matches_naive_one_process(cases, name):
    case = cases[name]
    assert case["loss_line"] == "chunked (torch)" and case["head_sharded"], case
    assert case["max_grad_diff"] < 1e-6, case
    assert case["loss_rel_diff"] < 1e-6, case  # a sum of ~1e4 fp32 token losses
    assert case["eval_diff"] < 1e-6, case


def test_bf16_mixed_precision_is_close(cases):
    case = cases["tied_bf16"]
    assert case["max_grad_diff"] < 5e-3 and case["eval_diff"] < 2e-2, case
