"""Item 3: work only rank 0 does fails on every rank when it fails on rank 0, and ranks that disagree on the
number of steps fail together before the first step, instead of one rank waiting in a collective forever.

Two gloo processes spawned directly (no torchrun, no trainer): about a second of work.
"""

from __future__ import annotations

import pytest
import torch.distributed as tdist
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow


def _worker(rank: int, store_path: str, results) -> None:
    import torch

    from trainer import distributed

    # A file store, not a TCP port picked beforehand (another job on the machine can take it in between).
    # A long timeout: a failing assertion below must come from on_rank0_then_all, not from the timeout.
    store = tdist.FileStore(store_path, 2)
    tdist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=60)
    )
    out, cpu = {}, torch.device("cpu")

    def build():
        raise OSError("disk full while writing the cache")

    try:
        distributed.on_rank0_then_all(build)
    except Exception as e:  # noqa: BLE001
        out["rank0_work"] = (type(e).__name__, str(e))
    try:
        distributed.check_same_on_all_ranks(
            {"the number of examples": 5, "the number of optimizer steps": 10 + rank}, cpu
        )
    except RuntimeError as e:
        out["disagree"] = str(e)
    distributed.check_same_on_all_ranks({"the number of optimizer steps": 7}, cpu)  # agreement: no error
    results[rank] = out
    tdist.destroy_process_group()


def test_rank0_failure_and_step_disagreement_fail_every_rank(tmp_path):
    results = mp.Manager().dict()
    # fork: the children reuse this process's imports (spawn would re-import torch in each, ~10 s here).
    mp.start_processes(_worker, args=(str(tmp_path / "store"), results), nprocs=2, join=True, start_method="fork")
    kind0, msg0 = results[0]["rank0_work"]
    kind1, msg1 = results[1]["rank0_work"]
    assert (kind0, msg0) == ("OSError", "disk full while writing the cache")
    assert (kind1, msg1) == (kind0, msg0)  # rank 1 raises rank 0's error
    # No wall-clock bound on the wait (it flaked under load): a rank 1 that timed out would raise the store's
    # timeout error, not rank 0's message, which the line above asserts.
    for rank in (0, 1):
        assert results[rank]["disagree"].startswith(
            "ranks disagree on the number of optimizer steps: between 10 and 11"
        )
