"""`disagg bench --plot`: each latency on an axis of its own, so tens of
milliseconds of ITL stay readable beside seconds of E2E."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.bench.plot import plot_run, run_figure
from cluster.bench.stats import SLO, RequestRecord, summarize


def _summary() -> tuple[list[RequestRecord], dict]:
    # 50 tokens 80 ms apart after a 250 ms first token: E2E ~4.2 s, ITL 80 ms.
    times = [0.25 + 0.08 * i for i in range(50)]
    records = [RequestRecord(0.0, 16, 50, times, [1] * 50)]
    return records, summarize(records, 5.0, SLO())


def test_itl_and_e2e_are_on_axes_of_their_own() -> None:
    records, summary = _summary()
    figure = run_figure(records, summary)
    heights = {
        axis: [bar.get_height() for bar in axis.patches] for axis in figure.axes if axis.patches
    }
    itl_ms, e2e_ms = summary["itl"]["p50_ms"], summary["e2e"]["p50_ms"]
    assert itl_ms == pytest.approx(80.0) and e2e_ms > 4000
    itl_axes = [a for a, h in heights.items() if any(v == pytest.approx(itl_ms) for v in h)]
    assert itl_axes, "no ITL bars"
    assert "ITL" in [axis.get_title() for axis in itl_axes]
    for axis in itl_axes:
        assert max(heights[axis]) < 2 * itl_ms, f"ITL shares {axis.get_title()!r} with E2E"
        assert axis.get_ylim()[1] < 2 * itl_ms


def test_plot_run_writes_a_png(tmp_path: Path) -> None:
    records, _ = _summary()
    records.append(RequestRecord(sent=0.05, error="HTTP 500"))
    summary = summarize(records, 5.0, SLO())
    out = tmp_path / "bench.png"
    plot_run(records, summary, str(out))
    assert out.read_bytes().startswith(b"\x89PNG")
