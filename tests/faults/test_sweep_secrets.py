"""Issue 14, bullet 6: a secret passed to a sweep (``-m``) reaches neither ``multirun.yaml``, nor the run
folder's name, ``summary.json`` or the console; and secret matching does not hide settings such as
``token_budget`` or ``tokenizer_vocab_size``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO
from tests.faults.conftest import SMALL_RUN
from trainer.safety import redact, redact_tree, secret_key

SECRET = "s3cretValueForSweeps42"


@pytest.mark.parametrize(
    "key, secret",
    [
        ("token", True),
        ("hub_token", True),
        ("HF_TOKEN", True),
        ("api_key", True),
        ("wandb_api_key", True),
        ("db_password", True),
        ("client_secret", True),
        ("model.config_overrides.hub_token", True),
        ("token_budget", False),
        ("tokenizer_vocab_size", False),
        ("pad_token", False),
        ("max_tokens", False),
        ("cache_key", False),
        ("tokenizer", False),
    ],
)
def test_secret_keys_are_matched_by_name_not_by_substring(key, secret):
    assert secret_key(key) is secret


def test_settings_stay_visible_while_secrets_are_redacted():
    tree = {"packing": {"token_budget": 2048}, "model": {"tokenizer_vocab_size": 4096, "hub_token": SECRET}}
    assert redact_tree(tree) == {
        "packing": {"token_budget": 2048},
        "model": {"tokenizer_vocab_size": 4096, "hub_token": "***"},
    }
    assert redact(f"#0 : +model.config_overrides.hub_token={SECRET} packing.token_budget=256") == (
        "#0 : +model.config_overrides.hub_token=*** packing.token_budget=256"
    )


@pytest.mark.slow
def test_a_sweep_leaks_no_secret(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            "-m",
            *SMALL_RUN,
            "max_steps=1",
            f"output_root={tmp_path}",
            "name=sweep",
            f"+model.config_overrides.hub_token={SECRET}",
            "packing.token_budget=256",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert SECRET not in out.stdout + out.stderr
    files = [p for p in tmp_path.rglob("*")]
    assert (tmp_path / "sweep" / "multirun.yaml") in files and any(p.name == "summary.json" for p in files)
    for path in files:
        assert SECRET not in str(path), f"leaked into a file name: {path}"
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"leaked into {path}"
    (config,) = [p for p in files if p.name == "config.yaml"]
    assert yaml.safe_load(config.read_text())["packing"]["token_budget"] == 256
