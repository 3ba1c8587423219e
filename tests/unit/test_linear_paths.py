"""benchmarks.linear_paths: every product of the model, on both paths, at each row count."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import linear_paths
from models.embedded.writer import write_checkpoint
from models.kernels import cpu_skinny_gemm
from models.layers.fused_linear import FEW_ROWS_MAX
from models.loader import load_model


def test_each_row_count_times_every_product_on_each_path(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path, "llama", "tiny")
    layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
    model, _ = load_model(checkpoint)
    products = linear_paths.fusions(model)
    # Q/K/V, o_proj, gate/up and down per layer, then the logits head.
    assert len(products) == 4 * layers + 1
    assert products[-1] is model.logits_head
    above = FEW_ROWS_MAX + 1
    results = linear_paths.measure(checkpoint, "float32", [1, above], reps=2)
    # A model this small keeps the default paths (row-major up to 3 rows).
    assert [(r.rows, r.chosen) for r in results] == [(1, "row-major"), (above, "blocked")]
    skinny = ["skinny"] if cpu_skinny_gemm.available() else []
    assert results[0].paths == ["blocked", "row-major", *skinny]
    assert results[1].paths == ["blocked", "row-major"]
    for result in results:
        assert all(len(result.seconds[p]) == 2 and min(result.seconds[p]) > 0 for p in result.paths)
    assert all(path in results[0].line() for path in results[0].paths)
