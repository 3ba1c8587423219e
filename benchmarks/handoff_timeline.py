"""Where a 1P1D request's time goes, phase by phase, at a steady arrival rate.

    python -m benchmarks.handoff_timeline --transceiver nixl --rate 8 --requests 64

A context and a generation instance with one CPU each (pinned to CPUs 0 and
1 unless `--unpinned`), started by the launcher from the same config
`benchmarks.serve_compare` gives `ours-1p1d-*`, and the router of `disagg serve` in this process (no HTTP in
front). Random prompts of `--input-len` token ids, `--output-len` greedy
tokens each (EOS ignored), Poisson arrivals at `--rate` (inf: all at once),
after `--warmup` requests that are not counted. Each request's way, on this
machine's clock (the workers are processes on the same machine):

    dispatched ─► first token sampled ─► first token ─► second token ─► last token
                  (context worker)       (router)       (router)        (router)

printed as p50 / p99 of each phase:

- queue + prefill: dispatched -> sampled (the context worker's own clock
  reading, carried by the first token);
- result to caller: sampled -> the first token leaves the router;
- TTFT: dispatched -> first token at the router;
- first -> second token: what the caller waits between them; the cache
  moves in there unless the first token was held back until it had moved;
- sampled -> second token: the hand-off as a whole (result to the router,
  dispatch to the generation worker, pull, admission, one decode step),
  comparable whether or not the first token waits for the cache;
- of which second token out: from its sampling on the generation worker to
  the router (the worker's event batch, the router's split), the rest being
  the hand-off up to that decode step;
- later ITL: mean gap between the remaining tokens.

The router's own `disagg_kv_transfer_seconds` (generation dispatch ->
`cache_ready`) is printed as a mean.

Then the generation worker's decode steps during the timed requests
(`engine.step_timeline`): how many periods from one step to the next exceed
1.5x the median (a request in both steps waited that long between tokens),
the median step and the median long one split into hand-off, step wall and
CPU time (the compute thread's and the whole process's), wake-up, the gap
(with the calls applied in it) and collector pauses, and the longest ones.
A long step with wall far above its CPU time waited for a core. In 1P1D,
the context worker's steps follow, grouped by how many prompt chunks they
computed together: a step of two prompts holds the first one's token until
the second one is computed too.

    python -m benchmarks.handoff_timeline --checkpoint smollm2 --rate 1 --requests 16

`--aggregated` runs one aggregated-only instance on both CPUs instead (as
`benchmarks.serve_compare`'s `ours-agg`): the phases then read as queue +
prefill on that instance, and its steps are listed the same way, steps with
prompt tokens on a row of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from benchmarks.serve_compare import SMOLLM2, resolve_model
from benchmarks.serve_targets import (
    Setup,
    aggregated_sections,
    base_config,
    first_token_setting,
    pinned_1p1d,
)
from cluster.config.plan import resolve_plan
from cluster.config.schema import config_from_dict
from cluster.launch.launcher import init_local_ray, launch
from cluster.metrics import ServingMetrics
from cluster.routing.router import Router
from cluster.serving import build_router
from engine.sampling import SamplingParams
from engine.step_timeline import StepRecord, long_steps

LENGTH_MARGIN = 16


@dataclass
class Timeline:
    """One request's moments: wall clock for the first two, perf_counter after."""

    dispatched_wall: float
    sampled_wall: float = 0.0
    second_sampled_wall: float = 0.0
    second_wall: float = 0.0
    dispatched: float = 0.0
    first: float = 0.0
    second: float = 0.0
    last: float = 0.0
    num_tokens: int = 0
    later_gaps: list[float] = field(default_factory=list)  # after the second token

    def phases(self) -> dict[str, float]:
        to_sampled = self.sampled_wall - self.dispatched_wall
        ttft = self.first - self.dispatched
        later = (self.last - self.second) / max(1, self.num_tokens - 2)
        return {
            "queue + prefill": to_sampled,
            "result to caller": ttft - to_sampled,
            "TTFT": ttft,
            "first -> second token": self.second - self.first,
            "sampled -> second token": self.second - self.dispatched - to_sampled,
            "of which second token out": self.second_wall - self.second_sampled_wall,
            "later ITL (mean)": later,
        }


async def _one(router: Router, rid: str, prompt: list[int], params: SamplingParams) -> Timeline:
    timeline = Timeline(time.time(), dispatched=time.perf_counter())
    async for event in router.generate(rid, prompt, params):
        if event.error is not None:
            raise RuntimeError(event.error)
        now = time.perf_counter()
        if timeline.num_tokens >= 2 and event.token_ids:
            timeline.later_gaps.append(now - timeline.last)
        for _ in event.token_ids:
            timeline.num_tokens += 1
            if timeline.num_tokens == 1:
                timeline.first, timeline.sampled_wall = now, event.timestamp
            elif timeline.num_tokens == 2:
                timeline.second, timeline.second_wall = now, time.time()
                timeline.second_sampled_wall = event.timestamp
        timeline.last = now
    return timeline


async def _drive(
    args: argparse.Namespace, router: Router, vocab: int, workers: list[Any]
) -> tuple[list[Timeline], list[list[StepRecord]]]:
    """The timed requests' timelines, and each worker's steps meanwhile."""
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(args.input_len)]

    for i in range(args.warmup):
        await _one(router, f"warmup-{i}", prompt(), params)
    # The workers share this machine's clock: one start for every timeline.
    timed_from = time.perf_counter()
    tasks = []
    for i in range(args.requests):
        tasks.append(asyncio.ensure_future(_one(router, f"req-{i}", prompt(), params)))
        if args.rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.rate))
    timelines = list(await asyncio.gather(*tasks))
    steps = await asyncio.gather(*(worker.step_timeline.remote() for worker in workers))
    return timelines, [[r for r in records if r.start > timed_from] for records in steps]


def _report(args: argparse.Namespace, timelines: list[Timeline], metrics: ServingMetrics) -> None:
    print(
        f"{'aggregated' if args.aggregated else '1P1D ' + args.transceiver}, rate {args.rate}, {args.requests} requests of "
        f"{args.input_len} in / {args.output_len} out"
    )
    print(f"{'phase':<26} {'p50 ms':>8} {'p99 ms':>8}")
    phases = [t.phases() for t in timelines]
    for name in phases[0]:
        _print_percentiles(name, [p[name] for p in phases])
    # As `vllm bench serve` counts ITL: every gap after the first token, the
    # hand-off (first -> second) included, one per request.
    later = [gap for t in timelines for gap in t.later_gaps]
    _print_percentiles("ITL, all gaps", later + [t.second - t.first for t in timelines])
    _print_percentiles("ITL, hand-offs left out", later)
    total = metrics.registry.get_sample_value("disagg_kv_transfer_seconds_sum") or 0.0
    count = metrics.registry.get_sample_value("disagg_kv_transfer_seconds_count") or 0.0
    if count:
        print(f"{'transfer (router, mean)':<26} {1e3 * total / count:>8.1f}")


def _print_percentiles(name: str, seconds: list[float]) -> None:
    values = sorted(seconds)
    if not values:  # e.g. later gaps of requests of two tokens
        print(f"{name:<26} {'-':>8} {'-':>8}")
        return
    p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
    print(f"{name:<26} {1e3 * statistics.median(values):>8.1f} {1e3 * p99:>8.1f}")


def _report_steps(records: list[StepRecord], shown: int) -> None:
    """The generation worker's decode steps: how many periods (step to next
    step) exceed 1.5x the median, where their time went, and the longest."""
    found = long_steps(records)
    if not found.num_steps:
        return
    print(
        f"\ngeneration worker: {found.num_steps} decode steps, median period "
        f"{1e3 * found.median_period_s:.1f} ms, {found.num_long} over "
        f"{found.factor}x ({100 * found.num_long / found.num_steps:.1f}%)"
    )
    cols = ("period", "handoff", "step", "cpu", "proc cpu", "wake", "gap", "calls", "gc")
    print(f"{'':>6}" + "".join(f"{c:>9}" for c in cols) + f"{'seqs':>6}{'n_calls':>8}")

    def row(label: str, r: StepRecord) -> str:
        values = (r.period_s, r.handoff_s, r.step_s, r.step_cpu_s, r.process_cpu_s)
        values += (r.wake_s, r.gap_s)
        values += (r.calls_s, r.gc_s)
        cells = "".join(f"{1e3 * v:>9.1f}" for v in values)
        return f"{label:>6}{cells}{r.num_seqs:>6}{r.num_calls:>8}"

    decode = [r for r in records if r.num_tokens == r.num_seqs]
    print(row("median", _median_record(decode)))
    prefill = [r for r in records if r.num_tokens > r.num_seqs]
    if prefill:
        print(row("prefill", _median_record(prefill)) + "   (median of steps with prompt tokens)")
    if found.long:
        print(row("long", _median_record(list(found.long))) + "   (median of the long ones)")
    for r in sorted(found.long, key=lambda r: -r.period_s)[:shown]:
        print(row("", r))


def _report_context_steps(records: list[StepRecord]) -> None:
    """The context worker's steps by the number of prompt chunks in them:
    how many, their median wall and compute-thread CPU time, and tokens."""
    if not records:
        return
    print(f"\ncontext worker: {len(records)} steps")
    print(f"{'chunks':>6}{'steps':>7}{'step ms':>9}{'cpu ms':>8}{'tokens':>8}")
    for chunks in sorted({r.num_seqs for r in records}):
        group = [r for r in records if r.num_seqs == chunks]
        median = _median_record(group)
        print(
            f"{chunks:>6}{len(group):>7}{1e3 * median.step_s:>9.1f}"
            f"{1e3 * median.step_cpu_s:>8.1f}{median.num_tokens:>8}"
        )


def _median_record(records: list[StepRecord]) -> StepRecord:
    """Each field's median over `records`, as one record."""
    fields = {
        name: statistics.median(getattr(r, name) for r in records)
        for name in StepRecord.__dataclass_fields__
    }
    fields["num_seqs"] = round(fields["num_seqs"])
    fields["num_tokens"] = round(fields["num_tokens"])
    fields["num_calls"] = round(fields["num_calls"])
    return StepRecord(**fields)


async def _run(args: argparse.Namespace, checkpoint: Path) -> int:
    setup = Setup(
        model=checkpoint,
        dtype="float32",
        cpus=(0, 1),
        port=0,
        max_num_seqs=args.requests,
        max_num_tokens=max(2048, args.input_len),
        max_model_len=args.input_len + args.output_len + LENGTH_MARGIN,
        prefix_caching=False,
        vllm_python=Path(sys.executable),
        workdir=Path(tempfile.gettempdir()),
        pin_instances=not args.unpinned,
        first_token_at=args.first_token_at,
    )
    if args.aggregated:
        config_dict, how = aggregated_sections(base_config(setup, "python"), len(setup.cpus))
        print(how)
    else:
        config_dict, _ = pinned_1p1d(base_config(setup, args.transceiver), setup)
        config_dict, when = first_token_setting(config_dict, setup)
        print(f"first token at {when}")
    config = config_from_dict(config_dict)
    cluster = await launch(resolve_plan(config), 300)
    metrics = ServingMetrics()
    router = build_router(cluster, config, metrics)
    router.start()
    try:
        vocab = int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])
        workers = [cluster.actors("generation")[0].actor]
        if not args.aggregated:
            workers.append(cluster.actors("context")[0].actor)
        timelines, steps = await _drive(args, router, vocab, workers)
    finally:
        await router.stop()
        await cluster.shutdown()
    _report(args, timelines, metrics)
    _report_steps(steps[0], args.show_steps)
    if not args.aggregated:
        _report_context_steps(steps[1])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", help=f"a local HF folder or {SMOLLM2!r}; default: the anchor mini Llama"
    )
    parser.add_argument("--transceiver", choices=("python", "nixl"), default="python")
    parser.add_argument("--rate", type=float, default=8.0, help="requests/s; inf: all at once")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--first-token-at",
        choices=("prefill", "admission"),
        help="router.first_token_at (default: the config's default)",
    )
    parser.add_argument(
        "--aggregated",
        action="store_true",
        help="one aggregated-only instance on both CPUs (as serve_compare's ours-agg) instead",
    )
    parser.add_argument("--show-steps", type=int, default=10, help="longest steps listed")
    parser.add_argument(
        "--unpinned", action="store_true", help="no cpu_affinity: the OS places both instances"
    )
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from models.embedded.writer import ensure_checkpoint

        folder = Path(tempfile.gettempdir()) / "disagg-bench-mini-llama"
        checkpoint = ensure_checkpoint(folder, "llama", "mini")
    else:
        checkpoint = resolve_model(checkpoint)
    init_local_ray(2, log_to_driver=False)
    try:
        return asyncio.run(_run(args, checkpoint))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
