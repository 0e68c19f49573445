"""The one thing a CPU cannot be: a CUDA sm80+ device with flash kernels. Tests pretend it, scoped."""

from __future__ import annotations

import torch


def pretend_capable_gpu(monkeypatch) -> None:
    """Make the CUDA backends' availability checks pass on this CPU (undone with ``monkeypatch``).

    Only the device predicates change: ``backends_cuda._needs_cuda`` / ``_needs_sm80`` say nothing is
    missing and torch reports flash kernels built in. Everything else ``resolve_backend`` checks (the
    package is importable, the compute dtype is bf16/fp16, dropout) is still the product's own rule.
    """
    from trainer.model import backends_cuda

    monkeypatch.setattr(backends_cuda, "_needs_cuda", lambda device: None)
    monkeypatch.setattr(backends_cuda, "_needs_sm80", lambda device: None)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
