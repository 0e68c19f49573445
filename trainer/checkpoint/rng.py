"""Every RNG a rank uses (torch, CUDA, numpy, python) as a dict of tensors, for a safetensors file."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_tensors() -> dict[str, torch.Tensor]:
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    out = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos_gauss": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_cached_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
        "python": torch.tensor(py_state, dtype=torch.int64),
        "python_meta": torch.tensor([py_version, py_gauss is not None], dtype=torch.int64),
        "python_gauss": torch.tensor([py_gauss or 0.0], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_tensors(t: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(t["torch"])
    if "cuda" in t and torch.cuda.is_available():
        torch.cuda.set_rng_state(t["cuda"])
    pos, has_gauss = t["numpy_pos_gauss"].tolist()
    np.random.set_state(
        ("MT19937", t["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, float(t["numpy_cached_gauss"]))
    )
    version, py_has_gauss = t["python_meta"].tolist()
    gauss = float(t["python_gauss"]) if py_has_gauss else None
    random.setstate((version, tuple(t["python"].tolist()), gauss))
