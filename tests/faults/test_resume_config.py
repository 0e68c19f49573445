"""Issue 14, bullet 3: a checkpoint stores its job config; a resume that changes what is trained is refused
naming the keys (unless ``resume_allow_changes`` names them), harmless keys pass, and a world-size change
says what happens to tokens per step."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

import pytest

from tests.conftest import compose_job
from tests.faults.conftest import SMALL_RUN, train_process
from tests.unit.test_checkpoint import make_state
from trainer.checkpoint import Checkpointer
from trainer.checkpoint.config_check import JOB_CONFIG
from trainer.config import CheckpointConfig, ConfigError
from trainer.safety import redact_tree


def job_config(*overrides: str) -> dict:
    return redact_tree(asdict(compose_job([*SMALL_RUN, *overrides])))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("resume_config")
    checkpointer = Checkpointer(CheckpointConfig(), directory, run_id="r", job_config=job_config())
    return checkpointer.save(3, make_state(), tokens_seen=30, total_steps=50)


def check(path, *overrides: str, allow=(), grad_accum: int = 1) -> None:
    checker = Checkpointer(CheckpointConfig(), path.parent.parent, run_id="r", job_config=job_config(*overrides))
    checker.check_config(path, list(allow), grad_accum)


def test_the_checkpoint_stores_the_job_config(checkpoint):
    assert json.loads((checkpoint / JOB_CONFIG).read_text())["data"]["loss_on"] == "auto"


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["data.loss_on=all"], "data.loss_on: 'auto' -> 'all'"),
        (["grad_accum=2"], "grad_accum: 1 -> 2"),
        (["model.config_overrides.n_embd=64"], "model.config_overrides.n_embd: 32 -> 64"),
        (["optim.lr=0.5", "packing.token_budget=512"], "optim.lr: 0.001 -> 0.5; packing.token_budget: 256 -> 512"),
    ],
)
def test_a_change_of_the_math_is_refused_naming_the_keys(checkpoint, overrides, named):
    with pytest.raises(ConfigError, match="changes what is trained") as info:
        check(checkpoint, *overrides, grad_accum=2 if "grad_accum=2" in overrides else 1)
    assert named in str(info.value) and "resume_allow_changes=[" in str(info.value)
    keys = [o.split("=")[0] for o in overrides]
    check(checkpoint, *overrides, allow=keys)  # accepted when named


def test_harmless_keys_pass(checkpoint):
    check(
        checkpoint,
        "max_steps=80",
        "logger.log_every=5",
        "eval.every=3",
        "checkpoint.every_steps=7",
        "checkpoint.every_minutes=5",
        "guard.nonfinite=stop",
        "stop_after_steps=10",
    )


def test_a_world_size_change_says_what_happens_to_tokens_per_step(tmp_path, monkeypatch, caplog):
    saved = Checkpointer(CheckpointConfig(), tmp_path, run_id="r", job_config=job_config("grad_accum=2"))
    path = saved.save(3, make_state(), tokens_seen=30, total_steps=50)  # 1 rank x 2 micro-batches per step
    monkeypatch.setattr(Checkpointer, "__init__", _world(Checkpointer.__init__, 2))
    with caplog.at_level(logging.WARNING):
        check(path, "grad_accum=2", grad_accum=2)
    assert "resume on 2 rank(s), the checkpoint was saved on 1" in caplog.text
    assert "tokens per step change by x2.00" in caplog.text and "grad_accum=1 keeps it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check(path, "grad_accum=1", grad_accum=1)  # the same global batch: accepted without allow_changes
    assert "the global batch is kept" in caplog.text
    with pytest.raises(ConfigError, match="grad_accum: 2 -> 3"):
        check(path, "grad_accum=3", grad_accum=3)


def _world(init, world):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.world_size = world

    return patched


@pytest.mark.slow
def test_resume_with_a_wider_model_is_one_line_naming_the_key(copy_of_finished_run):
    # copy_of_finished_run: a finished 2-step run of SMALL_RUN with its checkpoint
    out = train_process(
        f"run_dir={copy_of_finished_run}",
        "resume=auto",
        "max_steps=4",
        "model.config_overrides.n_embd=64",
        "data.loss_on=all",
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len([line for line in lines if line.startswith("packfsdp:")]) == 1 and "Traceback" not in out.stderr
    (line,) = [line for line in lines if line.startswith("packfsdp:")]
    assert "model.config_overrides.n_embd: 32 -> 64" in line and "data.loss_on: 'auto' -> 'all'" in line


def test_a_renamed_key_in_a_saved_config_is_compared_under_its_new_name():
    from trainer.checkpoint.config_check import check_resume_config

    saved = {"data": {"num_dialogs": 300}}  # written before data.num_records had its name
    check_resume_config(saved, {"data": {"num_records": 300}}, [], 1, 1, "ckpt")
    with pytest.raises(ConfigError, match=r"data.num_records: 300 -> 400"):
        check_resume_config(saved, {"data": {"num_records": 400}}, [], 1, 1, "ckpt")


def test_a_changed_cp_keeping_the_row_is_a_world_change_and_one_changing_it_is_refused_naming_it(caplog):
    """``parallel.cp`` changes the data-parallel world (world / cp): with the same row (cp x token_budget) the
    bins are the same and are re-dealt, as on a world-size change; another row is refused in one line."""
    from trainer.checkpoint.config_check import check_resume_config

    saved = {"grad_accum": 1, "parallel": {"cp": 2}, "packing": {"token_budget": 512}}
    same_row = {"grad_accum": 1, "parallel": {"cp": 1}, "packing": {"token_budget": 1024}}
    with caplog.at_level("WARNING", logger="trainer.checkpoint"):
        check_resume_config(saved, same_row, [], 2, 1, "ckpt")  # 2 ranks, one CP group -> 1 rank: one group
    assert "parallel.cp 2 -> 1 keeps rows of 1024 tokens" in caplog.text
    assert "each optimizer step" not in caplog.text  # one data-parallel group before and after: same batch
    other_row = {"grad_accum": 1, "parallel": {"cp": 1}, "packing": {"token_budget": 512}}
    with pytest.raises(ConfigError, match=r"parallel.cp 2 -> 1 changes the packed row .*packing.token_budget=1024"):
        check_resume_config(saved, other_row, [], 2, 1, "ckpt")
