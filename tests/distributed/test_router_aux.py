"""The router aux loss under FSDP2 on 2 gloo ranks (``trainer.router_aux``): a step of micro-batches spread over
the ranks trains what one process trains on all of them (tests/distributed/router_aux_worker.py, in the shared
torchrun launch)."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import worker_cases

pytestmark = pytest.mark.slow


def test_two_ranks_train_the_one_process_objective_and_gradients(worker_results):
    case = worker_cases(worker_results, "router_aux_worker")["fp32"]
    assert case["aux"] > 1.0 and case["router_grad_norm"] > 0, case
    assert case["objective_rel_diff"] < 1e-6 and case["aux_rel_diff"] < 1e-6, case
    assert case["max_grad_diff"] < 1e-6, case
