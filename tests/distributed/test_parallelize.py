"""Every parallelize() option on 2 gloo ranks: gradients of one global batch equal the single-process ones.

One torchrun launch runs all cases (tests/distributed/parallel_worker.py, with the other workers); each
test reads its case.
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import worker_cases

pytestmark = pytest.mark.slow

FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def cases(worker_results):
    return worker_cases(worker_results, "parallel_worker")


@pytest.mark.parametrize(
    "name", ["fsdp", "hsdp_2x1", "hsdp_1x2", "ac_full", "ac_every_2", "cpu_offload", "no_reshard", "compile_ac"]
)
def test_fp32_gradients_match_one_process(cases, name):
    """1 process with the whole global batch vs 2 ranks with half each: the loss normalization (global
    label count, summed gradients) makes them the same objective."""
    case = cases[name]
    assert case["max_grad_diff"] < FP32_TOL, case
    assert case["loss_diff"] < 1e-4, case


def test_mesh_shapes_and_placements(cases):
    assert cases["fsdp"]["mesh_shape"] == [2] and cases["fsdp"]["placements"] == ["S(0)"]
    assert cases["hsdp_2x1"]["mesh_shape"] == [2, 1] and cases["hsdp_2x1"]["placements"] == ["R", "S(0)"]
    assert cases["hsdp_1x2"]["mesh_shape"] == [1, 2] and cases["hsdp_1x2"]["placements"] == ["R", "S(0)"]


def test_activation_checkpointing_recomputes_the_chosen_blocks(cases):
    # 3 blocks, 2 micro-batches per rank: 6 attention forwards, plus one recompute per checkpointed block.
    assert cases["fsdp"]["attn_calls"] == 6
    assert cases["ac_full"]["attn_calls"] == 12  # blocks 0, 1, 2
    assert cases["ac_every_2"]["attn_calls"] == 10  # blocks 0, 2


def test_compile_traced_the_blocks(cases):
    assert cases["compile_ac"]["graphs"] > 0 and cases["fsdp"]["graphs"] == 0


def test_mixed_precision_policy(cases):
    case = cases["bf16_mixed"]
    assert case["logits_dtype"] == "torch.float32"  # output_dtype on the root
    assert case["max_grad_diff"] < 5e-3  # bf16 compute, fp32 reduce: close, not exact
