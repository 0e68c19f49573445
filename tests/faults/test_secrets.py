"""Item 7: API keys never appear in logs, saved configs, the summary or wandb's files.

A fake WANDB_API_KEY and HF_TOKEN sit in the environment, and the hub token is even passed on the command
line into the config (the way a key leaks in practice: pasted into an override); a short run with wandb
(offline) must not write either anywhere.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.faults.conftest import SMALL_RUN
from trainer.safety import RedactingFilter, redact, redact_argv, redact_tree

FAKE_WANDB = "0123456789abcdef0123456789abcdef01234567"
FAKE_HF = "hf_FakeTokenForPackfsdpTests1234567890"


def test_redaction_rules(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_WANDB)
    monkeypatch.setenv("MY_SERVICE_SECRET", "s3cr3t-value")
    text = f"key={FAKE_WANDB} url=https://user:pw123@host/x other=s3cr3t-value tok=hf_abcdefghijklmnopqrstuvwxyz"
    assert redact(text) == "key=*** url=https://***@host/x other=*** tok=***"
    tree = {"model": {"config_overrides": {"hub_token": "abc", "n_layer": 2}, "name_or_path": f"x/{FAKE_WANDB}"}}
    assert redact_tree(tree) == {
        "model": {"config_overrides": {"hub_token": "***", "n_layer": 2}, "name_or_path": "x/***"}
    }
    assert redact_argv(["x=1", "+model.config_overrides.hub_token=abc", f"y={FAKE_WANDB}"]) == [
        "x=1",
        "+model.config_overrides.hub_token=***",
        "y=***",
    ]
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "logged in with %s", (FAKE_WANDB,), None)
    RedactingFilter().filter(record)
    assert record.getMessage() == "logged in with ***"


@pytest.mark.slow
def test_no_key_in_logs_saved_config_summary_or_wandb_files(tmp_path):
    env = {"WANDB_API_KEY": FAKE_WANDB, "HF_TOKEN": FAKE_HF, "WANDB_MODE": "offline"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            *SMALL_RUN,
            "max_steps=2",
            "logger=wandb",
            f"run_dir={tmp_path}",
            f"+model.config_overrides.hub_token={FAKE_HF}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=__import__("os").environ | env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "summary.json").is_file()
    assert "hub_token: '***'" in (tmp_path / "config.yaml").read_text()
    assert any(tmp_path.rglob("wandb/*")), "wandb wrote nothing: the test would prove nothing"
    for key in (FAKE_WANDB, FAKE_HF):
        assert key not in out.stdout and key not in out.stderr
        for path in tmp_path.rglob("*"):
            if path.is_file():
                assert key.encode() not in path.read_bytes(), f"{key[:6]}... leaked into {path}"
