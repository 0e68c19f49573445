"""Context parallelism on 4 gloo ranks: one launch runs every case of ``context_parallel_worker`` (GPT-2 and a
Qwen2-like model with GQA and a sliding-window layer; cp=2 and cp=4; contiguous and balanced splits) and each
must equal its examples run one by one: logits, summed loss and every gradient, fp32, 1e-5."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.slow


def test_context_parallel_equals_one_by_one(tmp_path):
    proc = run_torchrun(
        ["-m", "tests.distributed.workers", str(tmp_path), str(tmp_path / "cache"), "context_parallel_worker"], nproc=4
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "context_parallel_worker.json").read_text())
    assert (
        len(results) == 2 * 9 * 2 * 2 + 4 + 2 + 2 + 2
    )  # families x cases x cp x splits; step skew; self-check; eval; compositions
    bad = {name: r for name, r in results.items() if max(r.values()) > 1e-5}
    assert not bad, bad
