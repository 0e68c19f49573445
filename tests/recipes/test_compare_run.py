"""The compare command end to end on the main job's recipe (a few steps, small data, 2 ranks per run)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO
from trainer import tools


@pytest.mark.slow
def test_compare_command_writes_report_plots_and_eval(tmp_path, monkeypatch, capfd):
    """The main job's command (``launch/run_default.sh``: ``recipe=cpu_chitchat``) cut to a few steps on the
    first 400 real dialogues."""
    out = tmp_path / "cmp"
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # each rank of the two torchrun runs: one thread per core
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # the tool dispatcher hands argv on through sys.argv
    # In this process (saves an interpreter start): what `python -m trainer.tools compare ...` runs. The two
    # runs themselves are torchrun processes, as from the command line.
    tools.main(
        [
            "compare",
            "recipe=cpu_chitchat",
            "max_steps=4",
            "data.limit=400",
            "eval.every=2",
            "eval.holdout_fraction=0.1",
            "packing.token_budget=512",
            "data.max_length=512",
            "grad_accum=1",
            "summary_skip_steps=1",
            "checkpoint.every_steps=0",
            "--nproc",
            "2",
            "--out",
            str(out),
        ]
    )
    printed = capfd.readouterr()
    assert "packing speedup (useful tokens/s)" in printed.out and "padding limit" in printed.out
    assert "MFU" not in printed.out + printed.err  # a CPU has no known peak: no MFU, and no warning about one

    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2
    assert report["attention"] == {"packed": "sdpa_varlen", "padded": "sdpa_padded"}
    packed, padded = report["runs"]["packed"], report["runs"]["padded"]
    assert packed["setup"] == {"param_dtype": "float32", "reduce_dtype": "float32", "attention": "auto"}
    assert report["comparison"]["useful_tokens_per_s_ratio"] == pytest.approx(
        packed["useful_tokens_per_s"] / padded["useful_tokens_per_s"]
    )
    assert report["comparison"]["padding_limit"] == pytest.approx(1 / (1 - padded["padding_fraction"]))
    assert packed["padding_fraction"] == 0.0 and padded["padding_fraction"] > 0.0
    assert packed["dataset"]["records"] == 400 and packed["unigram_entropy"] == padded["unigram_entropy"] > 4
    for run in (packed, padded):
        assert run["final_eval_loss"] > 0 and run["model_tflops_per_s"] > 0 and run["eval_examples"] > 0
        assert run["mfu"] is None
    # Same held-out examples in both runs, and the same training examples.
    assert packed["eval_examples"] == padded["eval_examples"]
    assert packed["train_examples"] == padded["train_examples"]
    assert report["machine"]["cores"] >= 1 and "torch_cpu_capability" in report["machine"]
    for name in ("report.md", "loss.png", "throughput.png"):
        assert (out / name).is_file()
    assert "nats above the unigram entropy of the training tokens" in (out / "report.md").read_text()  # 4 steps

    steps = [json.loads(line) for line in (out / "packed" / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (out / "packed" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["padded_equivalent_positions"] >= r["positions"] for r in steps)
    assert all(0.0 <= r["padding_saved_fraction"] < 1.0 for r in steps)
