"""launch/gpu_check.sh --dry-run: the device check's commands, composed here without a GPU.

The dry run prints every command the check would run on the lent GPU, installs the wheel bundle
(``launch/gpu_wheels.sh``, when built) the way that machine would, and composes each trainer run's config.
Nothing here downloads: without ``.whl/`` the dry run says so and checks the rest.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # runs the script, which composes configs and collects the gpu tests (~30 s)

BACKENDS = ["sdpa_varlen", "torch_varlen", "flex"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("work")
    env = os.environ | {"PYTHON": sys.executable, "GPU_CHECK_WORK": str(work)}
    proc = subprocess.run(
        ["bash", str(REPO / "launch/gpu_check.sh"), str(out), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = {}
    for line in proc.stdout.splitlines():
        if line.startswith("== "):
            name, command = line[3:].split(": ", 1)
            steps[name.split()[0]] = shlex.split(command)
    return proc.stdout, steps, out, work


def test_every_step_is_composed_and_nothing_ran(dry_run):
    stdout, steps, out, _ = dry_run
    assert list(steps) == [
        "gpu_tests",
        "cp_attention",
        "mixers",
        *(f"train_{b}" for b in BACKENDS),
        "backend_losses",
        "throughput_gpt2",
        "throughput_qwen",
        "train_compile",
    ]
    pytest = ["-m", "pytest", "-q", "-rA", "-m", "gpu", "-p", "no:cacheprovider"]
    ignored = ["--ignore", "tests/unit/test_context_parallel_gpu.py", "--ignore", "tests/unit/test_mixers_gpu.py"]
    assert steps["gpu_tests"][1:] == [*pytest, "tests/unit", *ignored]
    assert steps["cp_attention"][1:] == [*pytest, "tests/unit/test_context_parallel_gpu.py"]
    assert steps["mixers"][1:] == [*pytest, "tests/unit/test_mixers_gpu.py"]
    assert sorted(p.name for p in out.iterdir()) == ["check.log", "summary.txt"]  # nothing measured
    assert "dry run: ok" in stdout


def trainer_overrides(argv: list[str]) -> list[str]:
    """The trainer's overrides, after torchrun's own arguments are parsed by torchrun's parser."""
    assert argv[:3] == ["env", "TORCH_LOGS=recompiles", sys.executable]
    assert argv[3:5] == ["-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(argv[5:])
    assert args.standalone and args.nproc_per_node == "1" and args.module
    assert args.training_script == "trainer.train"
    return args.training_script_args


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_nccl_run_per_backend(dry_run, backend):
    _, steps, _, work = dry_run
    overrides = trainer_overrides(steps[f"train_{backend}"])
    for expected in (
        "recipe=cpu_dailydialog",
        "parallel.device=cuda",
        "parallel.backend=nccl",
        "max_steps=20",
        "model.self_check=true",
        f"model.attention={backend}",
        f"run_dir={work}/runs/{backend}",
    ):
        assert expected in overrides


def test_compiled_run_and_loss_comparison(dry_run):
    stdout, steps, out, work = dry_run
    overrides = trainer_overrides(steps["train_compile"])
    assert "parallel.compile=true" in overrides and "parallel.backend=nccl" in overrides
    assert steps["backend_losses"][-4:] == [str(out / "backend_losses.txt"), *(f"{work}/runs/{b}" for b in BACKENDS)]
    composed = [line for line in stdout.splitlines() if line.startswith("composed:")]
    assert len(composed) == 4 and all("device=cuda backend=nccl" in line for line in composed)
    assert "compile=True" in composed[-1]


def test_throughput_models_and_outputs(dry_run):
    _, steps, out, _ = dry_run
    gpt2, qwen = steps["throughput_gpt2"], steps["throughput_qwen"]
    assert gpt2[gpt2.index("--model") + 1] == "gpt2" and gpt2[-1] == str(out / "throughput_gpt2.json")
    assert qwen[qwen.index("--model") + 1] == "qwen2.5-0.5b" and qwen[qwen.index("--budget") + 1] == "16384"
    assert qwen[-1] == str(out / "throughput_qwen.json")


def test_bundle_is_checked_or_reported_missing(dry_run):
    stdout = dry_run[0]
    if (REPO / ".whl").is_dir() and any((REPO / ".whl").glob("*.whl")):
        assert "wheels install with --no-index --no-deps --target" in stdout
        assert "hydra, omegaconf, antlr4" in stdout and "import from the bundle alone" in stdout
    else:
        assert "bundle: no wheels in" in stdout and "gpu_wheels.sh" in stdout
