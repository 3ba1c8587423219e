"""Overload at the HTTP edge: past `router.max_queued_requests` the server says 429.

A short version of `benchmarks/overload.py` against a 1P1D tiny server with
room for 4 requests: twice the sustainable rate for a few seconds must give
429s carrying `Retry-After`, every accepted request must complete with all
its tokens, and the process tree's memory must stay (loosely) flat.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from benchmarks.overload import run_overload
from benchmarks.serve_process import ServeProcess

MAX_QUEUED = 4
MAX_TOKENS = 8
# Loose: Ray's own processes move by tens of MiB on their own.
MAX_RSS_GROWTH_MIB = 300.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    from models.embedded.writer import ensure_checkpoint

    folder = tmp_path_factory.mktemp("overload")
    checkpoint = ensure_checkpoint(folder / "tiny-llama", "llama", "tiny")
    raw = {
        "model": str(checkpoint),
        "port": 0,
        "cache_transceiver": {"backend": "python"},
        "kv_cache": {"max_tokens": 2048},
        "max_num_tokens": 256,
        "router": {"max_queued_requests": MAX_QUEUED},
    }
    config = folder / "cluster.yaml"
    config.write_text(yaml.safe_dump(raw))
    with ServeProcess(config) as running:
        yield running


def test_twice_the_sustainable_rate_is_refused_with_429_and_loses_nothing(
    server: ServeProcess,
) -> None:
    report = asyncio.run(
        run_overload(
            server.url,
            server.pid,
            max_tokens=MAX_TOKENS,
            probe_concurrency=MAX_QUEUED,
            probe_s=2.0,
            factor=2.0,
            duration_s=6.0,
            drain_timeout_s=60.0,
        )
    )
    assert report.rejected > 0, report
    assert report.rejected_without_retry_after == 0, report
    assert set(report.statuses) <= {"200", "429"}, report
    assert report.accepted > 0 and report.lost == 0 and report.failed == 0, report
    growth = report.rss_mib["end"] - report.rss_mib["start"]
    assert growth < MAX_RSS_GROWTH_MIB, report


def test_the_refusals_are_counted_and_the_server_recovers(server: ServeProcess) -> None:
    root = server.url.removesuffix("/v1")
    with httpx.Client(timeout=60) as client:
        metrics = client.get(root + "/metrics").text
        refused = [
            line for line in metrics.splitlines() if 'status="429"' in line and "_total" in line
        ]
        assert refused and float(refused[0].split()[-1]) > 0, metrics[:2000]
        model = client.get(server.url + "/models").json()["data"][0]["id"]
        # Streams the client drops after the headers give their slots back.
        stream = {"model": model, "prompt": "Hello", "max_tokens": 64, "stream": True}
        for _ in range(2 * MAX_QUEUED):
            with client.stream("POST", server.url + "/completions", json=stream) as response:
                assert response.status_code == 200
        body = {"model": model, "prompt": "Hello", "max_tokens": 2}
        deadline = time.monotonic() + 10
        while (status := client.post(server.url + "/completions", json=body).status_code) == 429:
            assert time.monotonic() < deadline, "admission slots leaked"
            time.sleep(0.2)
        assert status == 200


def test_requests_hold_their_slots_while_their_prompts_are_tokenized(
    server: ServeProcess,
) -> None:
    """A slot is taken on arrival: prompts still being tokenized count (a
    900,000-character prompt takes about a second on the tokenizer thread,
    and they queue there), and give it back when refused as too long."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
    huge = " ".join(words[i % len(words)] for i in range(180_000))

    async def run() -> tuple[list[int], int, int]:
        async with httpx.AsyncClient(timeout=120) as client:
            model = (await client.get(server.url + "/models")).json()["data"][0]["id"]
            small = {"model": model, "prompt": "Hello", "max_tokens": 2}
            big = [
                asyncio.ensure_future(
                    client.post(
                        server.url + "/completions",
                        json={"model": model, "prompt": huge, "max_tokens": 2},
                    )
                )
                for _ in range(MAX_QUEUED)
            ]
            await asyncio.sleep(0.3)
            during = (await client.post(server.url + "/completions", json=small)).status_code
            statuses = [response.status_code for response in await asyncio.gather(*big)]
            after = (await client.post(server.url + "/completions", json=small)).status_code
            return statuses, during, after

    statuses, during, after = asyncio.run(run())
    assert statuses == [400] * MAX_QUEUED  # each far past the model's length
    assert during == 429
    assert after == 200
