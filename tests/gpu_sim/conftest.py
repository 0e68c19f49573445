"""Fixtures that run the CUDA backends' real code on CPU through test doubles of their kernels."""

from __future__ import annotations

import pytest

from tests.gpu_sim import flash_attn_double


@pytest.fixture
def simulated_flash_attn(monkeypatch):
    """``model.attention=flash_attn`` runs here: the flash-attn double is installed and the backend's
    CUDA/sm80 predicates are patched to pass (see tests/gpu_sim/flash_attn_double.py)."""
    return flash_attn_double.install(monkeypatch)


@pytest.fixture
def simulated_flash_attn_fp32(monkeypatch):
    """As ``simulated_flash_attn``, with fp32 inputs accepted so the plumbing can be checked exactly."""
    return flash_attn_double.install(monkeypatch, accept_fp32=True)
