"""Checkpoint files without a process group: complete-only saves, manifest checks, safe loading, pruning."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from trainer import checkpoint as ckpt
from trainer.checkpoint import Checkpointer, CheckpointError, TrainingState
from trainer.checkpoint import checkpointer as checkpointer_module
from trainer.checkpoint.manifest import write_manifest
from trainer.checkpoint.safe_load import SafeFileSystemReader
from trainer.config import CheckpointConfig
from trainer.metrics import trim_metrics


class FakeSampler:
    def __init__(self) -> None:
        self.epoch, self.next_index = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "next_index": self.next_index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.next_index = state["epoch"], state["next_index"]


def make_state(seed: int = 0) -> TrainingState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return TrainingState(model, optimizer, scheduler, FakeSampler())


def train_a_little(state: TrainingState, steps: int = 3) -> None:
    for _ in range(steps):
        state.model(torch.randn(5, 4)).square().sum().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.scheduler.step()
    state.sampler.epoch, state.sampler.next_index = 1, 7


def saved(tmp_path: Path, keep_last: int = 3, steps=(3,)) -> tuple[Checkpointer, TrainingState]:
    checkpointer = Checkpointer(CheckpointConfig(keep_last=keep_last), tmp_path)
    state = make_state()
    for step in steps:
        train_a_little(state)
        checkpointer.save(step, state, tokens_seen=100 * step, total_steps=10)
    return checkpointer, state


def test_save_then_load_restores_everything(tmp_path):
    checkpointer, state = saved(tmp_path)
    expected_rand = torch.rand(3)  # the RNG continues from where it was saved
    path = checkpointer.resolve("auto")
    assert path == tmp_path / "checkpoints" / "step_00000003"
    assert sorted(json.loads((path / "manifest.json").read_text())["files"]) == sorted(
        str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != "manifest.json"
    )

    fresh = make_state(seed=1)
    restored = checkpointer.load(path, fresh, total_steps=10)
    assert (restored.step, restored.tokens_seen) == (3, 300)
    for a, b in zip(state.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)
    for pa, pb in zip(state.model.parameters(), fresh.model.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state.optimizer.state[pa][key], fresh.optimizer.state[pb][key])
    assert fresh.scheduler.last_epoch == 3 and fresh.scheduler.get_last_lr() == state.scheduler.get_last_lr()
    assert fresh.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]
    assert fresh.sampler.state_dict() == {"epoch": 1, "next_index": 7}
    assert torch.equal(torch.rand(3), expected_rand)


def test_saving_the_same_step_again_replaces_it(tmp_path):
    checkpointer, state = saved(tmp_path, steps=(3,))
    checkpointer.save(3, state, tokens_seen=999, total_steps=10)
    path = checkpointer.resolve("auto")
    assert json.loads((path / "trainer_state.json").read_text())["tokens_seen"] == 999
    assert [p.name for p in checkpointer.dir.iterdir()] == ["step_00000003"]
    ckpt.verify_checkpoint(path)


def test_keep_last_prunes_older_checkpoints(tmp_path):
    checkpointer, _ = saved(tmp_path, keep_last=2, steps=(1, 2, 3, 4))
    assert [p.name for p in ckpt.complete_checkpoints(checkpointer.dir)] == ["step_00000003", "step_00000004"]


def test_a_crash_during_save_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    checkpointer, state = saved(tmp_path, steps=(3,))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpointer_module, "write_manifest", crash)
    with pytest.raises(CheckpointError, match="disk full"):
        checkpointer.save(6, state, tokens_seen=600, total_steps=10)
    assert (checkpointer.dir / "step_00000006.tmp").is_dir()  # the half-written save is left as .tmp...
    assert checkpointer.resolve("auto").name == "step_00000003"  # ...and never counts
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt.find_checkpoint(checkpointer.dir / "step_00000006.tmp")

    monkeypatch.undo()
    checkpointer.save(6, state, tokens_seen=600, total_steps=10)  # the next save clears the leftover
    assert not (checkpointer.dir / "step_00000006.tmp").exists()
    assert checkpointer.resolve("auto").name == "step_00000006"


def distcp_file(path: Path) -> Path:
    return next(path.glob("*.distcp"))


def test_a_flipped_byte_is_caught_by_the_manifest(tmp_path):
    checkpointer, _ = saved(tmp_path)
    path = checkpointer.resolve("auto")
    data_file = distcp_file(path)
    raw = bytearray(data_file.read_bytes())
    raw[-200] ^= 0x01  # inside tensor data, not a header
    data_file.write_bytes(bytes(raw))

    # DCP alone loads the damaged tensor without a word:
    state = {"model": make_state().model.state_dict()}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
    with pytest.raises(CheckpointError, match=r"does not match its SHA-256"):
        checkpointer.load(path, make_state(), total_steps=10)


def test_a_truncated_or_missing_file_is_caught(tmp_path):
    checkpointer, _ = saved(tmp_path)
    path = checkpointer.resolve("auto")
    data_file = distcp_file(path)
    data_file.write_bytes(data_file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        checkpointer.load(path, make_state(), total_steps=10)
    data_file.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.verify_checkpoint(path)


class Exploit:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pickled_code_in_dcp_metadata_is_refused(tmp_path, capsys):
    checkpointer, _ = saved(tmp_path)
    path = checkpointer.resolve("auto")
    (path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    write_manifest(path, 3)  # even with a matching manifest
    with pytest.raises(CheckpointError, match="builtins.print, which is not allowed"):
        checkpointer.load(path, make_state(), total_steps=10)
    assert "must never run" not in capsys.readouterr().out


def test_resolve_none_auto_and_paths(tmp_path):
    checkpointer = Checkpointer(CheckpointConfig(), tmp_path)
    assert checkpointer.resolve("none") is None
    assert checkpointer.resolve("auto") is None  # nothing yet: a fresh start
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpointer.resolve(str(tmp_path))
    saved(tmp_path, steps=(2, 5))
    assert checkpointer.resolve(str(tmp_path)).name == "step_00000005"  # a run dir
    assert checkpointer.resolve(str(tmp_path / "checkpoints" / "step_00000002")).name == "step_00000002"


def test_trim_metrics_drops_steps_after_the_checkpoint(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in range(1, 9)] + ['{"step": 9, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    trim_metrics(tmp_path, 6)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
