"""Exact resume, resharding and restart after a killed rank, on 2 gloo ranks (CPU, fp32, dropout on).

One uninterrupted 10-step run is the reference (session fixture in conftest.py); every other run must match it bitwise
or load its checkpoints exactly. Dropout is on, so the RNG states must be restored too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.conftest import launch, overrides
from trainer.checkpoint import complete_checkpoints, read_full_tensors

pytestmark = pytest.mark.slow


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


def assert_tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs: max diff {(a[key] - b[key]).abs().max()}"


def checkpoint_as_dump(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors keyed like the harness's dumps (``model/<fqn>``, ``optim/<fqn>/<state>``)."""
    out = {}
    for key, value in read_full_tensors(path).items():
        group, _, rest = key.partition(".")
        if group == "model":
            out[f"model/{rest}"] = value
        else:
            fqn, _, state = rest.rpartition(".")
            out[f"optim/{fqn}/{state}"] = value
    return out


def test_reference_checkpoints_are_complete(reference):
    names = [p.name for p in complete_checkpoints(reference / "run" / "checkpoints")]
    assert names == ["step_00000003", "step_00000006", "step_00000009", "step_00000010"]


def test_stop_at_6_then_resume_to_10_is_bitwise_equal(reference, tmp_path, cache_dir):
    run = tmp_path / "run"
    launch(tmp_path / "first", overrides(cache_dir, run_dir=run, stop_after_steps=6))
    assert complete_checkpoints(run / "checkpoints")[-1].name == "step_00000006"
    launch(tmp_path / "second", overrides(cache_dir, run_dir=run, resume="auto"))

    ref_losses, got = losses(reference / "run"), losses(run)
    assert sorted(got) == list(range(1, 11))
    assert [got[s] for s in range(7, 11)] == [ref_losses[s] for s in range(7, 11)]
    assert_tensors_equal(
        load_file(tmp_path / "second" / "final.safetensors"), load_file(reference / "out" / "final.safetensors")
    )
    second = json.loads((tmp_path / "second" / "result.json").read_text())
    assert second["resumed_step"] == 6


def test_killed_rank_restarts_and_ends_like_the_uninterrupted_run(reference, tmp_path, cache_dir):
    """torchrun --max-restarts 1; rank 1 SIGKILLs itself after step 8 (checkpoint at 6). The restarted attempt
    finds the first attempt's run dir through the rendezvous id, resumes at 6 and ends at 10."""
    outputs = tmp_path / "outputs"
    args = overrides(cache_dir, output_root=outputs, name="fault", resume="auto")
    launch(tmp_path / "out", args, env={"PFTEST_KILL": "1:8"}, torchrun_args=["--max-restarts=1"])

    run_dirs = [p for p in (outputs / "fault").iterdir() if not p.name.startswith(".")]
    assert len(run_dirs) == 1, f"the restart must reuse the run dir, found {run_dirs}"
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["resumed_step"] == 6, "the restarted attempt did not resume from the step-6 checkpoint"
    ref_losses, got = losses(reference / "run"), losses(run_dirs[0])
    assert sorted(got) == list(range(1, 11))
    assert got[10] == ref_losses[10]
    assert_tensors_equal(
        load_file(tmp_path / "out" / "final.safetensors"), load_file(reference / "out" / "final.safetensors")
    )


def test_reshard_2_to_1_to_2_loads_parameters_and_optimizer_exactly(reference, tmp_path, cache_dir):
    source = reference / "run" / "checkpoints" / "step_00000006"
    expected = checkpoint_as_dump(source)
    env = {"PFTEST_DUMP_AFTER_RESUME": "1"}

    # 2 -> 1
    one = tmp_path / "one"
    launch(tmp_path / "out1", overrides(cache_dir, run_dir=one, resume=source, max_steps=8), nproc=1, env=env)
    assert_tensors_equal(load_file(tmp_path / "out1" / "after_resume.safetensors"), expected)
    # 1 -> 2, from the checkpoint the 1-rank run saved right after loading, onto an HSDP mesh (2 replicas x
    # 1 shard): DCP reshards into any mesh; the run then saves HSDP checkpoints at steps 6 and 8.
    resaved = one / "checkpoints" / "step_00000006"
    assert_tensors_equal(checkpoint_as_dump(resaved), expected)
    two = overrides(cache_dir, run_dir=tmp_path / "two", resume=resaved, max_steps=8, **{"parallel.dp_replicate": 2})
    launch(tmp_path / "out2", two, env=env)
    assert_tensors_equal(load_file(tmp_path / "out2" / "after_resume.safetensors"), expected)

    sampler_errors = [json.loads((tmp_path / d / "result.json").read_text())["sampler_error"] for d in ("out1", "out2")]
    assert sampler_errors == [None, None]
    # The data continues on the new world size: both runs trained steps 7 and 8, on examples that steps 1-6
    # of the 2-rank run never saw. (That every remaining bin is served exactly once on the new world size
    # is the sampler's own contract, tested in tests/unit/test_sampler.py.)
    assert sorted(losses(one)) == [7, 8] and sorted(losses(tmp_path / "two")) == [7, 8]
    assert [p.name for p in complete_checkpoints(tmp_path / "two" / "checkpoints")] == [
        "step_00000006",
        "step_00000008",
    ]
    seen = {i for step, ids in reference_examples(reference).items() if int(step) <= 6 for i in ids}
    for out in ("out1", "out2"):
        later = [
            i for ids in json.loads((tmp_path / out / "result.json").read_text())["examples"].values() for i in ids
        ]
        assert later and not seen & set(later), f"{out}: examples of steps 1-6 repeated after the reshard"


def reference_examples(reference: Path) -> dict[str, list[int]]:
    return json.loads((reference / "out" / "result.json").read_text())["examples"]
