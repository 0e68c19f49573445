"""Issue 14, bullet 4: configuration never runs code nobody named on the command line. Each payload is
harmless (it copies a file or creates a marker) and must not run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, compose_job, exit_line
from trainer.cli import check_code_sources
from trainer.safety import UnsafeTargetError, check_target, user_code

CHAIN = "torch.optim.optimizer.torch.serialization.shutil.copyfile"


@pytest.fixture
def payload(tmp_path):
    """A source file, where a copy would land, and a plugin that leaves a marker when imported."""
    (tmp_path / "src.txt").write_text("payload")
    (tmp_path / "plugin.py").write_text(f"open({str(tmp_path / 'plugin_ran')!r}, 'w').close()\n")
    return tmp_path


def test_attribute_chains_through_modules_are_refused(payload):
    with pytest.raises(UnsafeTargetError, match="reaches module torch through an attribute"):
        compose_job(
            [
                "recipe=cpu_dailydialog",
                f"+optim.optimizer.evil={{_target_:{CHAIN},src:{payload / 'src.txt'},dst:{payload / 'copy.txt'}}}",
            ]
        )
    assert not (payload / "copy.txt").exists()
    assert check_target("k", "torch.optim.AdamW").__name__ == "AdamW"  # the real object, by identity
    with pytest.raises(UnsafeTargetError, match="it is torch.optim.optimizer.Optimizer.__init__"):
        check_target("k", "torch.optim.Optimizer.__init__")


@pytest.mark.parametrize(
    "override",
    [
        "+hydra.callbacks.x._target_=shutil.copyfile",
        "+hydra.callbacks.x._target_=torch.optim.AdamW",  # allowed for optimizers, not as a Hydra callback
        "+hydra.job_logging.handlers.h.class=shutil.copyfile",
    ],
)
def test_hydra_keys_that_instantiate_are_checked(capsys, override):
    line = exit_line(capsys, check_code_sources, ["recipe=cpu_dailydialog", override])
    assert line.startswith("packfsdp: config error: ") and "is not allowed" in line


def test_every_value_of_a_hydra_sweep_is_checked(capsys):
    sweep = "+hydra.callbacks.x._target_=hydra._internal.core_plugins.basic_launcher.BasicLauncher,shutil.copyfile"
    assert "'shutil.copyfile' is not allowed" in exit_line(
        capsys, check_code_sources, ["-m", "recipe=cpu_dailydialog", sweep]
    )


def write_recipe(folder, body: str) -> None:
    (folder / "recipe").mkdir(parents=True, exist_ok=True)
    (folder / "recipe" / "shared.yaml").write_text("# @package _global_\n" + body)


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            "hydra:\n  callbacks:\n    x:\n      _target_: shutil.copyfile\n",
            "hydra.callbacks.x._target_='shutil.copyfile'",
        ),
        ("data:\n  plugins: [PLUGIN]\n", "data.plugins=["),
        ("model:\n  trust_remote_code: true\n", "model.trust_remote_code=True is set by a config file"),
    ],
)
def test_a_yaml_on_the_search_path_cannot_run_code(capsys, payload, body, expected):
    write_recipe(payload / "conf", body.replace("PLUGIN", str(payload / "plugin.py")))
    line = exit_line(capsys, check_code_sources, [f"hydra.searchpath=[file://{payload / 'conf'}]", "recipe=shared"])
    assert expected in line, line
    assert not (payload / "plugin_ran").exists()


def test_code_options_from_the_command_line_or_the_environment_are_accepted_and_logged(payload, monkeypatch):
    plugin = str(payload / "plugin.py")
    check_code_sources(["recipe=cpu_dailydialog", f"data.plugins=[{plugin}]", "model.trust_remote_code=true"])
    monkeypatch.setenv("PACKFSDP_PLUGINS", plugin)
    monkeypatch.setenv("PACKFSDP_TRUST_REMOTE_CODE", "1")
    check_code_sources(["recipe=cpu_dailydialog"])
    job = compose_job(["recipe=cpu_dailydialog"])
    assert job.data.plugins == [plugin] and job.model.trust_remote_code
    from dataclasses import asdict

    assert user_code(asdict(job)) == [f"data.plugins {plugin}", "model.trust_remote_code (the code of None)"]
    assert not (payload / "plugin_ran").exists()  # checking imports nothing


@pytest.mark.slow
def test_a_hydra_callback_never_runs_from_a_real_launch(payload):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            "recipe=cpu_dailydialog",
            "max_steps=1",
            f"run_dir={payload / 'run'}",
            "+hydra.callbacks.x._target_=shutil.copyfile",
            f"+hydra.callbacks.x.src={payload / 'src.txt'}",
            f"+hydra.callbacks.x.dst={payload / 'copy.txt'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and not (payload / "copy.txt").exists(), out.stderr[-2000:]
    assert [line for line in out.stderr.splitlines() if line.strip()][-1].startswith("packfsdp: config error:")
