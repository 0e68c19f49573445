"""The comparison: ``packfsdp compare recipe=NAME [key=value ...] [--nproc N] [--out DIR]``.

Runs the padded baseline (``packing=none``) and the packed run (the recipe's packing, or ``packing=X``
given on the command line: ``bfd``, ``ffd``, ``bfd_split``, ``wrapped``) under torchrun on the
same data, model, seed and useful tokens per optimizer step (the padded run takes as many examples per
micro-batch as a packed micro-batch holds on average), then writes into the compare directory:

- ``padded/`` and ``packed/``: each run's ``config.yaml``, ``metrics.jsonl``, ``eval.jsonl``, ``summary.json``;
- ``report.json`` and ``report.md``: useful tokens/s of each and the ratio, padding, step time, peak
  memory, final train and eval loss and their difference (an MoE run with a router aux loss: the train token
  loss and the aux loss apart too), model TFLOP/s and MFU, attention backend, loss
  implementation and compile mode (the same in both runs, so the ratio measures packing alone), world size,
  the CPU (its flags, whether it multiplies bf16 natively), the packed run's certification line, versions;
- ``loss.png`` (both runs' train and eval loss on one axis, the unigram entropy as a line) and
  ``throughput.png`` (useful tokens/s).

``--variability`` also runs ``packfsdp variability`` (speedup against the spread of example
lengths) into the same directory; ``--report-only DIR`` rebuilds the report and plots of an existing
compare directory; ``--publish DIR`` copies the reports and plots there (the README's figures:
``bash launch/run_default.sh --variability --publish docs/img``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

from trainer.cli import check_overrides
from trainer.compose import open_mapping_overrides, register_configs
from trainer.config import ATTENTION_BACKENDS
from trainer.metrics import SUMMARY_FILE, read_evals, read_metrics
from trainer.packing import STRATEGIES
from trainer.tools.plots import plot_loss, plot_throughput

RUNS = {"padded": "none", "packed": None}  # run name -> packing override (None: the recipe's own)
PER_TOKEN_SETUP = ("loss_impl", "compile")
"""Summary keys saying how each token is computed (loss implementation, compile mode): the report states them
and warns when the two runs differ in one."""
LOSS_PARITY_TOLERANCE = 0.05  # "loss within 0.05 of the padded baseline"
DPO_LOSS_PARITY_TOLERANCE = 0.02  # objective=dpo: "final held-out DPO loss of the two within 0.02"
HELD_OUT_ACCURACY = "final_eval_rewards/accuracies"
"""objective=dpo: the summary key of the held-out reward accuracy (``trainer.objectives.dpo``)."""
REPO = Path(__file__).resolve().parents[1]
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The CPU flags that decide the matmul rates: fp32 (AVX2, AVX-512) and native bf16 (AVX-512 BF16, AMX)."""
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""Settings that cap the instructions oneDNN and ATen use (``ONEDNN_MAX_CPU_ISA=AVX2``: no native bf16)."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="packfsdp compare",
        description="Run the padded baseline and the packed run on the same data and write a report.",
        epilog="Everything else is a Hydra override for both runs, e.g. recipe=cpu_dailydialog max_steps=40.",
    )
    parser.add_argument("--nproc", type=int, default=int(os.environ.get("NPROC", 2)), help="ranks per run")
    parser.add_argument(
        "--out", type=Path, default=None, help="compare directory (default outputs/<recipe>/compare-<time>)"
    )
    parser.add_argument("--report-only", type=Path, default=None, metavar="DIR", help="rebuild the report of DIR")
    parser.add_argument(
        "--variability",
        action="store_true",
        help="also measure the speedup vs length variability (packfsdp variability) into the same directory",
    )
    parser.add_argument("--publish", type=Path, default=None, metavar="DIR", help="copy report.md and plots to DIR")
    args, overrides = parser.parse_known_args(argv)
    for o in overrides:
        if o.startswith("-"):
            parser.error(f"unknown option {o}")
        key, _, value = o.partition("=")
        if key.lstrip("+~") == "run_dir":
            parser.error(f"{o}: compare sets each run's run_dir itself (use --out DIR)")
        if key == "packing" and value in STRATEGIES and STRATEGIES[value].padded:
            parser.error(f"{o}: the padded baseline is packing=none; name the packed run's strategy (bfd, ...)")
    return args, overrides


def run_both(overrides: list[str], nproc: int, out: Path) -> None:
    """The padded baseline, then the packed run, each under torchrun; stop at the first failure."""
    env = os.environ | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    runs = {}
    for name, packing in RUNS.items():
        # `packing=X` on the command line picks the packed run's strategy; the baseline is always padded.
        own = [o for o in overrides if not (packing and o.startswith("packing="))]
        runs[name] = [*own, *([f"packing={packing}"] if packing else []), f"run_dir={out / name}"]
    # Validate both configs before either starts, so a packed-run config error does not surface only
    # after the whole baseline has run.
    register_configs()
    saved_world = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(nproc)  # the mesh checks see the world the runs will have
    try:
        for run_overrides in runs.values():
            check_overrides(open_mapping_overrides(run_overrides))  # as trainer.train composes them
    finally:
        if saved_world is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved_world
    for name, run_overrides in runs.items():
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "trainer.train",
            *run_overrides,
        ]
        print(f"== compare: {name} run: {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0:
            sys.exit(f"packfsdp compare: the {name} run failed (exit {rc}); its log is above")


def load_summary(run_dir: Path) -> dict:
    """The ``summary.json`` a finished run wrote, with its ``setup``: the mixed precision and the attention
    asked for, from the run's ``config.yaml``."""
    summary_path = run_dir / SUMMARY_FILE
    if not summary_path.is_file():
        raise FileNotFoundError(f"{summary_path} not found: did the run finish?")
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    parallel, model = config.get("parallel") or {}, config.get("model") or {}
    setup = {
        "param_dtype": parallel.get("param_dtype"),
        "reduce_dtype": parallel.get("reduce_dtype"),
        "attention": model.get("attention"),
    }
    return json.loads(summary_path.read_text()) | {"setup": setup}


def machine() -> dict:
    """The CPU the runs ran on and what torch makes of it: its model, the ``CPU_FLAGS`` it has, torch's CPU
    capability, whether oneDNN multiplies bf16 natively, and the ``ISA_ENV`` settings that cap both."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        cpuinfo = []

    def field(name: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith(name)), "")

    import torch  # noqa: PLC0415 -- heavy: compare and summarize read records without torch; the CPU facts need it

    try:
        native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native_bf16 = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # this process's
    return {
        "cpu": field("model name") or platform.processor() or "unknown",
        "cores": cores,
        "cpu_flags": [f for f in CPU_FLAGS if f in field("flags").split()],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_native": native_bf16,
        "isa_env": {k: os.environ[k] for k in ISA_ENV if k in os.environ},
    }


def versions() -> dict[str, str]:
    import torch  # noqa: PLC0415 -- heavy: compare and summarize read records without torch; the report's versions need it
    import transformers  # noqa: PLC0415 -- with torch above

    try:
        packfsdp = version("packfsdp")
    except PackageNotFoundError:
        packfsdp = "source tree"
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout
        commit = "unknown"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "packfsdp": packfsdp,
        "git_commit": commit,
        "platform": platform.platform(),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _diff(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def padding_limit(packed: dict, padded: dict) -> float | None:
    """Positions per real token of the padded run over the packed run's: the ratio of useful tokens/s if a
    step's time followed the positions it computes (attention, quadratic in a row's width, and fixed costs
    per step move the measured ratio off it)."""
    if packed.get("padding_fraction") is None or padded.get("padding_fraction") is None:
        return None
    return _ratio(1.0 - packed["padding_fraction"], 1.0 - padded["padding_fraction"])


def build_report(
    summaries: dict[str, dict], overrides: list[str], nproc: int, machine_facts: dict | None = None
) -> dict:
    packed, padded = summaries["packed"], summaries["padded"]
    eval_diff = _diff(packed.get("final_eval_loss"), padded.get("final_eval_loss"))
    tolerance = DPO_LOSS_PARITY_TOLERANCE if packed.get("objective") == "dpo" else LOSS_PARITY_TOLERANCE
    return {
        "command": "packfsdp compare " + " ".join(overrides),
        "overrides": overrides,
        "world_size": packed.get("world_size", nproc),
        "device": packed.get("device"),
        "attention": {"packed": packed.get("attention"), "padded": padded.get("attention")},
        **{key: {"packed": packed.get(key), "padded": padded.get(key)} for key in PER_TOKEN_SETUP},
        "runs": summaries,
        "machine": machine_facts or machine(),
        "comparison": {
            # Splitting strategies keep examples longer than the budget that the padded run truncates.
            "same_data": packed.get("dataset") == padded.get("dataset")
            and packed.get("train_examples") == padded.get("train_examples"),
            "useful_tokens_per_s_ratio": _ratio(packed.get("useful_tokens_per_s"), padded.get("useful_tokens_per_s")),
            "padding_limit": padding_limit(packed, padded),
            # The ratio measures packing alone only when both runs compute each token the same way.
            "same_per_token_setup": all(packed.get(key) == padded.get(key) for key in PER_TOKEN_SETUP),
            "step_time_ratio": _ratio(packed.get("mean_step_time_s"), padded.get("mean_step_time_s")),
            "final_train_loss_diff": _diff(packed.get("final_loss"), padded.get("final_loss")),
            # MoE with a router aux loss: the loss above is token + coef x aux; the aux is a statistic of each
            # micro-batch's tokens, so packed and padded differ by what their micro-batches hold.
            "final_aux_loss_diff": _diff(packed.get("final_aux_loss"), padded.get("final_aux_loss")),
            "final_eval_loss_diff": eval_diff,
            "loss_parity_tolerance": tolerance,
            "eval_loss_within_tolerance": None if eval_diff is None else abs(eval_diff) <= tolerance,
            # The loss of predicting every token by its frequency in the training set: learning goes below it.
            "unigram_entropy": packed.get("unigram_entropy"),
            "eval_loss_below_unigram": _diff(packed.get("unigram_entropy"), packed.get("final_eval_loss")),
            "held_out_reward_accuracy": {
                "packed": packed.get(HELD_OUT_ACCURACY),
                "padded": padded.get(HELD_OUT_ACCURACY),
            },
        },
        "versions": versions(),
        "created": datetime.now().isoformat(timespec="seconds"),
    }


def _known(value) -> bool:
    return value is not None and not (isinstance(value, float) and not math.isfinite(value))


def _fmt(value, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    if not _known(value):
        return "n/a"
    return f"{value * scale:{spec}}{suffix}"


def comparison_table(report: dict) -> str:
    """The Markdown table of the two runs (the README shows this one)."""
    p, q = report["runs"]["padded"], report["runs"]["packed"]
    c = report["comparison"]
    rows = _throughput_rows(p, q, c) + _loss_rows(p, q, c) + _compute_rows(p, q)
    lines = ["| | padded | packed | packed vs padded |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {a} | {b} | {r} |" for name, a, b, r in rows]
    return "\n".join(lines)


def _throughput_rows(p: dict, q: dict, c: dict) -> list[tuple[str, str, str, str]]:
    """The table's rows on speed and cost: useful tokens/s, padding, step time, peak memory."""
    return [
        (
            "useful tokens/s",
            _fmt(p["useful_tokens_per_s"], ",.0f"),
            _fmt(q["useful_tokens_per_s"], ",.0f"),
            _fmt(c["useful_tokens_per_s_ratio"], ".2f", suffix="x"),
        ),
        (
            "padding limit (padded / packed positions per token)",
            "",
            "",
            _fmt(c.get("padding_limit"), ".2f", suffix="x"),
        ),
        (
            "padding fraction",
            _fmt(p["padding_fraction"], ".1f", 100, "%"),
            _fmt(q["padding_fraction"], ".1f", 100, "%"),
            "",
        ),
        (
            "positions saved vs padding the same examples",
            _fmt(p.get("padding_saved_fraction"), ".1f", 100, "%"),
            _fmt(q.get("padding_saved_fraction"), ".1f", 100, "%"),
            "",
        ),
        (
            "mean step time",
            _fmt(p["mean_step_time_s"], ".0f", 1000, " ms"),
            _fmt(q["mean_step_time_s"], ".0f", 1000, " ms"),
            _fmt(c["step_time_ratio"], ".2f", suffix="x"),
        ),
        ("peak memory (GiB)", _fmt(p["peak_mem_gib"], ".2f"), _fmt(q["peak_mem_gib"], ".2f"), ""),
    ]


def _loss_rows(p: dict, q: dict, c: dict) -> list[tuple[str, str, str, str]]:
    """The table's rows on what the runs learned: final train and eval loss (an MoE run's token and router aux
    losses apart, a DPO run's held-out reward accuracy, where the packed run has them)."""
    rows = [
        (
            "final train loss",
            _fmt(p["final_loss"], ".4f"),
            _fmt(q["final_loss"], ".4f"),
            _fmt(c["final_train_loss_diff"], "+.4f"),
        )
    ]
    if q.get("final_aux_loss") is not None:
        rows += [
            (
                "final train token loss",
                _fmt(p.get("final_token_loss"), ".4f"),
                _fmt(q.get("final_token_loss"), ".4f"),
                _fmt(_diff(q.get("final_token_loss"), p.get("final_token_loss")), "+.4f"),
            ),
            (
                "final router aux loss (MoE)",
                _fmt(p.get("final_aux_loss"), ".4f"),
                _fmt(q.get("final_aux_loss"), ".4f"),
                _fmt(c.get("final_aux_loss_diff"), "+.4f"),
            ),
        ]
    rows.append(
        (
            "final eval loss (held out)",
            _fmt(p.get("final_eval_loss"), ".4f"),
            _fmt(q.get("final_eval_loss"), ".4f"),
            _fmt(c["final_eval_loss_diff"], "+.4f"),
        )
    )
    if q.get(HELD_OUT_ACCURACY) is not None:
        rows.append(
            (
                "held-out reward accuracy (dpo)",
                _fmt(p.get(HELD_OUT_ACCURACY), ".3f"),
                _fmt(q.get(HELD_OUT_ACCURACY), ".3f"),
                "",
            )
        )
    return rows


def _compute_rows(p: dict, q: dict) -> list[tuple[str, str, str, str]]:
    """The table's rows on how the runs computed: model TFLOP/s and MFU (not shown without a known peak: a CPU),
    attention, loss implementation, compile mode."""
    rows = [("model TFLOP/s", _fmt(p.get("model_tflops_per_s"), ".3f"), _fmt(q.get("model_tflops_per_s"), ".3f"), "")]
    if _known(p.get("mfu")) or _known(q.get("mfu")):
        rows.append(("MFU (estimated)", _fmt(p.get("mfu"), ".2f", 100, "%"), _fmt(q.get("mfu"), ".2f", 100, "%"), ""))
    return [
        *rows,
        ("attention", f"`{p['attention']}`", f"`{q['attention']}`", ""),
        ("loss implementation", f"`{p.get('loss_impl', 'n/a')}`", f"`{q.get('loss_impl', 'n/a')}`", ""),
        ("compile", f"`{p.get('compile', 'n/a')}`", f"`{q.get('compile', 'n/a')}`", ""),
    ]


def learning_line(report: dict) -> list[str]:
    """The held-out losses against the unigram entropy of the training tokens (nothing without either)."""
    c, p, q = report["comparison"], report["runs"]["padded"], report["runs"]["packed"]
    if not _known(c.get("eval_loss_below_unigram")):
        return []
    gap = c["eval_loss_below_unigram"]
    return [
        f"Held-out loss {_fmt(q.get('final_eval_loss'), '.3f')} packed, {_fmt(p.get('final_eval_loss'), '.3f')} "
        f"padded: {abs(gap):.2f} nats {'below' if gap >= 0 else 'above'} the unigram entropy of the training "
        f"tokens, {_fmt(c['unigram_entropy'], '.3f')} nats (the loss of predicting every token by its frequency "
        "alone; the dashed line of the loss plot)."
    ]


def setup_lines(report: dict) -> list[str]:
    """Which mixed precision and attention ran and why, and the CPU they ran on."""
    q, p, m = report["runs"]["packed"], report["runs"]["padded"], report.get("machine") or {}
    setup = q.get("setup") or {}
    compute, device = setup.get("param_dtype"), q.get("device")
    precision = (
        f"Mixed precision (FSDP2): compute in {compute}, gradients reduced in {setup.get('reduce_dtype')} "
        "(`parallel.param_dtype`, `parallel.reduce_dtype`)."
    )
    if device == "cpu" and compute == "bfloat16" and m.get("bf16_native") is False:
        precision += (
            " **This CPU has no native bf16: its bf16 matmuls are emulated, tens of times slower than "
            "float32** (`parallel=fsdp_fp32` computes in float32)."
        )
    elif device == "cpu":
        native = {True: "has", False: "lacks"}.get(m.get("bf16_native"), "may lack")
        precision += (
            f" On a CPU, bf16 matmuls are native only with AVX-512 BF16 or AMX, which this one {native}; "
            "why a recipe picks its policy: docs/measuring.md, mixed precision on a CPU."
        )
    requested = setup.get("attention")
    why = (
        f"`model.attention=auto` takes the first of {', '.join(ATTENTION_BACKENDS)} that can run on {device} "
        f"in {compute} for this model"
        if requested == "auto"
        else f"named by `model.attention={requested}`"
    )
    attention = (
        f"Attention: packed `{q.get('attention')}` ({why}); padded `{p.get('attention')}` (SDPA with a padding mask)."
    )
    flags = " ".join(m.get("cpu_flags") or []) or "none of " + " ".join(CPU_FLAGS)
    caps = "".join(f"; {k}={v}" for k, v in (m.get("isa_env") or {}).items())
    cpu = (
        f"CPU: {m.get('cpu', 'unknown')}, {m.get('cores')} cores, flags {flags}; torch CPU capability "
        f"{m.get('torch_cpu_capability')}; native bf16 (oneDNN): {m.get('bf16_native')}{caps}."
    )
    certified = q.get("certification")  # the packed run's certification (trainer.model.certification)
    return [precision, attention, cpu, *([f"Packed run {certified['line']}."] if certified else [])]


def render_markdown(report: dict) -> str:
    q = report["runs"]["packed"]
    c = report["comparison"]
    v = report["versions"]
    parity = c["eval_loss_within_tolerance"]
    verdict = "n/a (no eval)" if parity is None else ("yes" if parity else "**no**")
    return "\n".join(
        [
            "# packfsdp: packed vs padded",
            "",
            f"`{report['command']}` on {report['world_size']} rank(s), device {report['device']}; "
            f"{q.get('steps')} steps each, throughput averaged over the last {q.get('steps_averaged')}.",
            "",
            comparison_table(report),
            "",
            f"Packed makes {_fmt(c['useful_tokens_per_s_ratio'], '.2f')}x the useful tokens/s of the padded "
            f"baseline; the padding limit on these lengths is {_fmt(c.get('padding_limit'), '.2f')}x "
            "(the padded run computes that many positions per real token for each the packed run computes).",
            "",
            *learning_line(report),
            f"Eval loss within {c['loss_parity_tolerance']} of the padded baseline: {verdict}.",
            "",
            *(
                []
                if c.get("same_per_token_setup", True)
                else [
                    "**Warning: the two runs used a different loss implementation or compile mode**, so the ratio "
                    "measures more than packing.",
                    "",
                ]
            ),
            *(
                []
                if c.get("same_data", True)
                else [
                    "**Warning: the two runs did not train on the same examples** (dataset statistics differ: a "
                    "splitting strategy keeps examples the padded run truncated to the token budget).",
                    "",
                ]
            ),
            *(f"- {line}" for line in setup_lines(report)),
            f"- MFU: model FLOPs on real tokens (6N per token + causal attention) over {q.get('peak_tflops_source')} "
            f"({_fmt(q.get('peak_tflops_per_device'), '.3f')} TFLOP/s per device)."
            if _known(q.get("mfu"))
            else f"- MFU: not shown ({q.get('peak_tflops_source')}).",
            "",
            "![loss](loss.png)",
            "![useful tokens/s](throughput.png)",
            "",
            f"Versions: python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, "
            f"packfsdp {v['packfsdp']} ({v['git_commit']}), {v['platform']}.",
            "",
        ]
    )


def write_report(out: Path, overrides: list[str], nproc: int, machine_facts: dict | None = None) -> dict:
    summaries = {name: load_summary(out / name) for name in RUNS}
    report = build_report(summaries, overrides, nproc, machine_facts)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(render_markdown(report))
    plotted = ("packed", "padded")
    steps = {name: read_metrics(out / name) for name in plotted}
    plot_loss(
        steps,
        {name: read_evals(out / name) for name in plotted},
        out / "loss.png",
        unigram_entropy=report["comparison"]["unigram_entropy"],
    )
    plot_throughput(steps, out / "throughput.png", summaries)
    return report


def default_out(overrides: list[str]) -> Path:
    recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")), "compare")
    return Path("outputs") / recipe / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def main(argv: list[str] | None = None) -> dict:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    machine_facts = None
    if args.report_only:
        out = args.report_only
        saved = out / "report.json"
        if saved.is_file():  # the CPU the runs ran on, not the one rebuilding the report
            machine_facts = json.loads(saved.read_text()).get("machine")
        if saved.is_file() and not overrides:
            overrides = json.loads(saved.read_text()).get("overrides", [])
    else:
        out = args.out or default_out(overrides)
        out.mkdir(parents=True, exist_ok=True)
        run_both(overrides, args.nproc, out)
    report = write_report(out, overrides, args.nproc, machine_facts)
    if args.variability:
        from trainer.tools import variability  # noqa: PLC0415 -- heavy (torch, a model): only with --variability

        variability.main(["--out", str(out)])
    if args.publish:
        args.publish.mkdir(parents=True, exist_ok=True)
        for name in (
            "report.md",
            "report.json",
            "loss.png",
            "throughput.png",
            "variability.png",
            "variability.json",
            "variability.md",
        ):
            if (out / name).is_file():
                shutil.copy2(out / name, args.publish / name)
    print(f"\n{comparison_table(report)}\n")
    c = report["comparison"]
    print(
        f"packing speedup (useful tokens/s): {_fmt(c['useful_tokens_per_s_ratio'], '.2f')}x "
        f"(padding limit {_fmt(c['padding_limit'], '.2f')}x) | "
        f"eval loss diff {_fmt(c['final_eval_loss_diff'], '+.4f')} "
        f"| held-out loss {_fmt(report['runs']['packed'].get('final_eval_loss'), '.3f')} vs unigram entropy "
        f"{_fmt(c['unigram_entropy'], '.3f')} | report: {out / 'report.md'}"
    )
    return report


if __name__ == "__main__":
    main()
