"""Fixtures that run the CUDA backends' real code on CPU through test doubles of their kernels."""

from __future__ import annotations

import pytest

from tests.gpu_sim import flash_attn_double, torch_varlen_double
from tests.gpu_sim.device import pretend_capable_gpu


def _simulate(monkeypatch, accept_fp32: bool):
    flash_attn_double.install(monkeypatch, accept_fp32)
    pretend_capable_gpu(monkeypatch)
    with torch_varlen_double.registered():
        yield


@pytest.fixture
def simulated_gpu(monkeypatch):
    """``flash_attn`` and ``torch_varlen`` run here: the flash-attn double is installed, torch's flash ops
    get CPU kernels, and the device predicates pass (see the modules of tests/gpu_sim)."""
    yield from _simulate(monkeypatch, accept_fp32=False)


@pytest.fixture
def simulated_gpu_fp32(monkeypatch):
    """As ``simulated_gpu``, with fp32 inputs accepted so the plumbing can be checked exactly."""
    yield from _simulate(monkeypatch, accept_fp32=True)
