"""`disagg_worker_node`: one label set per worker, following it across nodes."""

from __future__ import annotations

from cluster.metrics import ServingMetrics


def _node_lines(metrics: ServingMetrics) -> list[str]:
    text = metrics.exposition().decode()
    return [line for line in text.splitlines() if line.startswith("disagg_worker_node{")]


def test_a_worker_restarted_on_another_node_loses_the_old_label() -> None:
    metrics = ServingMetrics()
    metrics.place_worker("generation-0", "generation", "127.0.0.2")
    metrics.place_worker("context-0", "context", "127.0.0.3")
    metrics.place_worker("generation-0", "generation", "127.0.0.2")  # the same: no change
    assert len(_node_lines(metrics)) == 2
    metrics.place_worker("generation-0", "generation", "127.0.0.4")
    lines = _node_lines(metrics)
    assert len(lines) == 2, lines
    assert any('node="127.0.0.4"' in line and "generation-0" in line for line in lines), lines
    assert not any('node="127.0.0.2"' in line for line in lines), lines
