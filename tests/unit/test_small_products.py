"""small_products: the few-row path of fp32 products, measured at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.embedded.writer import write_checkpoint
from models.layers import small_products
from models.layers.fused_linear import ROW_MAJOR_MAX_ROWS
from models.layers.small_products import choose_row_major_rows, fusions, row_major_limit
from models.loader import load_model


def _timer(ms: dict[int, tuple[float, float]]) -> tuple[small_products.PassTimer, list]:
    """A pass timer from a table rows -> (row-major ms, blocked ms), and the
    (rows, path) of every pass it was asked for."""
    asked: list[tuple[int, str]] = []

    def time_pass(rows: int, path: str) -> float:
        asked.append((rows, path))
        return 1e-3 * ms[rows][0 if path == "row-major" else 1]

    return time_pass, asked


@pytest.mark.parametrize(
    ("table", "limit"),
    [
        ({1: (20.6, 26.0), 2: (22.3, 27.3), 3: (24.1, 27.8)}, 3),  # an Intel Xeon
        ({1: (21.0, 26.0), 2: (27.0, 27.0), 3: (20.0, 30.0)}, 1),  # the first loss ends it
        ({1: (45.8, 24.1), 2: (86.6, 29.5), 3: (109.4, 27.8)}, 0),  # an AMD EPYC
        ({1: (25.0, 26.0), 2: (20.0, 26.0), 3: (20.0, 26.0)}, 0),  # within the margin
    ],
)
def test_the_row_major_path_is_kept_up_to_its_last_clear_win(
    table: dict[int, tuple[float, float]], limit: int
) -> None:
    time_pass, asked = _timer(table)
    got, best = row_major_limit(time_pass)
    assert got == limit
    tried = min(limit + 1, ROW_MAJOR_MAX_ROWS)
    assert sorted(best) == list(range(1, tried + 1))
    assert best[1] == {"row-major": 1e-3 * table[1][0], "blocked": 1e-3 * table[1][1]}
    # Per row count: a warm-up of each path, then the paths alternate.
    per_rows = [path for rows, path in asked if rows == 1]
    assert per_rows == ["blocked", "row-major"] * (1 + small_products._REPEATS)


def test_a_model_too_small_to_time_keeps_the_default(tmp_path: Path) -> None:
    model, _ = load_model(write_checkpoint(tmp_path, "llama", "tiny"))
    assert choose_row_major_rows(model) is None
    assert {f.row_major_max_rows for f in fusions(model)} == {ROW_MAJOR_MAX_ROWS}


def test_the_loader_sets_one_measured_limit_on_every_product(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(small_products, "_MIN_BYTES", 0)
    checkpoint = write_checkpoint(tmp_path, "llama", "tiny")
    model, _ = load_model(checkpoint)
    products = fusions(model)
    limits = {f.row_major_max_rows for f in products}
    assert len(limits) == 1 and 0 <= limits.pop() <= ROW_MAJOR_MAX_ROWS
    # Timing draws its inputs from a generator of its own.
    state = torch.get_rng_state()
    assert choose_row_major_rows(model) is not None
    assert torch.equal(torch.get_rng_state(), state)
    # Whichever path a few rows take, the product is the layers' own.
    for fused in products:
        x = torch.randn(2, fused.weight.shape[1])
        with torch.inference_mode():
            torch.testing.assert_close(fused(x), torch.nn.functional.linear(x, fused.weight))


def test_bfloat16_products_are_not_timed_and_stay_blocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(small_products, "_MIN_BYTES", 0)
    model, _ = load_model(write_checkpoint(tmp_path, "llama", "tiny"), dtype="bfloat16")
    products = fusions(model)
    if not products:
        pytest.skip("no prepacked bfloat16 products on this CPU")
    assert choose_row_major_rows(model) is None
    assert {f.row_major_max_rows for f in products} == {0}
