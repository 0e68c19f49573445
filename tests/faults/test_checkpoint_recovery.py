"""Issue 14, bullet 7: ``resume=auto`` falls back to the newest checkpoint that verifies (with a warning
naming what failed); stray files in a checkpoint are ignored; step folders left by a kill are cleaned;
``eval.jsonl`` is trimmed like ``metrics.jsonl``; an unwritable checkpoint dir fails at start."""

from __future__ import annotations

import json
import logging

import pytest

from tests.unit.test_checkpoint import distcp_file, make_state, saved
from trainer.checkpoint import Checkpointer, complete_checkpoints
from trainer.checkpoint.ownership import write_marker
from trainer.config import CheckpointConfig, ConfigError
from trainer.metrics import trim_metrics


def test_resume_auto_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path, caplog):
    checkpointer, _ = saved(tmp_path, steps=(2, 4))
    damaged = distcp_file(checkpointer.dir / "step_00000004")
    raw = bytearray(damaged.read_bytes())
    raw[-200] ^= 0x01
    damaged.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        path = Checkpointer(CheckpointConfig(), tmp_path).resolve("auto")
    assert path.name == "step_00000002"
    assert "skipping step_00000004, it does not verify" in caplog.text and "SHA-256" in caplog.text
    assert Checkpointer(CheckpointConfig(), tmp_path).load(path, make_state(), total_steps=10).step == 2


def test_a_stray_file_in_a_checkpoint_is_ignored(tmp_path):
    checkpointer, _ = saved(tmp_path, steps=(3,))
    (checkpointer.dir / "step_00000003" / "notes.txt").write_text("copied here by hand")
    path = checkpointer.resolve("auto")
    assert path.name == "step_00000003"
    assert checkpointer.load(path, make_state(), total_steps=10).step == 3


def test_step_folders_left_by_a_kill_are_cleaned_at_the_next_save(tmp_path):
    checkpointer, state = saved(tmp_path, steps=(3,))
    (checkpointer.dir / "step_00000001").mkdir()  # a kill mid-prune: the manifest already gone
    (checkpointer.dir / "step_00000001" / "__0_0.distcp").write_bytes(b"x")
    (checkpointer.dir / "step_00000002.pruned").mkdir()
    for leftover in ("step_00000001", "step_00000002.pruned"):  # packfsdp's marker is written first
        write_marker(checkpointer.dir / leftover, None)
    checkpointer.save(6, state, tokens_seen=6, total_steps=10)
    assert sorted(p.name for p in checkpointer.dir.iterdir()) == ["step_00000003", "step_00000006"]
    assert [p.name for p in complete_checkpoints(checkpointer.dir)] == ["step_00000003", "step_00000006"]


def test_eval_jsonl_is_trimmed_like_metrics_jsonl(tmp_path):
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval_loss": 1.0}) + "\n" for s in (4, 8, 12)))
    trim_metrics(tmp_path, 8)
    assert [json.loads(line)["step"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()] == [4, 8]


def test_an_unwritable_checkpoint_dir_fails_at_start(tmp_path):
    (tmp_path / "a_file").write_text("")
    checkpointer = Checkpointer(CheckpointConfig(dir=str(tmp_path / "a_file" / "checkpoints")), tmp_path)
    with pytest.raises(ConfigError, match="checkpoint dir .* is not writable .*set checkpoint.dir"):
        checkpointer.check_writable()
