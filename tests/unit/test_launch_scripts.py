"""The multi-node launchers parse, and hand torchrun and the trainer the right arguments (dry run)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from tests.conftest import REPO, compose_job

SCRIPTS = ["launch/multinode_torchrun.sh", "launch/slurm_hsdp.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses(script):
    subprocess.run(["bash", "-n", str(REPO / script)], check=True)


def dry_run(script: str, env: dict, *overrides: str) -> list[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"DRY_RUN": "1"} | env
    proc = subprocess.run(["bash", str(REPO / script), *overrides], env=full_env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def check_torchrun_and_trainer(argv: list[str], nnodes: int, endpoint: str, run_id: str) -> list[str]:
    """Parse the torchrun part with torchrun's own parser and compose the trainer part with Hydra."""
    assert argv[0] == "torchrun"
    args = get_args_parser().parse_args(argv[1:])
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == (str(nnodes), "c10d", endpoint, run_id)
    assert args.max_restarts == 3 and args.module and args.training_script == "trainer.train"
    cfg = compose_job(args.training_script_args)
    assert cfg.parallel.dp_replicate == nnodes  # HSDP: one replica per node
    assert cfg.resume == "auto"
    return args.training_script_args


def test_torchrun_script_arguments():
    argv = dry_run(SCRIPTS[0], {"NNODES": "4", "RDZV_HOST": "node7", "RUN_ID": "job42"}, "recipe=gpt2_dailydialog")
    overrides = check_torchrun_and_trainer(argv, 4, "node7:29500", "job42")
    assert "recipe=gpt2_dailydialog" in overrides


def test_torchrun_script_requires_its_settings():
    proc = subprocess.run(
        ["bash", str(REPO / SCRIPTS[0])],
        env={"PATH": os.environ["PATH"], "DRY_RUN": "1"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "NNODES" in proc.stderr


def test_slurm_script_arguments(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'gpu-a01\\ngpu-a02\\n'\n")
    (fake / "scontrol").chmod(0o755)
    env = {
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "777",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu-a[01-02]",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_SUBMIT_DIR": str(REPO),
    }
    argv = dry_run(SCRIPTS[1], env, "recipe=gpt2_dailydialog")
    assert argv[0] == "srun" and "--kill-on-bad-exit=1" in argv
    torchrun = argv[argv.index("torchrun") :]
    overrides = check_torchrun_and_trainer(torchrun, 2, "gpu-a01:29500", "777")
    assert "run_dir=outputs/slurm-777" in overrides  # a requeued job (same id) finds its checkpoints
    assert get_args_parser().parse_args(torchrun[1:]).nproc_per_node == "8"
    sbatch = Path(REPO / SCRIPTS[1]).read_text()
    assert "#SBATCH --ntasks-per-node=1" in sbatch and "#SBATCH --requeue" in sbatch


def test_the_set_up_installs_the_main_jobs_corpus():
    """The main job reads ``data.source=chitchat`` offline: the set-up (README, CI) and the image install its
    extra, and the extras are part of the set-up's stamp (a new extra reinstalls)."""
    from trainer.data.chitchat import EXTRA

    assert re.search(rf'^{EXTRA} = \["chitchat-dataset==[0-9.]+"\]$', (REPO / "pyproject.toml").read_text(), re.M)
    setup = (REPO / "launch/setup_env.sh").read_text()
    default = re.search(r"^EXTRAS=\$\{EXTRAS:-([a-z,]+)\}$", setup, re.M).group(1)
    assert EXTRA in default.split(",") and re.search(r'^want=".*\$EXTRAS"$', setup, re.M)  # extras in the stamp
    assert f'pip install ".[{EXTRA}]"' in (REPO / "Dockerfile").read_text()
    assert "RECIPE=${RECIPE:-cpu_chitchat}" in (REPO / "launch/run_default.sh").read_text()
    assert compose_job(["recipe=cpu_chitchat"]).data.source == "chitchat"
