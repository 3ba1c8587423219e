"""Where the CPU of a served run goes: CPU-seconds per process of `disagg serve`.

    python -m benchmarks.serve_cpu                       # our aggregated server, rate inf
    python -m benchmarks.serve_cpu --runs 3 --profile /tmp/prof   # + cProfile of the server process

Starts our aggregated server (`benchmarks.serve_targets.ours_aggregated`, the
anchor Llama unless `--model`), warms it up, then drives `--runs` timed runs of
the `benchmarks.serve_compare` workload (random prompts of exactly
`--input-len` token ids, `--output-len` tokens out with EOS ignored, streamed,
all sent at once) with `disagg bench`'s client in this process, and prints,
per run, the CPU-seconds each process of the server's tree spent during it:
the serving process (HTTP server + router), the engine worker, each of
Ray's daemons and the client (this process, on the same CPUs), their sum
against what the CPUs offered in that wall time, and the serving process's
and the client's CPU per streamed output token;
then each worker's engine steps during the run and how much of its wall
time they took (busy) or left (idle), from `disagg_engine_steps` and
`disagg_engine_busy_seconds` on the server's /metrics. CPU
time is what the serving path takes away from the engine on a shared
machine; unlike wall-clock throughput it moves little when other work loads
the CPUs. `--idle-s` also measures the tree while no request is
in flight (pollers and Ray's background work).

`--profile DIR` runs the serving process under cProfile and writes its hot
functions (called at least `--num-prompts` times: the per-request and
per-token work) by own and by cumulative time to `DIR/server-top.txt`
(`DIR/server.prof` holds the whole profile). cProfile rather than a sampling
profiler: py-spy's Python-only samples of this process land in whichever
Python frame ran last while uvloop waits in C, so their own-time shares
mislead (`py-spy record --native` does see C frames, such as `gc_collect`).
cProfile slows every Python call, so read its shares, not its absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import pstats
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

from benchmarks.process_group import check_ports_free, descendants
from benchmarks.serve_compare import WARMUP_PROMPTS, WARMUP_SEED, make_setup, wait_ready
from benchmarks.serve_targets import Setup, ours_aggregated
from cluster.bench.load import make_prompts, run_benchmark

# Process names by a marker in their command line, most specific first.
_ROLES = (
    ("ray::", None),  # an actor: named by its class, e.g. `GenerationWorker`
    ("gcs_server", "ray gcs_server"),
    ("raylet", "ray raylet"),
    ("dashboard_agent", "ray dashboard agent"),
    ("runtime_env/agent", "ray runtime-env agent"),
    ("dashboard", "ray dashboard"),
    ("log_monitor", "ray log monitor"),
    ("monitor.py", "ray monitor"),
    ("default_worker.py", "ray idle worker"),
)


def role(pid: int, leader: int) -> str:
    if pid == leader:
        return "serving process (HTTP + router)"
    try:
        cmdline = " ".join(psutil.Process(pid).cmdline()) or psutil.Process(pid).name()
    except psutil.Error:
        return "exited"
    for marker, name in _ROLES:
        if marker in cmdline:
            if name is None:
                return cmdline.split("ray::", 1)[1].split()[0].split(".")[0]
            return name
    return cmdline.split()[0].rsplit("/", 1)[-1]


def cpu_seconds(leader: int) -> dict[int, float]:
    """user + system CPU-seconds of the leader and every descendant, by pid."""
    found: dict[int, float] = {}
    for pid in [leader, *descendants(leader)]:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        found[pid] = times.user + times.system
    return found


def by_role(before: dict[int, float], after: dict[int, float], leader: int) -> dict[str, float]:
    """CPU-seconds spent between two snapshots, summed per role."""
    spent: dict[str, float] = collections.defaultdict(float)
    for pid, seconds in after.items():
        spent[role(pid, leader)] += seconds - before.get(pid, 0.0)
    return dict(spent)


# The benchmark's client, in this process (on the same CPUs as the server).
CLIENT = "client (this process)"
# Long enough for the router's next poll of every worker (every 0.25 s) to
# land, so the engine gauges on /metrics cover the whole run.
_POLL_SETTLE_S = 0.6
_ENGINE_GAUGE = re.compile(
    r'^(disagg_engine_steps|disagg_engine_busy_seconds)\{worker="([^"]+)"\} (\S+)$'
)


def engine_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """Each worker's (engine steps, seconds busy in them) since it started, from
    the text of the server's /metrics."""
    found: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for line in metrics_text.splitlines():
        match = _ENGINE_GAUGE.match(line)
        if match:
            found[match[2]][match[1]] = float(match[3])
    return {
        worker: (
            gauges.get("disagg_engine_steps", 0.0),
            gauges.get("disagg_engine_busy_seconds", 0.0),
        )
        for worker, gauges in found.items()
    }


def scrape_engines(base_url: str) -> dict[str, tuple[float, float]]:
    return engine_totals(httpx.get(base_url + "/metrics", timeout=30).text)


def format_engines(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], wall_s: float
) -> str:
    """Per worker: steps run during the run, and how much of its wall time they took."""
    lines = []
    for worker, (steps, busy) in sorted(after.items()):
        steps0, busy0 = before.get(worker, (0.0, 0.0))
        ran, spent = steps - steps0, busy - busy0
        lines.append(
            f"   engine {worker}: {ran:.0f} steps, busy {spent:.2f} s of {wall_s:.2f} s "
            f"wall ({100 * spent / wall_s:.0f}%), idle {wall_s - spent:.2f} s"
        )
    return "\n".join(lines)


def format_spent(title: str, spent: dict[str, float], wall_s: float, tokens: int, cpus: int) -> str:
    """CPU-seconds per role, and their sum against what `cpus` CPUs offer in `wall_s`."""
    total = sum(spent.values())
    lines = [
        f"{title}: {wall_s:.1f} s wall, {total:.2f} CPU-s in all "
        f"({100 * total / (cpus * wall_s):.0f}% of {cpus} CPUs)"
    ]
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        if seconds >= 0.005:
            lines.append(f"   {seconds:7.2f} CPU-s  {name}")
    if tokens:
        for name in (role(0, 0), CLIENT):
            per_token = 1e6 * spent.get(name, 0.0) / tokens
            lines.append(f"   {name}: {per_token:.0f} us CPU per output token")
    return "\n".join(lines)


# Where a served request's work runs in the serving process: our modules, the
# HTTP stack, asyncio, Ray's call and stream paths, JSON and the metrics.
# (Everything else a cProfile of the process holds is start-up: imports,
# model config, Ray's init.)
_SERVING_PATHS = (
    "cluster/", "engine/", "models/tokenizer", "kvcache/hashing", "starlette/", "uvicorn/",
    "fastapi/", "anyio/", "asyncio/", "ray/actor.py", "ray/_private/serialization.py",
    "ray/_private/object_ref_generator.py", "json/", "prometheus_client/", "pydantic/main.py",
)  # fmt: skip


def hot_functions(stats_file: Path, min_calls: int, count: int = 30) -> str:
    """The serving process's cProfile -> its serving-path functions called at
    least `min_calls` times, by own time and by cumulative time."""
    stats = pstats.Stats(str(stats_file)).stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.items():
        # cProfile charges anyio's task-group context manager with the whole
        # response it wraps (time spent awaiting, not computing): left out.
        if name == "create_collapsing_task_group":
            continue
        if calls >= min_calls and any(part in path for part in _SERVING_PATHS):
            where = path.split("site-packages/")[-1].rsplit("python3.11/", 1)[-1]
            where = where.split("/cluster/")[-1] if "/cluster/" in where else where
            rows.append((own, cumulative, calls, f"{name} ({Path(where).name}:{line})"))
    total = sum(row[0] for row in rows)
    out = [f"{total:.2f} s own time in serving-path functions called >= {min_calls} times"]
    for title, key in (("own", 0), ("cumulative", 1)):
        out.append(f"-- top {count} by {title} time: seconds, calls, us per call")
        for row in sorted(rows, key=lambda r: -r[key])[:count]:
            seconds = row[key]
            out.append(f"{seconds:7.3f} {row[2]:8d} {1e6 * seconds / row[2]:8.1f}  {row[3]}")
    return "\n".join(out)


def drive(
    setup: Setup, args: argparse.Namespace, num_prompts: int, seed: int
) -> tuple[int, float, float]:
    """One run of the workload; returns (output tokens streamed, wall seconds,
    the client's CPU-seconds during the run: this process, prompts made before)."""
    client = argparse.Namespace(
        base_url=setup.url, api_key=None, model=None, endpoint="completions",
        num_prompts=num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=0.0, tokenizer=str(setup.model), request_rate=float("inf"), max_concurrency=None,
        ignore_eos=True, seed=seed, timeout=args.client_timeout, no_progress=True,
    )  # fmt: skip
    prompts = make_prompts(client)
    cpu_before = time.process_time()
    records, wall = asyncio.run(run_benchmark(client, prompts))
    client_cpu = time.process_time() - cpu_before
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    return sum(r.output_tokens for r in records), wall, client_cpu


def measure(setup: Setup, args: argparse.Namespace) -> None:
    launch = ours_aggregated(setup)
    print(f"== {launch.label}", flush=True)
    check_ports_free(launch.ports)
    proc = launch.processes[0]
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        at = proc.argv.index("-m")
        proc.argv[at:at] = ["-m", "cProfile", "-o", str(args.profile / "server.prof")]
    try:
        proc.start()
        wait_ready(launch, 0, args.startup_timeout)
        assert proc.process is not None
        leader = proc.process.pid
        drive(setup, args, WARMUP_PROMPTS, WARMUP_SEED)
        if args.idle_s:
            before, started = cpu_seconds(leader), time.monotonic()
            time.sleep(args.idle_s)
            spent = by_role(before, cpu_seconds(leader), leader)
            wall = time.monotonic() - started
            print(format_spent("idle", spent, wall, 0, len(setup.cpus)), flush=True)
        for run in range(args.runs):
            time.sleep(_POLL_SETTLE_S)
            engines = scrape_engines(setup.url)
            before = cpu_seconds(leader)
            tokens, wall, client_cpu = drive(setup, args, args.num_prompts, args.seed + run)
            spent = by_role(before, cpu_seconds(leader), leader)
            spent[CLIENT] = client_cpu
            title = f"run {run}: {tokens / wall:.0f} out tok/s"
            print(format_spent(title, spent, wall, tokens, len(setup.cpus)), flush=True)
            time.sleep(_POLL_SETTLE_S)
            print(format_engines(engines, scrape_engines(setup.url), wall), flush=True)
    finally:
        proc.stop()
        check_ports_free(launch.ports)
    if args.profile is not None and (args.profile / "server.prof").exists():
        top = hot_functions(args.profile / "server.prof", args.num_prompts)
        (args.profile / "server-top.txt").write_text(top + "\n")
        print(f"profile: {args.profile / 'server-top.txt'}", flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local HF folder (default: the anchor Llama)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--idle-s", type=float, default=0.0, help="also measure this long idle")
    parser.add_argument(
        "--profile", type=Path, help="cProfile the serving process into this folder"
    )
    parser.add_argument("--cpus", default="0,1")
    parser.add_argument("--port", type=int, default=18200)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--client-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    args.cpus = tuple(int(c) for c in args.cpus.split(","))
    # The rest of `serve_compare.make_setup`'s arguments: only our aggregated
    # server runs here, so no vLLM (this interpreter stands in for its
    # checked-for path), no prefix caching, and no 1P1D settings.
    args.vllm_python = Path(sys.executable)
    args.prefix_caching = False
    args.unpinned = False
    args.first_token_at = None
    args.serving_cpus = ()  # the client runs in this process, on the server's CPUs
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup = make_setup(args)
    print(f"model {setup.model}, CPUs {setup.cpus}, logs in {setup.workdir}", flush=True)
    measure(setup, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
