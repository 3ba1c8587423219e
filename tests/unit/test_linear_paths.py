"""benchmarks.linear_paths: every product of the model, on both paths, at each row count."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import linear_paths
from models.embedded.writer import write_checkpoint
from models.layers.fused_linear import ROW_MAJOR_MAX_ROWS
from models.loader import load_model


def test_each_row_count_times_every_product_on_both_paths(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path, "llama", "tiny")
    layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
    model, _ = load_model(checkpoint)
    products = linear_paths.fusions(model)
    # Q/K/V, o_proj, gate/up and down per layer, then the logits head.
    assert len(products) == 4 * layers + 1
    assert products[-1] is model.logits_head
    above = ROW_MAJOR_MAX_ROWS + 1
    results = linear_paths.measure(checkpoint, "float32", [1, above], reps=2)
    assert [(r.rows, r.chosen) for r in results] == [(1, "row-major"), (above, "blocked")]
    for result in results:
        assert all(len(s) == 2 and min(s) > 0 for s in result.seconds.values())
    assert "row-major" in results[0].line() and "blocked" in results[0].line()
