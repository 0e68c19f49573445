"""Items 1, 2, 3 and 8 on two gloo ranks: faults injected on one rank are handled by both, nothing hangs.

Each case is a real ``torchrun`` job (a few seconds each); a hang would hit the subprocess timeout.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import run_torchrun
from tests.faults.conftest import SMALL_RUN

pytestmark = pytest.mark.slow


def _job(tmp_path, fault: str, *overrides: str, timeout: float = 180):
    return run_torchrun(
        ["-m", "tests.faults.fault_entry", *SMALL_RUN, f"run_dir={tmp_path}", *overrides],
        env={"PFTEST_FAULT": fault},
        timeout=timeout,
    )


def _lines(out, prefix: str) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.startswith(prefix)]


def test_skipped_steps_are_collective_then_a_diverged_run_stops(tmp_path):
    """NaN loss on rank 1 only, no label anywhere, NaN gradient on rank 0 only: each skipped on both ranks
    and logged; then two NaN steps in a row with ``max_consecutive_skips=2`` stop both ranks at step 5 with
    one line each naming the step (``guard.nonfinite=stop`` takes the same path at the first NaN step; see
    test_step_guard.py)."""
    out = _job(
        tmp_path,
        "nan_loss@2:1,no_labels@3,nan_grad@4:0,nan_loss@5:0",
        "guard.nonfinite=skip",
        "guard.max_consecutive_skips=2",
    )
    assert out.returncode != 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [None, "nonfinite", "no_labels", "nonfinite"]
    assert math.isfinite(records[0]["loss"]) and records[2]["useful_tokens"] == 0
    for rank in ("", "rank 1 "):  # both ranks log each skip
        assert f"[{rank}WARNING] step 2: rank 0: gradient norm not finite; rank 1: loss and gradient norm" in out.stdout
        assert f"[{rank}WARNING] step 3: no label token on any rank" in out.stdout
        assert f"[{rank}WARNING] step 4: rank 0: gradient norm not finite; rank 1: gradient norm" in out.stdout
    stops = _lines(out, "packfsdp: rank")
    assert len(stops) == 2, out.stderr[-3000:]
    assert all("stopped: step 5:" in s and "2 non-finite steps in a row" in s for s in stops)


def test_out_of_memory_on_one_rank_ends_the_job_on_every_rank(tmp_path):
    # The behaviour, not a wall-clock bound (which flaked under load): with a collective timeout (900 s) past
    # the subprocess timeout (600 s), a survivor that waited for it fails the test by TimeoutExpired, and its
    # line below names rank 1's failure, not a timeout.
    out = _job(tmp_path, "oom@2:1", "guard.collective_timeout_s=900", timeout=600)
    assert out.returncode != 0
    (own,) = _lines(out, "packfsdp: rank 1:")
    assert own.startswith("packfsdp: rank 1: out of memory at step 2:") and "packing.token_budget" in own
    (peer,) = _lines(out, "packfsdp: rank 0:")
    assert peer.startswith("packfsdp: rank 0: stopping at step 2 because rank 1 failed: out of memory"), peer
    assert "traceback : rank 1: out of memory at step 2" in out.stderr  # torchrun's root-cause summary
    assert "Timed out" not in out.stderr


def test_a_rank_that_stops_answering_fails_the_job_within_the_timeout(tmp_path):
    # 10 s: long enough that a slow start on a loaded machine is not read as the hang; a job that ignored the
    # timeout would run into the subprocess timeout (180 s) instead of printing the line below.
    out = _job(tmp_path, "hang@2:1", "guard.collective_timeout_s=10")
    assert out.returncode != 0
    (line,) = _lines(out, "packfsdp: rank 0:")
    assert "a collective failed at step 2 (guard.collective_timeout_s=10)" in line and "Timed out" in line, line
