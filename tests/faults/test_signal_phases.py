"""Issue 24, signals in every phase: the watchdog's grace counts the phase actually running, so a signal
during a long eval (longer than the grace a step gives) still reaches the next boundary and its checkpoint."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.conftest import wait_until
from trainer import preemption


def test_a_signal_during_a_long_eval_is_not_cut_short(monkeypatch):
    # A step's grace of 1 s: an eval of 1.2 s outlasts it, and the moment between the eval's end and the
    # boundary below (the step's grace restarts there) is not read as a stuck rank on a loaded machine.
    stuck = []
    monkeypatch.setattr(preemption, "MIN_GRACE_S", 1.0)
    monkeypatch.setattr(preemption.StepBoundary, "_stuck", lambda self, signum: stuck.append(signum))
    with preemption.StepBoundary(0, torch.device("cpu")) as boundary:
        with boundary.long_phase("eval"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.2)  # an eval longer than a step's grace (on main: the watchdog fires here)
        assert stuck == [] and boundary.agree().stop_signal == "SIGTERM"
    assert boundary.longest_phase_s["eval"] >= 1.2

    with preemption.StepBoundary(0, torch.device("cpu")) as boundary:
        boundary.longest_phase_s["eval"] = 2.0  # a measured eval: grace 3 x 2 s
        with boundary.long_phase("eval"):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1.2)  # past a step's grace, far inside the eval's
            assert stuck == []
            # a stuck eval still ends, after three times its measured length
            wait_until(lambda: stuck, 60, what="the watchdog's call 6 s into a stuck eval")
        assert stuck == [signal.SIGUSR1]


@pytest.mark.slow
def test_a_signal_during_setup_is_one_line_and_exit_75(tmp_path):
    """SIGTERM while the data is prepared (setup): on main a traceback and rc 1 (or a kill by the signal)."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.faults.conftest import SMALL_RUN
    from trainer.stop_signals import PREEMPTED_EXIT_CODE

    cmd = [sys.executable, "-m", "tests.faults.signal_entry", *SMALL_RUN, "max_steps=2", f"run_dir={tmp_path}"]
    env = os.environ | {"PFTEST_SIGNAL": "SIGTERM:setup:build_data:0"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == PREEMPTED_EXIT_CODE, out.stderr[-2000:]
    assert "packfsdp: rank 0: preempted (SIGTERM) during setup" in out.stderr
    assert "Traceback" not in out.stderr
