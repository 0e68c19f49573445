"""The typed step record: derived ratios computed once, honest counts, metrics.jsonl keys unchanged."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from datetime import datetime, timezone

import pytest
import torch

from trainer.config import LoggerConfig
from trainer.metrics import (
    EvalMetrics,
    MetricsLogger,
    RunSummary,
    StepMetrics,
    format_step,
    read_evals,
    read_metrics,
)
from trainer.throughput import StepCounts

# The keys of a metrics.jsonl line, in order: users, tests and the compare tool read them (``cp_skew`` joins
# them, before ``time``, under parallel.cp>1; ``preference`` under objective=dpo).
JSONL_KEYS = [
    "step",
    "epoch",
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
    "skipped",
    "tokens_seen",
    "time",
    "elapsed_s",
]


def _measure(counts: StepCounts, skipped: str | None = None, loss: float = 2.0) -> StepMetrics:
    return StepMetrics.measure(
        counts,
        step=3,
        epoch=1,
        loss=loss,
        lr=1e-4,
        grad_norm=0.5,
        skipped=skipped,
        step_time_s=0.25,
        model_flops=2e9,
        peak_mem_gib=1.5,
        tokens_seen_before=10_000,
    )


COUNTS = StepCounts(
    label_tokens=350.0, tokens=400.0, positions=500.0, padded_equivalent_positions=1000.0, sum_squared_lengths=9e4
)


def test_measure_computes_the_derived_ratios_from_the_all_reduced_counts():
    m = _measure(COUNTS)
    assert (m.useful_tokens, m.tokens, m.positions, m.padded_equivalent_positions) == (350, 400, 500, 1000)
    assert m.loss == pytest.approx(2.0)
    assert m.useful_tokens_per_s == pytest.approx(1400.0) and m.tokens_per_s == pytest.approx(1600.0)
    assert m.padding_fraction == pytest.approx(0.2)  # 100 of 500 positions hold no token
    assert m.padding_saved_fraction == pytest.approx(0.5)  # 500 computed instead of 1000 padded
    assert m.tokens_seen == 10_350 and m.skipped is None
    assert "pad 20.0%" in format_step(m) and "saved 50.0%" in format_step(m) and "SKIPPED" not in format_step(m)


def test_a_skipped_step_counts_no_useful_token():
    m = _measure(COUNTS, skipped="nonfinite", loss=float("nan"))
    assert m.useful_tokens == 0 and m.useful_tokens_per_s == 0.0 and m.tokens_seen == 10_000
    assert math.isnan(m.loss) and m.tokens == 400  # the positions were computed all the same
    assert "SKIPPED (nonfinite)" in format_step(m)
    empty = _measure(StepCounts(0.0, 0.0, 0.0, 0.0, 0.0), skipped="no_labels", loss=0.0)
    assert empty.loss == 0.0 and empty.padding_fraction == 0.0 and empty.padding_saved_fraction == 0.0


def test_json_round_trip_keeps_the_jsonl_keys():
    m = _measure(COUNTS)
    record = m.to_json()
    assert list(record) == JSONL_KEYS
    line = json.dumps(record)
    back = StepMetrics.from_json(json.loads(line))
    assert back == m and json.dumps(back.to_json()) == line
    sharded = dataclasses.replace(m, cp_skew=0.25).to_json()  # under cp the group's skew comes before the clock
    assert list(sharded) == [*JSONL_KEYS[:-2], "cp_skew", *JSONL_KEYS[-2:]]
    assert record["padding_fraction"] == m.padding_fraction  # the JSON line carries the derived ratios too


def test_logger_writes_what_read_metrics_reads(tmp_path):
    steps = [_measure(COUNTS), _measure(COUNTS, skipped="no_labels")]
    evals = [EvalMetrics(step=3, eval_loss=2.5, eval_tokens=80, eval_time_s=0.1)]
    logger = MetricsLogger(LoggerConfig(), tmp_path, enabled=True)
    for m in steps:
        logger.log(m)
    logger.log_eval(evals[0])
    logger.close()
    assert read_metrics(tmp_path) == steps and read_evals(tmp_path) == evals
    assert list(json.loads((tmp_path / "eval.jsonl").read_text())) == [
        "step",
        "eval_loss",
        "eval_tokens",
        "eval_time_s",
        "time",
        "elapsed_s",
    ]
    assert read_evals(tmp_path / "nowhere") == []


def test_every_record_carries_wall_clock_time_and_the_summary_its_start_and_end(tmp_path):
    """Users line steps up with outside monitoring: each JSON line has its UTC time and elapsed seconds."""
    before = datetime.now(timezone.utc).replace(microsecond=0)  # records keep milliseconds
    logger = MetricsLogger(LoggerConfig(), tmp_path, enabled=True)
    logger.log(_measure(COUNTS))
    logger.log_eval(EvalMetrics(step=1, eval_loss=2.5, eval_tokens=80, eval_time_s=0.1))
    clock = logger.wall_clock()
    logger.close()
    for name in ("metrics.jsonl", "eval.jsonl"):
        record = json.loads((tmp_path / name).read_text())
        stamped = datetime.fromisoformat(record["time"])
        assert stamped.tzinfo is not None and before <= stamped <= datetime.now(timezone.utc)
        assert 0 <= record["elapsed_s"] < 60
    started, ended = datetime.fromisoformat(clock["started_at"]), datetime.fromisoformat(clock["ended_at"])
    assert before <= started <= ended and clock["wall_time_s"] >= 0


def test_run_summary_ratios_agree_with_the_steps():
    """One source per ratio: the summary of identical steps has the steps' padding ratios."""
    summary = RunSummary(skip=0)
    for _ in range(3):
        summary.add(_measure(COUNTS))
    summary.add_eval(EvalMetrics(step=3, eval_loss=2.5, eval_tokens=80, eval_time_s=0.1))
    result = summary.result(peak_tflops_total=1.0)
    step = summary.steps[0]
    assert result["padding_fraction"] == pytest.approx(step.padding_fraction)
    assert result["padding_saved_fraction"] == pytest.approx(step.padding_saved_fraction)
    assert result["useful_fraction"] == pytest.approx(350 / 500)
    assert result["useful_tokens_per_s"] == pytest.approx(step.useful_tokens_per_s)
    assert result["final_eval_loss"] == 2.5 and result["mfu"] == pytest.approx(2e9 / 0.25 / 1e12)


def test_mfu_over_100_percent_is_not_reported():
    """A configured peak below what the run achieved (a wrong logger.peak_tflops): NaN, never 228%."""
    from trainer.metrics import model_flops_utilization

    assert model_flops_utilization(0.5, 2.0) == 0.25
    assert math.isnan(model_flops_utilization(0.004, 0.0018)) and math.isnan(model_flops_utilization(1.0, float("nan")))


def test_model_flops_count_frozen_weights_at_4n():
    """A frozen matmul weight (a LoRA base) costs forward + activation gradient: 4N, not 6N."""
    from trainer.throughput import flop_params, model_flops

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"n_layer": 2, "n_embd": 8})()
            self.wpe = torch.nn.Embedding(16, 8)
            self.base = torch.nn.Linear(8, 8, bias=False)
            self.adapter = torch.nn.Linear(8, 2, bias=False)
            self.base.weight.requires_grad_(False)

    sizes = flop_params(Tiny())
    assert sizes == (80, 64, 2, 8)  # the position table is no matmul
    assert model_flops(10, 100, sizes) == 4 * 64 * 10 + 6 * 16 * 10 + 6 * 2 * 8 * 100


def test_a_cpu_has_no_peak_so_no_mfu_and_no_warning(caplog):
    """A CPU publishes no peak (a rate probed on a shared machine fell below what runs achieved, and warned
    of a fault that was none): its MFU is unknown and not shown, unless ``logger.peak_tflops`` sets a peak."""
    from trainer.metrics import model_flops_utilization
    from trainer.throughput import peak_tflops

    peak, source = peak_tflops(torch.device("cpu"), None)
    assert math.isnan(peak) and "logger.peak_tflops" in source
    with caplog.at_level(logging.WARNING):
        assert math.isnan(model_flops_utilization(0.006, peak))
    assert caplog.text == ""
    assert peak_tflops(torch.device("cpu"), 2.0) == (2.0, "configured (logger.peak_tflops)")
