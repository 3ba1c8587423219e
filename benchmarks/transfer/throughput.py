"""Transceiver throughput and latency against raw limits.

    python -m benchmarks.transfer.throughput [--json] [--transceivers python nixl] [--managers v1 v2]
                             [--wires tcp ucx] [--tensor-parallel 1:1 2:1 1:2]

For each transceiver (the Python one once per wire: rows `python` for TCP,
`python+ucx` for UCX) and manager, two Ray actors on this machine each build a
manager, its pool and a transceiver; the holder fills one request of the
largest size once and republishes it, the puller pulls it repeatedly, each
pull followed by one raw transfer of the same size (a round). Sizes:
one block, 1 MiB, 64 MiB, 256 MiB of KV. Each line shows GB/s and median
latency next to the raw limit measured in the same run (loopback TCP for
Python on either wire, one big NIXL READ for NIXL) and a same-process memcpy, plus each
worker's CPU use while idle.

Tensor parallelism (`--tensor-parallel CTX:GEN`, both transceivers): a
"2->1" row has two holder ranks, each holding half of every block's KV heads,
and one puller rank that pulls its heads from both; "1->2" one holder and two
puller ranks that each pull their half from it, at once. Each rank is a
process of its own (an actor), as a tensor-parallel instance's ranks are, so
a 1->2 row comes from three processes; its time runs from the first puller
rank's start to the last one's end, on the machine's one monotonic clock.
Its size is the whole request's (all heads): the same bytes the raw limit
moves, which is measured as for equal ranks (one TCP stream, or one NIXL
READ between the rank 0 processes' pools, each as large in bytes as a
whole-heads pool). What bounds such a row on NIXL is the count of READ
descriptors, not bytes: a head slice is one descriptor per block in V2 (all
layers of a block's heads lie together: 128 KiB here, 512 per 64 MiB) and
one per (layer, block) in V1 (32 KiB, 2,048 per 64 MiB), against one for
the raw READ, and UCX spends CPU on each descriptor it posts. So a NIXL
row of unequal ranks also measures, in each round, the raw READ cut into
descriptors of a head slice's size (`split_run_bytes`): `floor` is the
median over rounds of (raw seconds / that READ's seconds), what the
descriptor count alone leaves of the raw limit, and `ratio_to_floor` the
transceiver against that READ.

How sure a line is: `ratio` is the median over rounds of (raw seconds /
transceiver seconds) within a round, with its min-max spread over the rounds
(`ratio_min`, `ratio_max`). Load from other processes falls on both halves
of a round alike, so a wide spread says the machine was busy, not that the
transceiver changed.

What it costs: `gb_per_cpu_s` is bytes moved per CPU-second (1e9 bytes),
holder and puller processes together, all their threads, over the transfers
alone; `raw_gb_per_cpu_s` the same for the raw path. `cpu_cores` is that CPU
time over the transfers' wall time: near 2 both sides were busy all along,
i.e. the transfer was CPU-bound. The holder's share is read through Ray
calls around each transfer, so it includes a fraction of a millisecond of
Ray's own work: the CPU columns mean something from a few MiB up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcache.spec import CacheSpec

if TYPE_CHECKING:
    from benchmarks.transfer.endpoints import EndpointSpec

MIB = 1 << 20
# 4 attention layers x [2, 16, 8, 128] bf16 = 256 KiB per block.
BENCH_SPEC = CacheSpec(
    num_kv_heads=8, head_dim=128, attention_layers=(0, 1, 2, 3), dtype="bfloat16"
)
BLOCK_SIZE = 16
BLOCK_BYTES = BENCH_SPEC.kv_bytes_per_block_per_layer(BLOCK_SIZE) * BENCH_SPEC.num_attention_layers
SIZES = (BLOCK_BYTES, MIB, 64 * MIB, 256 * MIB)
EXIT_USAGE_ERROR = 1


@dataclass(frozen=True)
class Row:
    transceiver: str
    manager: str
    size_bytes: int
    gbps: float
    raw_gbps: float
    ratio: float
    ratio_min: float
    ratio_max: float
    p50_ms: float
    raw_p50_ms: float
    gb_per_cpu_s: float
    raw_gb_per_cpu_s: float
    cpu_cores: float
    raw_cpu_cores: float
    memcpy_gbps: float
    idle_cpu_holder: float
    idle_cpu_puller: float
    ctx_tp: int = 1  # holder ranks
    gen_tp: int = 1  # puller ranks
    # NIXL rows of unequal ranks: the raw READ in head-slice descriptors.
    split_run_bytes: int | None = None
    split_raw_p50_ms: float | None = None
    floor: float | None = None
    ratio_to_floor: float | None = None

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Rounds:
    """Per-round measurements of one size: wall and CPU seconds (holder + puller)
    of the transceiver's pull and of the raw transfer that followed it."""

    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    raw_seconds: list[float] = field(default_factory=list)
    raw_cpu: list[float] = field(default_factory=list)
    # The raw READ in head-slice descriptors, where the row measures it.
    split_seconds: list[float] = field(default_factory=list)

    def add(
        self,
        seconds: float,
        cpu: float,
        raw_seconds: float,
        raw_cpu: float,
        split_seconds: float | None = None,
    ) -> None:
        self.seconds.append(seconds)
        self.cpu.append(cpu)
        self.raw_seconds.append(raw_seconds)
        self.raw_cpu.append(raw_cpu)
        if split_seconds is not None:
            self.split_seconds.append(split_seconds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the benchmark's options on `parser`."""
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument(
        "--transceivers", nargs="+", default=["python", "nixl"], choices=["python", "nixl"]
    )
    parser.add_argument("--managers", nargs="+", default=["v1", "v2"], choices=["v1", "v2"])
    parser.add_argument(
        "--wires",
        nargs="+",
        default=["tcp"],
        choices=["tcp", "ucx"],
        help="wires of the Python transceiver (ucx needs the ucx extra)",
    )
    parser.add_argument(
        "--reps", type=int, default=0, help="repetitions per size (default: by size)"
    )
    parser.add_argument(
        "--tensor-parallel",
        nargs="+",
        default=[(1, 1), (2, 1), (1, 2)],  # argparse applies `type` to string defaults only
        type=_tp_pair,
        metavar="CTX:GEN",
        help="holder:puller ranks per row group",
    )


def _tp_pair(text: str) -> tuple[int, int]:
    try:
        ctx, gen = (int(n) for n in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CTX:GEN such as 2:1, got {text!r}") from None
    if ctx < 1 or gen < 1 or BENCH_SPEC.num_kv_heads % max(ctx, gen):
        raise argparse.ArgumentTypeError(
            f"{text!r}: both sides need 1 or more ranks that split {BENCH_SPEC.num_kv_heads} KV heads"
        )
    return ctx, gen


def run(args: argparse.Namespace) -> int:
    """Run the benchmark on a private local Ray instance; print rows; 0 on success."""
    import ray

    from transfer.nixl.transceiver import nixl_available
    from transfer.python.ucx_wire import UCX_INSTALL_HINT, ucx_importable

    if "ucx" in args.wires and not ucx_importable():
        print(f"--wires ucx: ucxx is not installed; {UCX_INSTALL_HINT}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    kinds = [k for k in args.transceivers if k != "nixl" or nixl_available()]
    if not kinds:
        print("no usable transceiver: nixl is not importable", file=sys.stderr)
        return EXIT_USAGE_ERROR
    variants = [(k, w) for k in kinds for w in (args.wires if k == "python" else ["tcp"])]
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
        # With --json stdout carries one object per line: the actors' own log
        # lines (NIXL's agent banner) stay in Ray's log files. Their errors
        # still reach us through ray.get.
        log_to_driver=not args.json,
    )
    try:
        if not args.json:
            print(_HEADER)
        for kind, wire in variants:
            for manager in args.managers:
                for ranks in args.tensor_parallel:
                    for row in _bench_pair(kind, wire, manager, args.reps, ranks):
                        line = json.dumps(row.as_json()) if args.json else _format(row)
                        print(line, flush=True)
    finally:
        ray.shutdown()
    return 0


def _reps(size: int, override: int) -> int:
    if override:
        return override
    return 50 if size <= MIB else (10 if size <= 64 * MIB else 8)


def _rank_names(size: int) -> list[str]:
    """Endpoint names of a side's ranks, rank 0 ("ep", which the raw probes use) last."""
    return [*(f"ep.{r}" for r in range(1, size)), "ep"]


def rank_specs(kind: str, wire: str, manager: str, size: int) -> dict[str, EndpointSpec]:
    """The endpoints of one side's `size` ranks, by name. Each rank's pool has
    `size` times the blocks of a whole-heads pool, each 1/size as large, so
    rank 0's pool alone holds the largest request's bytes for the raw limit's
    READ."""
    from benchmarks.transfer.endpoints import EndpointSpec

    num_blocks = (SIZES[-1] // BLOCK_BYTES + 2) * size
    return {
        name: EndpointSpec(
            kind, manager, BENCH_SPEC.for_rank(r, size), num_blocks, BLOCK_SIZE, wire=wire
        )
        for r, name in zip([*range(1, size), 0], _rank_names(size), strict=True)
    }


def _bench_pair(
    kind: str, wire: str, manager: str, reps_override: int, ranks: tuple[int, int] = (1, 1)
) -> list[Row]:
    import ray

    from benchmarks.transfer.raw import BenchHost

    actor_class: Any = ray.remote(num_cpus=0)(BenchHost)
    # One process per rank, as a tensor-parallel instance runs its ranks;
    # each side's rank 0 last (the order of handles a pull takes).
    holders: list[Any] = [
        actor_class.remote({"ep": spec})
        for spec in rank_specs(kind, wire, manager, ranks[0]).values()
    ]
    pullers: list[Any] = [
        actor_class.remote({"ep": spec})
        for spec in rank_specs(kind, wire, manager, ranks[1]).values()
    ]
    everyone = holders + pullers
    ray.get([actor.start.remote() for actor in everyone])
    holder, puller = holders[-1], pullers[-1]  # rank 0 of each side
    idle = ray.get([holder.idle_cpu.remote(2.0), puller.idle_cpu.remote(2.0)])
    raw = _raw_prober(kind, holder, puller)
    run = head_slice_run(manager, ranks) if kind == "nixl" and ranks[0] != ranks[1] else 0
    rows = []
    for size in SIZES:
        reps = _reps(size, reps_override)
        tokens = size // BLOCK_BYTES * BLOCK_SIZE
        ray.get([h.fill.remote("ep", "src", tokens) for h in holders])
        # Transceiver pulls and raw transfers alternate, one each per round,
        # so load from other processes falls on both alike; round 0 warms
        # connections and tables and is not counted.
        rounds = Rounds()
        for rep in range(reps + 1):
            rid = f"src-{size}-{rep}"
            handles = ray.get([h.publish.remote("ep", "src", 60.0, rid) for h in holders])
            holder_cpu = _cpu_seconds(holders)
            results = ray.get([p.pull_ranks.remote("ep", handles, tokens, 60.0) for p in pullers])
            for result in results:
                if not result["ok"]:
                    raise RuntimeError(result["message"])
            holder_cpu_pulled = _cpu_seconds(holders)
            ray.get([p.free.remote("ep", rid) for p in pullers])
            raw_seconds, raw_cpu = raw(size)
            holder_cpu_raw = _cpu_seconds(holders)
            split_seconds = raw(size, run)[0] if run else None
            if rep:
                # The puller ranks' processes share this machine's monotonic clock.
                seconds = max(r["ended"] for r in results) - min(r["started"] for r in results)
                rounds.add(
                    seconds,
                    sum(r["cpu_seconds"] for r in results) + holder_cpu_pulled - holder_cpu,
                    raw_seconds,
                    raw_cpu + holder_cpu_raw - holder_cpu_pulled,
                    split_seconds,
                )
        ray.get([h.free.remote("ep", "src") for h in holders])
        mem = ray.get(puller.memcpy.remote("ep", size, min(reps, 8)))
        label = kind if wire == "tcp" else f"{kind}+{wire}"
        rows.append(_row(label, manager, size, rounds, mem, idle, ranks, run or None))
    ray.get([holder.close_raw.remote(), puller.close_raw.remote()])
    ray.get([actor.close.remote() for actor in everyone])
    for actor in everyone:
        ray.kill(actor)
    return rows


def _cpu_seconds(hosts: list[Any]) -> float:
    """CPU seconds the hosts' processes have used so far, together."""
    import ray

    return sum(ray.get([host.cpu_seconds.remote() for host in hosts]))


def _raw_prober(kind: str, holder: Any, puller: Any) -> Any:
    """A function (size, run=0) -> (seconds, puller CPU seconds) of one raw
    transfer for this kind; for NIXL a `run` cuts the READ into descriptors
    of that many bytes."""
    import ray

    if kind == "python":
        endpoint = ray.get(holder.raw_tcp_listen.remote("ep"))

        def fetch(size: int, run: int = 0) -> tuple[float, float]:
            return ray.get(puller.raw_tcp_fetch.remote("ep", endpoint, size, 1))[0]

        return fetch
    metadata, address = ray.get(holder.raw_nixl_init.remote("ep"))
    ray.get(puller.raw_nixl_init.remote("ep"))

    def read(size: int, run: int = 0) -> tuple[float, float]:
        return ray.get(puller.raw_nixl_read.remote("ep", metadata, address, size, 1, run))[0]

    return read


def head_slice_run(manager: str, ranks: tuple[int, int]) -> int:
    """Bytes of one READ descriptor of a head slice between `ranks`
    (holder:puller) of this benchmark's cache: the heads one side has and
    the other reads of a V2 block (all layers), or of one layer's V1 block."""
    heads = BENCH_SPEC.num_kv_heads // max(ranks)
    piece = BENCH_SPEC.kv_bytes_per_block_per_layer(BLOCK_SIZE) // BENCH_SPEC.num_kv_heads
    return heads * piece * (BENCH_SPEC.num_attention_layers if manager == "v2" else 1)


def _row(
    kind: str,
    manager: str,
    size: int,
    rounds: Rounds,
    mem: list[float],
    idle: list[float],
    ranks: tuple[int, int] = (1, 1),
    split_run: int | None = None,
) -> Row:
    p50, raw_p50, mem_p50 = (
        statistics.median(t) for t in (rounds.seconds, rounds.raw_seconds, mem)
    )
    ratios = [raw / own for own, raw in zip(rounds.seconds, rounds.raw_seconds, strict=True)]
    moved = size * len(rounds.seconds)
    split: dict[str, Any] = {}
    if rounds.split_seconds:
        pairs = list(zip(rounds.raw_seconds, rounds.split_seconds, rounds.seconds, strict=True))
        split = {
            "split_run_bytes": split_run,
            "split_raw_p50_ms": round(statistics.median(rounds.split_seconds) * 1e3, 3),
            "floor": round(statistics.median(raw / cut for raw, cut, _ in pairs), 3),
            "ratio_to_floor": round(statistics.median(cut / own for _, cut, own in pairs), 3),
        }
    return Row(
        transceiver=kind,
        manager=manager,
        size_bytes=size,
        gbps=round(size / p50 / 1e9, 3),
        raw_gbps=round(size / raw_p50 / 1e9, 3),
        ratio=round(statistics.median(ratios), 3),
        ratio_min=round(min(ratios), 3),
        ratio_max=round(max(ratios), 3),
        p50_ms=round(p50 * 1e3, 3),
        raw_p50_ms=round(raw_p50 * 1e3, 3),
        gb_per_cpu_s=round(moved / sum(rounds.cpu) / 1e9, 3),
        raw_gb_per_cpu_s=round(moved / sum(rounds.raw_cpu) / 1e9, 3),
        cpu_cores=round(sum(rounds.cpu) / sum(rounds.seconds), 2),
        raw_cpu_cores=round(sum(rounds.raw_cpu) / sum(rounds.raw_seconds), 2),
        memcpy_gbps=round(size / mem_p50 / 1e9, 3),
        idle_cpu_holder=round(idle[0], 3),
        idle_cpu_puller=round(idle[1], 3),
        ctx_tp=ranks[0],
        gen_tp=ranks[1],
        **split,
    )


_HEADER = (
    f"{'transceiver':<11} {'mgr':<3} {'size':>10} {'GB/s':>7} {'raw GB/s':>8} "
    f"{'ratio (min-max)':>17} {'p50 ms':>8} {'raw ms':>8} {'GB/cpu-s':>8} {'raw':>6} "
    f"{'cores':>5} {'raw':>5} {'memcpy':>7} {'idle cpu (holder/puller)':>25}"
)


def _format(row: Row) -> str:
    size = f"{row.size_bytes // MIB} MiB" if row.size_bytes >= MIB else f"{row.size_bytes} B"
    spread = f"{row.ratio:.2f} ({row.ratio_min:.2f}-{row.ratio_max:.2f})"
    label = row.transceiver
    if (row.ctx_tp, row.gen_tp) != (1, 1):
        label = f"{label} {row.ctx_tp}->{row.gen_tp}"
    return (
        f"{label:<11} {row.manager:<3} {size:>10} {row.gbps:>7.2f} "
        f"{row.raw_gbps:>8.2f} {spread:>17} {row.p50_ms:>8.3f} {row.raw_p50_ms:>8.3f} "
        f"{row.gb_per_cpu_s:>8.2f} {row.raw_gb_per_cpu_s:>6.2f} {row.cpu_cores:>5.2f} "
        f"{row.raw_cpu_cores:>5.2f} {row.memcpy_gbps:>7.2f} "
        f"{row.idle_cpu_holder:>12.1%} / {row.idle_cpu_puller:.1%}"
        + (f"  floor {row.floor:.2f}" if row.floor is not None else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.transfer.throughput", description=__doc__
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
