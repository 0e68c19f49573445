"""The CPU recipe runs end to end for a few steps (single process)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_cpu_recipe_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "trainer.train", "recipe=cpu_dailydialog", "max_steps=3", "data.num_dialogs=300",
         f"run_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT packed (bfd)" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["useful_tokens_per_s"] > 0
