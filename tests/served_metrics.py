"""Reading a running server's /metrics in tests: gauge sums and a poll loop.

Worker gauges are as last polled by the router (every quarter second), so a
test waits for a value instead of reading it once."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import httpx


def metric_samples(url: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of `name` (labels "" when it has none);
    `url` is the server's root or its /v1 root."""
    text = httpx.get(f"{url.removesuffix('/v1')}/metrics", timeout=30).text
    pattern = rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$"
    return [(labels, float(v)) for labels, v in re.findall(pattern, text, re.M)]


def gauge_sum(url: str, name: str, label: str = "") -> float:
    """The sum of `name` over its samples whose labels hold `label` (all of
    them by default: every worker)."""
    return sum(v for labels, v in metric_samples(url, name) if label in labels)


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `condition` every 0.1 s until it holds or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()
