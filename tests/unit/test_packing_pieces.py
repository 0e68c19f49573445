"""Split examples end to end: pieces through collate and the model, the packing report, the configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import compose_job, tiny_gpt2_config
from trainer.collate import collate_packed
from trainer.data.examples import IGNORE_INDEX
from trainer.packing import split_into_pieces


def pieces_of(example: int, length: int, budget: int) -> np.ndarray:
    return np.array([(example, lo, hi) for lo, hi in split_into_pieces(length, budget)], dtype=np.int64)


def long_example(dataset, at_least: int = 40) -> int:
    return int(np.flatnonzero(dataset.lengths >= at_least)[0])


def test_collate_pieces_positions_continue_and_every_label_once(small_dataset):
    ex = long_example(small_dataset)
    length = int(small_dataset.lengths[ex])
    pieces = pieces_of(ex, length, 16)
    whole = collate_packed(small_dataset, np.array([ex]))
    split = collate_packed(small_dataset, pieces)
    cu = split.cu_seqlens.tolist()
    assert cu == [0, *np.cumsum(pieces[:, 2] - pieces[:, 1]).tolist()]
    positions = split.position_ids[0].tolist()
    labels = split.labels[0].tolist()
    seen = {}
    for k, (_, lo, hi) in enumerate(pieces.tolist()):
        assert positions[cu[k] : cu[k + 1]] == list(range(lo, hi))
        assert labels[cu[k]] == IGNORE_INDEX  # a piece's first token predicts nothing from another bin
        for t in range(lo + 1, hi):
            assert t not in seen
            seen[t] = labels[cu[k] + t - lo]
    whole_labels = whole.labels[0].tolist()
    assert seen == {t: whole_labels[t] for t in range(1, length)}
    assert split.num_label_tokens == whole.num_label_tokens
    assert split.example_ids == [ex] * len(pieces)


def test_pieces_through_the_model(small_dataset, tokenizer):
    from trainer.model import build_model, resolve_backend

    backend = resolve_backend("sdpa_varlen", torch.device("cpu"))
    model = build_model(tiny_gpt2_config(), tokenizer, backend, seed=0).eval()
    ex = long_example(small_dataset)
    length = int(small_dataset.lengths[ex])
    pieces = pieces_of(ex, length, 16)
    other = int(np.argmin(small_dataset.lengths))
    bin_ = np.concatenate([pieces, [[other, 0, int(small_dataset.lengths[other])]]])
    with torch.no_grad():
        split = model(**collate_packed(small_dataset, bin_).model_inputs())[0]
        whole = model(**collate_packed(small_dataset, np.array([ex])).model_inputs())[0]
        cu = collate_packed(small_dataset, bin_).cu_seqlens.tolist()
        # The first piece is the start of the example: exactly the whole example's outputs.
        torch.testing.assert_close(split[: cu[1]], whole[:16], rtol=1e-5, atol=1e-5)
        # Every later piece is isolated from its neighbours in the bin and keeps its true positions.
        for k, (_, lo, hi) in enumerate(pieces.tolist()):
            alone = collate_packed(small_dataset, np.array([[ex, lo, hi]]))
            torch.testing.assert_close(split[cu[k] : cu[k + 1]], model(**alone.model_inputs())[0], rtol=1e-5, atol=1e-5)


def test_packing_report_runs(tmp_path, cache_dir, capsys):
    from trainer.tools.analyze import run

    png = tmp_path / "hist.png"
    figures = run(
        [
            "recipe=cpu_dailydialog",
            "data.num_records=300",
            f"data.cache_dir={cache_dir}",
            f"output_root={tmp_path}",
            "--png",
            str(png),
            "--world-sizes",
            "2,4",
        ]
    )
    out = capsys.readouterr().out
    assert "length histogram" in out and "largest speedup packing can give here" in out
    assert png.is_file() and png.stat().st_size > 0
    assert set(figures["strategies"]) == {"none", "sorted", "ffd", "bfd", "bfd_split", "wrapped"}
    assert figures["strategies"]["bfd"]["efficiency"] > 0.9
    assert figures["max_speedup"] > 1.0


@pytest.mark.parametrize("option", ["none", "sorted", "ffd", "bfd", "bfd_split", "wrapped"])
def test_every_packing_option_composes(option):
    cfg = compose_job(["recipe=cpu_dailydialog", f"packing={option}"])
    assert cfg.packing.strategy == option
