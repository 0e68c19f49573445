"""The compare report (from stored runs), its argument checks, and wandb logging offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainer.metrics import EvalMetrics, RunSummary, StepMetrics
from trainer.tools import compare

STEP_KEYS = (
    "loss",
    "lr",
    "grad_norm",
    "useful_tokens",
    "tokens",
    "positions",
    "useful_tokens_per_s",
    "tokens_per_s",
    "padding_fraction",
    "padded_equivalent_positions",
    "padding_saved_fraction",
    "model_flops",
    "step_time_s",
    "peak_mem_gib",
)


def _step(step: int, useful_per_s: float, positions: int, padded_equivalent: int) -> dict:
    m = dict.fromkeys(STEP_KEYS, 1.0) | {"step": step, "epoch": 0, "loss": 5.0 - 0.1 * step}
    return m | {
        "useful_tokens": 1000,
        "tokens": 1100,
        "positions": positions,
        "step_time_s": 1000 / useful_per_s,
        "useful_tokens_per_s": useful_per_s,
        "padded_equivalent_positions": padded_equivalent,
        "model_flops": 1e9,
        "peak_mem_gib": 0.5,
        "skipped": None,
        "tokens_seen": 1000 * step,
    }


def _fake_run(path, mode: str, useful_per_s: float, positions: int, eval_loss: float, **extra) -> None:
    path.mkdir(parents=True)
    summary = RunSummary(skip=1)
    records = []
    for s in range(1, 6):
        m = _step(s, useful_per_s, positions, max(positions, 1500))
        summary.add(StepMetrics.from_json(m))
        records.append(m)
    summary.add_eval(EvalMetrics(step=5, eval_loss=eval_loss, eval_tokens=10, eval_time_s=0.1))
    records.append({"step": 5, "eval_loss": eval_loss, "eval_tokens": 10, "eval_time_s": 0.1})
    result = (
        summary.result(peak_tflops_total=1.0)
        | {
            "mode": mode,
            "strategy": "bfd" if mode == "packed" else "none",
            "world_size": 2,
            "device": "cpu",
            "attention": "sdpa_varlen" if mode == "packed" else "sdpa_padded",
            "peak_tflops_per_device": 0.5,
            "peak_tflops_source": "test",
        }
        | extra
    )
    (path / "summary.json").write_text(json.dumps(result))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))
    (path / "eval.jsonl").write_text(json.dumps(records[-1]) + "\n")


def test_report_from_stored_runs(tmp_path):
    _fake_run(tmp_path / "padded", "padded", 1000.0, 2200, 4.50)
    certified = (
        "certified exact: qwen2 (table prior; replica float64 |logit diff| 7e-08, |grad diff| 2e-07; self-check ...)"
    )
    _fake_run(tmp_path / "packed", "packed", 1600.0, 1100, 4.52, certification={"line": certified})
    publish = tmp_path / "docs"
    report = compare.main(["--report-only", str(tmp_path), "--publish", str(publish), "recipe=x"])
    c = report["comparison"]
    assert c["useful_tokens_per_s_ratio"] == pytest.approx(1.6)
    assert c["final_eval_loss_diff"] == pytest.approx(0.02)
    assert c["eval_loss_within_tolerance"] is True
    assert report["runs"]["packed"]["padding_saved_fraction"] == pytest.approx(1 - 1100 / 1500)
    # 1e9 model FLOPs per step in 1000 / 1600 s, over a 1 TFLOP/s total peak.
    assert report["runs"]["packed"]["mfu"] == pytest.approx(1e9 * 1.6 / 1e12, rel=1e-6)
    stored = json.loads((tmp_path / "report.json").read_text())
    assert stored["comparison"] == c and stored["versions"]["torch"]
    md = (tmp_path / "report.md").read_text()
    assert "| useful tokens/s | 1,000 | 1,600 | 1.60x |" in md and "loss.png" in md
    assert f"- Packed run {certified}." in md  # the packed run's summary.json, as its start-up line said it
    for name in ("loss.png", "throughput.png"):
        assert (tmp_path / name).stat().st_size > 5000
        assert (publish / name).is_file()


@pytest.mark.parametrize("padded_loss", ["chunked (torch)", "naive"])
def test_report_states_loss_impl_and_compile_and_warns_when_they_differ(tmp_path, padded_loss):
    _fake_run(tmp_path / "padded", "padded", 1000.0, 2200, 4.50, loss_impl=padded_loss, compile="off")
    _fake_run(tmp_path / "packed", "packed", 1600.0, 1100, 4.52, loss_impl="chunked (torch)", compile="off")
    report = compare.main(["--report-only", str(tmp_path), "recipe=x"])
    assert report["loss_impl"] == {"packed": "chunked (torch)", "padded": padded_loss}
    md = (tmp_path / "report.md").read_text()
    assert (
        f"| loss implementation | `{padded_loss}` | `chunked (torch)` |" in md and "| compile | `off` | `off` |" in md
    )
    same = padded_loss == "chunked (torch)"
    assert report["comparison"]["same_per_token_setup"] is same
    assert ("different loss implementation or compile mode" in md) is not same


def test_report_shows_the_router_aux_loss_apart(tmp_path):
    """An MoE run with a router aux loss: the token loss and the aux loss each get a row (``trainer.router_aux``)."""
    _fake_run(tmp_path / "padded", "padded", 1000.0, 2200, 4.50, final_token_loss=4.6, final_aux_loss=2.031)
    _fake_run(tmp_path / "packed", "packed", 1600.0, 1100, 4.52, final_token_loss=4.61, final_aux_loss=2.012)
    report = compare.main(["--report-only", str(tmp_path), "recipe=x"])
    assert report["comparison"]["final_aux_loss_diff"] == pytest.approx(-0.019)
    md = (tmp_path / "report.md").read_text()
    assert "| final router aux loss (MoE) | 2.0310 | 2.0120 | -0.0190 |" in md
    assert "| final train token loss | 4.6000 | 4.6100 | +0.0100 |" in md


def test_summarize_prints_the_compare_table_for_any_two_run_dirs(tmp_path, capsys):
    from trainer.tools import summarize

    _fake_run(tmp_path / "a", "padded", 1000.0, 2200, 4.50)
    _fake_run(tmp_path / "b", "packed", 1600.0, 1100, 4.52)
    summarize.main([str(tmp_path / "b"), str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert "| useful tokens/s | 1,000 | 1,600 | 1.60x |" in out
    assert "packing speedup (useful tokens/s, packed / padded): 1.60x on 2 rank(s)" in out


@pytest.mark.parametrize("bad", ["packing=none", "packing=sorted", "run_dir=/tmp/x", "--bogus"])
def test_compare_refuses_overrides_it_sets_itself(bad):
    with pytest.raises(SystemExit):
        compare.parse_args(["recipe=cpu_dailydialog", bad])


@pytest.mark.slow
def test_wandb_offline_without_key_logs_the_jsonl_names(tmp_path):
    """A run with wandb on, no API key and no network completes; wandb carries the JSONL's metric names."""
    code = f"""
import json, os
from pathlib import Path
from trainer.config import LoggerConfig
from trainer.metrics import EvalMetrics, MetricsLogger, StepMetrics
run_dir = Path({str(tmp_path)!r})
logger = MetricsLogger(LoggerConfig(wandb=True, wandb_mode="offline"), run_dir, enabled=True)
seen = set()
wandb_log = logger._wandb.log
def spy(data, **kwargs):
    seen.update(data)
    return wandb_log(data, **kwargs)
logger._wandb.log = spy
logger.log(StepMetrics.from_json(json.loads({json.dumps(_step(1, 100.0, 10, 20))!r})))
logger.log_eval(EvalMetrics(step=1, eval_loss=3.0, eval_tokens=5, eval_time_s=0.1))
keys = seen
logger.close()
print(json.dumps(sorted(keys)))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "HOME": str(tmp_path),
        "WANDB_BASE_URL": "http://127.0.0.1:9",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=compare.REPO
    )
    assert out.returncode == 0, out.stderr[-2000:]
    keys = set(json.loads(out.stdout.strip().splitlines()[-1]))
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    # Every number reaches wandb; ``skipped`` is a reason (text or null) and ``time`` a timestamp (wandb keeps
    # its own clock), like the step and epoch not logged.
    assert len(jsonl) == 1 and set(jsonl[0]) - {"step", "epoch", "skipped", "time"} <= keys
    assert "eval_loss" in keys and set(evals[0]) - {"step", "time"} <= keys
    assert list(tmp_path.glob("wandb/offline-run-*"))


def test_compare_takes_the_packed_strategy_from_the_command_line():
    _, overrides = compare.parse_args(["recipe=cpu_dailydialog", "packing=bfd_split"])
    assert overrides == ["recipe=cpu_dailydialog", "packing=bfd_split"]


def test_compare_rejects_a_bad_packed_config_before_running_anything(tmp_path, capsys, monkeypatch):
    """A config error of the packed run is reported before the padded baseline spends its time."""
    from trainer.tools import compare

    monkeypatch.setattr(compare.subprocess, "run", lambda *a, **k: pytest.fail("a run was started"))
    with pytest.raises(SystemExit) as exc:
        compare.main(["recipe=cpu_dailydialog", "packing.token_budget=512", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "packing.token_budget=512 cannot hold one example" in capsys.readouterr().err


def test_report_states_the_padding_limit_the_unigram_entropy_precision_and_attention(tmp_path, monkeypatch):
    """Beside the ratio its padding limit; the held-out loss against the unigram entropy; which mixed precision
    and attention ran and why; the CPU's flags; no MFU row where no peak is known (a CPU)."""
    config = "parallel:\n  param_dtype: bfloat16\n  reduce_dtype: float32\nmodel:\n  attention: auto\n"
    for mode, rate, positions, loss in (("padded", 1000.0, 2200, 4.50), ("packed", 1600.0, 1100, 4.52)):
        _fake_run(tmp_path / mode, mode, rate, positions, loss, unigram_entropy=6.25, mfu=None)
        (tmp_path / mode / "config.yaml").write_text(config)
    facts = {
        "cpu": "Test CPU",
        "cores": 2,
        "cpu_flags": ["avx2", "avx512f"],
        "torch_cpu_capability": "AVX2",
        "bf16_native": False,
        "isa_env": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    }
    monkeypatch.setattr(compare, "machine", lambda: facts)
    report = compare.main(["--report-only", str(tmp_path), "recipe=x"])
    c = report["comparison"]
    assert c["padding_limit"] == pytest.approx(2200 / 1100)  # positions per token, padded over packed
    assert c["unigram_entropy"] == 6.25 and c["eval_loss_below_unigram"] == pytest.approx(6.25 - 4.52)
    md = (tmp_path / "report.md").read_text()
    assert "| padding limit (padded / packed positions per token) |  |  | 2.00x |" in md
    assert "1.73 nats below the unigram entropy of the training tokens, 6.250 nats" in md
    assert "compute in bfloat16, gradients reduced in float32" in md and "**This CPU has no native bf16" in md
    assert "Attention: packed `sdpa_varlen` (`model.attention=auto` takes the first of flash_attn, torch_varlen" in md
    assert (
        "CPU: Test CPU, 2 cores, flags avx2 avx512f; torch CPU capability AVX2; native bf16 (oneDNN): False; "
        "ONEDNN_MAX_CPU_ISA=AVX2." in md
    )
    assert "MFU (estimated)" not in md and "MFU: not shown" in md
    monkeypatch.setattr(compare, "machine", lambda: pytest.fail("a rebuilt report keeps the runs' machine"))
    assert compare.main(["--report-only", str(tmp_path), "recipe=x"])["machine"] == facts
