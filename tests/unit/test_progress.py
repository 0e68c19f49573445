"""The rank-0 progress bar: on a terminal it shows useful tokens/s and the ETA; log lines print above it."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from types import SimpleNamespace

import pytest

from tests.conftest import REPO

CODE = r"""
import logging, time
from types import SimpleNamespace
from trainer.metrics import ProgressBar, setup_logging
setup_logging(0)
with ProgressBar(3, True) as bar:
    for i in range(3):
        time.sleep(0.05)
        logging.getLogger("trainer").info("step line %d", i)
        bar.update(SimpleNamespace(useful_tokens_per_s=12345.0, loss=2.5))
"""


def run_in_terminal(code: str) -> str:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a real-sized terminal
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave, cwd=REPO, close_fds=True
    )
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(master)
    return out.decode(errors="replace")


@pytest.mark.slow
def test_progress_bar_on_a_terminal_shows_useful_tokens_and_eta():
    out = run_in_terminal(CODE)
    assert "3/3" in out and "useful tok/s 12,345" in out and "loss 2.500" in out
    assert "<00:00" in out  # elapsed<remaining: the ETA
    assert out.count("step line") == 3


def test_progress_bar_stays_quiet_off_a_terminal():
    from trainer.metrics import ProgressBar

    assert not sys.stderr.isatty()  # pytest captures it
    with ProgressBar(2, True) as bar:
        bar.update(SimpleNamespace(useful_tokens_per_s=1.0, loss=1.0))
        assert bar._bar.disable and bar._redirect is None
    with ProgressBar(2, False) as bar:  # other ranks, or logger.progress_bar=false
        bar.update(SimpleNamespace(useful_tokens_per_s=1.0, loss=1.0))
        assert bar._bar is None
