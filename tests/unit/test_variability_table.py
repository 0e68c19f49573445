"""``packfsdp variability`` writes its measurement as the markdown table docs/measuring.md shows
(``variability.md``, published beside ``variability.json`` by ``packfsdp compare --variability --publish``)."""

from __future__ import annotations

from trainer.tools.variability import markdown_table


def test_the_table_has_one_row_per_distribution_with_its_cv_padding_and_speedup():
    rows = [
        {
            "name": "constant",
            "cv": 0.011,
            "speedup": 1.0934,
            "padded": {"useful_tokens_per_s": 5579.2, "padding_fraction": 0.0141},
            "packed": {"useful_tokens_per_s": 6100.2, "padding_fraction": 0.0},
        },
        {
            "name": "pareto a=1.5",
            "cv": 1.19,
            "speedup": 2.758,
            "padded": {"useful_tokens_per_s": 1581.0, "padding_fraction": 0.6},
            "packed": {"useful_tokens_per_s": 4361.0, "padding_fraction": 0.0},
        },
    ]
    lines = markdown_table(rows, 128).splitlines()
    assert lines[0] == "| lengths (mean 128) | CV | padded padding | padded useful tokens/s | packed | speedup |"
    assert lines[2] == "| constant | 0.01 | 1% | 5,579 | 6,100 | 1.09x |"
    assert lines[3] == "| pareto a=1.5 | 1.19 | 60% | 1,581 | 4,361 | 2.76x |"
