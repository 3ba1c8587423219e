"""small_products: the few-row path of fp32 products, measured at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.embedded.writer import write_checkpoint
from models.layers import small_products
from models.layers.fused_linear import (
    BLOCKED,
    DEFAULT_FEW_ROW_PATHS,
    FEW_ROWS_MAX,
    ROW_MAJOR,
    ROW_MAJOR_MAX_ROWS,
    SKINNY,
)
from models.layers.small_products import (
    PATHS,
    TIMED_ROWS,
    choose_few_row_paths,
    few_row_paths,
    fusions,
    paths_at,
)
from models.loader import load_model


def _timer(ms: dict[int, dict[str, float]]) -> tuple[small_products.PassTimer, list]:
    """A pass timer from a table rows -> {path: ms}, and the (rows, path) of
    every pass it was asked for."""
    asked: list[tuple[int, str]] = []

    def time_pass(rows: int, path: str) -> float:
        asked.append((rows, path))
        return 1e-3 * ms[rows][path]

    return time_pass, asked


def _table(*rows: tuple[float, float, float]) -> dict[int, dict[str, float]]:
    """The `TIMED_ROWS` in turn (1, 2, 3, 4, 6, ...): (blocked, row-major, skinny) ms."""
    return {
        n: dict(zip(PATHS, ms, strict=True))
        for n, ms in zip(TIMED_ROWS[: len(rows)], rows, strict=True)
    }


# A Zen 2 (one thread, SmolLM2-135M): the kernel wins up to 24 rows.
_ZEN2 = _table(
    (27.8, 25.5, 20.4), (30.4, 37.6, 21.7), (35.6, 47.4, 27.9), (40.1, 99, 26.3), (41.2, 99, 24.1),
    (47.2, 99, 30.3), (54.3, 99, 35.7), (64.9, 99, 45.4), (69.8, 99, 61.2), (83.9, 99, 80.4),
)  # fmt: skip


@pytest.mark.parametrize(
    ("table", "skinny", "chosen"),
    [
        # An Intel Xeon, before the kernel: row-major up to 3 rows.
        (_table((26.0, 20.6, 99), (27.3, 22.3, 99), (27.8, 24.1, 99), (28.5, 37.1, 99)), False,
         (ROW_MAJOR,) * 3),
        # The first row count where the blocked path holds ends the search.
        (_table((26.0, 21.0, 99), (27.0, 27.0, 99), (30.0, 20.0, 99), (9, 9, 9)), False,
         (ROW_MAJOR,)),
        # An AMD EPYC: MKL's few-row product loses, the kernel wins at 1 to 3 rows.
        (_table((24.4, 45.8, 19.2), (27.4, 86.6, 21.2), (24.9, 109.4, 20.9), (25.4, 99, 25.2)),
         True, (SKINNY,) * 3),
        (_table((24.4, 45.8, 19.2), (27.4, 86.6, 21.2), (24.9, 109.4, 20.9), (25.4, 99, 25.2)),
         False, ()),
        # Each row count its fastest path; within the margin is no win.
        (_table((26.0, 20.0, 21.0), (26.0, 23.0, 20.0), (26.0, 25.0, 25.0), (9, 9, 9)), True,
         (ROW_MAJOR, SKINNY)),
        (_table((26.0, 25.5, 99), (26.0, 20.0, 99), (26.0, 20.0, 99), (9, 9, 9)), False, ()),
        # Past 4 rows every few counts are timed; those between take the next one's path.
        (_ZEN2, True, (SKINNY,) * 24),
        ({**_ZEN2, 32: dict(zip(PATHS, (83.9, 99, 70.0), strict=True))}, True, (SKINNY,) * 32),
        ({**_ZEN2, 12: dict(zip(PATHS, (54.3, 99, 54.0), strict=True))}, True, (SKINNY,) * 8),
    ],
)  # fmt: skip
def test_each_row_count_keeps_its_fastest_path_up_to_the_first_clear_loss(
    table: dict[int, dict[str, float]], skinny: bool, chosen: tuple[str, ...]
) -> None:
    time_pass, asked = _timer(table)
    got, best = few_row_paths(time_pass, skinny)
    assert got == chosen
    # Every timed row count up to the first one past the chosen paths.
    tried = [rows for rows in TIMED_ROWS if rows <= len(chosen)]
    tried += [rows for rows in TIMED_ROWS if rows > len(chosen)][:1]
    assert sorted(best) == tried
    assert set(best[1]) == {BLOCKED, ROW_MAJOR} | ({SKINNY} if skinny else set())
    assert all(best[1][path] == 1e-3 * table[1][path] for path in best[1])
    # Per row count: a warm-up of each path, then the paths alternate.
    per_rows = [path for rows, path in asked if rows == 1]
    assert per_rows == list(paths_at(1, skinny)) * (1 + small_products._REPEATS)
    for rows in best:  # past ROW_MAJOR_MAX_ROWS rows, no row-major pass
        assert (ROW_MAJOR in best[rows]) == (rows <= ROW_MAJOR_MAX_ROWS)


def test_the_timed_row_counts_reach_the_kernels_last() -> None:
    assert sorted(set(TIMED_ROWS)) == list(TIMED_ROWS)
    assert TIMED_ROWS[: ROW_MAJOR_MAX_ROWS + 1] == tuple(range(1, ROW_MAJOR_MAX_ROWS + 2))
    assert TIMED_ROWS[-1] == FEW_ROWS_MAX


def test_the_paths_each_row_count_can_take() -> None:
    assert paths_at(1, skinny=True) == (BLOCKED, ROW_MAJOR, SKINNY)
    assert paths_at(ROW_MAJOR_MAX_ROWS + 1, skinny=True) == (BLOCKED, SKINNY)
    assert paths_at(FEW_ROWS_MAX + 1, skinny=True) == (BLOCKED,)
    assert paths_at(2, skinny=False) == (BLOCKED, ROW_MAJOR)


def test_a_model_too_small_to_time_keeps_the_default(tmp_path: Path) -> None:
    model, _ = load_model(write_checkpoint(tmp_path, "llama", "tiny"))
    assert choose_few_row_paths(model) is None
    assert {f.few_row_paths for f in fusions(model)} == {DEFAULT_FEW_ROW_PATHS}


def test_the_loader_sets_the_measured_paths_on_every_product(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(small_products, "_MIN_BYTES", 0)
    checkpoint = write_checkpoint(tmp_path, "llama", "tiny")
    model, _ = load_model(checkpoint)
    products = fusions(model)
    chosen = {f.few_row_paths for f in products}
    assert len(chosen) == 1
    paths = chosen.pop()
    assert len(paths) <= FEW_ROWS_MAX
    assert all(path in paths_at(rows) and path != BLOCKED for rows, path in enumerate(paths, 1))
    # Timing draws its inputs from a generator of its own.
    state = torch.get_rng_state()
    assert choose_few_row_paths(model) is not None
    assert torch.equal(torch.get_rng_state(), state)
    # Whichever path a few rows take, the product is the layers' own.
    for fused in products:
        for rows in range(1, FEW_ROWS_MAX + 2):
            x = torch.randn(rows, fused.weight.shape[1])
            with torch.inference_mode():
                want = torch.nn.functional.linear(x, fused.weight)
                torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-5)


def test_bfloat16_products_are_not_timed_and_stay_blocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(small_products, "_MIN_BYTES", 0)
    model, _ = load_model(write_checkpoint(tmp_path, "llama", "tiny"), dtype="bfloat16")
    products = fusions(model)
    if not products:
        pytest.skip("no prepacked bfloat16 products on this CPU")
    assert choose_few_row_paths(model) is None
    assert {f.few_row_paths for f in products} == {()}
