"""Overload benchmark: offer twice the sustainable rate and check nothing breaks.

    python -m benchmarks.overload                       # starts its own 1P1D tiny server
    python -m benchmarks.overload --url http://127.0.0.1:8000/v1 --pid 1234

1. Sustainable rate: `--probe-concurrency` closed-loop clients for
   `--probe-s` seconds; completions per second is the rate R.
2. Overload: open-loop arrivals at `--factor` x R for `--duration-s` seconds
   (60 by default), each a non-streaming completion of exactly `--max-tokens`
   tokens (`ignore_eos`). A refusal must be 429 (or 503) with `Retry-After`.
3. Drain: every accepted request must finish with all its tokens.

The report (JSON with `--json`) gives accepted / rejected / failed / lost
counts and the server process tree's RSS at start, middle and end. It stops
by itself: at most `duration + probe + drain timeout` seconds of load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.serve_process import ServeProcess, process_tree_rss

PROMPT = "The quick brown fox jumps over the lazy dog and keeps running"
REFUSALS = (429, 503)


@dataclass
class OverloadReport:
    """What one overload run saw.

    accepted: requests not refused (429/503); completed: accepted ones that
    returned all `max_tokens` tokens; lost: accepted - completed (must be 0);
    failed: answers that were neither 200 nor a refusal (errors, included in lost).
    """

    sustainable_rps: float
    offered_rps: float
    duration_s: float
    sent: int = 0
    accepted: int = 0
    completed: int = 0
    rejected: int = 0
    rejected_without_retry_after: int = 0
    failed: int = 0
    lost: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    rss_mib: dict[str, float] = field(default_factory=dict)


class _Load:
    """Requests of one run and their outcomes."""

    def __init__(self, client: httpx.AsyncClient, model: str, max_tokens: int) -> None:
        self.client = client
        self.body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens}
        self.body |= {"temperature": 0, "ignore_eos": True}
        self.max_tokens = max_tokens
        self.statuses: Counter[str] = Counter()
        self.completed = 0
        self.short = 0
        self.no_retry_after = 0

    async def one(self) -> int:
        """Send one completion; returns its HTTP status (0 for a transport error)."""
        try:
            response = await self.client.post("/completions", json=self.body)
        except httpx.HTTPError:
            self.statuses["transport_error"] += 1
            return 0
        self.statuses[str(response.status_code)] += 1
        if response.status_code == 200:
            tokens = response.json()["usage"]["completion_tokens"]
            if tokens == self.max_tokens:
                self.completed += 1
            else:
                self.short += 1
        elif response.status_code in REFUSALS and "retry-after" not in response.headers:
            self.no_retry_after += 1
        return response.status_code


async def sustainable_rate(load: _Load, concurrency: int, seconds: float) -> float:
    """Completions per second with `concurrency` clients back to back."""
    deadline = time.monotonic() + seconds
    done = 0

    async def client() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            if await load.one() == 200:
                done += 1
            else:
                await asyncio.sleep(0.05)

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.monotonic() - start)


async def offer(
    load: _Load, rate: float, seconds: float, drain_timeout_s: float, rss: _RssProbe
) -> list[int]:
    """Open-loop arrivals at `rate` for `seconds`, then wait for them all."""
    tasks: list[asyncio.Task[int]] = []
    start = time.monotonic()
    rss.sample("start")
    middle_taken = False
    while (elapsed := time.monotonic() - start) < seconds:
        tasks.append(asyncio.create_task(load.one()))
        if not middle_taken and elapsed >= seconds / 2:
            rss.sample("middle")
            middle_taken = True
        # Arrivals on a fixed schedule: a slow server does not slow the offer.
        await asyncio.sleep(max(0.0, start + len(tasks) / rate - time.monotonic()))
    rss.sample("end_of_load")
    done, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
    for task in pending:
        task.cancel()
    rss.sample("end")
    return [t.result() for t in done] + [-1] * len(pending)


class _RssProbe:
    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.samples: dict[str, float] = {}

    def sample(self, label: str) -> None:
        if self.pid is not None:
            self.samples[label] = round(process_tree_rss(self.pid) / 2**20, 1)


async def run_overload(
    url: str,
    pid: int | None,
    *,
    api_key: str | None = None,
    max_tokens: int = 8,
    probe_concurrency: int = 4,
    probe_s: float = 5.0,
    factor: float = 2.0,
    duration_s: float = 60.0,
    drain_timeout_s: float = 120.0,
) -> OverloadReport:
    """Probe the sustainable rate, offer `factor` times it, report what happened."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(drain_timeout_s + duration_s)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        model = (await client.get("/models")).json()["data"][0]["id"]
        probe = _Load(client, model, max_tokens)
        rate = await sustainable_rate(probe, probe_concurrency, probe_s)
        if rate <= 0:
            raise RuntimeError("no request completed while probing; is the server healthy?")
        load = _Load(client, model, max_tokens)
        rss = _RssProbe(pid)
        results = await offer(load, rate * factor, duration_s, drain_timeout_s, rss)
    accepted = sum(1 for r in results if r not in REFUSALS)
    return OverloadReport(
        sustainable_rps=round(rate, 2),
        offered_rps=round(rate * factor, 2),
        duration_s=duration_s,
        sent=len(results),
        accepted=accepted,
        completed=load.completed,
        rejected=sum(1 for r in results if r in REFUSALS),
        rejected_without_retry_after=load.no_retry_after,
        failed=sum(1 for r in results if r not in (200, -1, *REFUSALS)),
        lost=accepted - load.completed,
        statuses=dict(load.statuses),
        rss_mib=rss.samples,
    )


def _own_server_config(folder: Path, max_queued: int) -> Path:
    from models.embedded.writer import ensure_checkpoint

    checkpoint = ensure_checkpoint(Path("checkpoints/tiny-llama"), "llama", "tiny")
    raw = {
        "model": str(checkpoint.resolve()),
        "port": 0,
        "cache_transceiver": {"backend": "python"},
        "kv_cache": {"max_tokens": 4096},
        "max_num_tokens": 512,
        "router": {"max_queued_requests": max_queued},
    }
    path = folder / "overload.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", help="the server's /v1 base; default: start a tiny 1P1D one")
    parser.add_argument("--pid", type=int, help="server pid whose process tree RSS is sampled")
    parser.add_argument("--api-key")
    parser.add_argument("--max-queued-requests", type=int, default=16, help="for its own server")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--probe-concurrency", type=int, default=4)
    parser.add_argument("--probe-s", type=float, default=5.0)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--drain-timeout-s", type=float, default=120.0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    options: dict[str, Any] = {
        key: getattr(args, key)
        for key in ("api_key", "max_tokens", "probe_concurrency", "probe_s", "factor")
        + ("duration_s", "drain_timeout_s")
    }
    if args.url:
        report = asyncio.run(run_overload(args.url, args.pid, **options))
    else:
        with tempfile.TemporaryDirectory() as folder:
            config = _own_server_config(Path(folder), args.max_queued_requests)
            with ServeProcess(config) as server:
                report = asyncio.run(run_overload(server.url, server.pid, **options))
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        for key, value in asdict(report).items():
            print(f"{key:>30}: {value}")
    return 0 if report.lost == 0 and report.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
