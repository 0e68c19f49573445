"""The batch inspector prints every example of a packed micro-batch with its boundary, positions and loss."""

from __future__ import annotations

from trainer.tools import inspect_batches as batch_inspect


def test_inspector_shows_boundaries_positions_and_loss(capsys, cache_dir):
    batch_inspect.main(
        [
            "recipe=cpu_dailydialog",
            "num_batches=2",
            "show_tokens=5",
            "data.num_records=300",
            "data.loss_on=responses",
            f"data.cache_dir={cache_dir}",
        ]
    )
    out = capsys.readouterr().out
    assert out.count("== micro-batch") == 2
    assert "cu_seqlens [0, " in out and "restart at 0: ok" in out and "DO NOT RESTART" not in out
    assert "[[" in out  # prompts (first turns) carry no loss under loss_on=responses
    assert "FIRST TOKEN HAS A LABEL" not in out


def test_inspector_shows_padded_rows(capsys, cache_dir):
    batch_inspect.main(["packing=none", "num_batches=1", "data.num_records=300", f"data.cache_dir={cache_dir}"])
    out = capsys.readouterr().out
    assert "padded:" in out and "padding" in out
