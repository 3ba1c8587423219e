"""Prometheus metrics of the serving path, exposed at `/metrics`.

Each server owns its own `CollectorRegistry`, so two servers in one process
(tests, the demo) never collide on metric names.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.messages import RankCacheUsage, WorkerLoad

# Seconds; CPU tiny models sit at the low end, large GPU models further up.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServingMetrics:
    """Every metric the router and HTTP server update."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "disagg_requests", "Finished HTTP requests.", ["endpoint", "status"], registry=r
        )
        self.routed = Counter(
            "disagg_routed_requests",
            "Requests dispatched to each worker (phase: context, prefetch, generation or whole).",
            ["worker", "phase"],
            registry=r,
        )
        self.ttft = Histogram(
            "disagg_time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "disagg_inter_token_latency_seconds",
            "Gap between consecutive streamed tokens.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "disagg_e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "disagg_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.error_responses = Counter(
            "disagg_error_responses",
            "Requests answered with an error status (refused at the edge, or failed before "
            "their first token), by status and OpenAI error code.",
            ["status", "code"],
            registry=r,
        )
        self.cached_prompt_tokens = Histogram(
            "disagg_cached_prompt_tokens",
            "Prompt tokens each finished request skipped (its cached_tokens): KV blocks, "
            "and for a hybrid model only up to the Mamba snapshot it resumed from.",
            buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536),
            registry=r,
        )
        self.generation_tokens = Counter(
            "disagg_generation_tokens", "Generated tokens of finished requests.", registry=r
        )
        self.transfer_bytes = Counter(
            "disagg_kv_transfer_bytes",
            "KV cache and Mamba state bytes of the pulled requests, summed over context ranks.",
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "disagg_kv_transfer_seconds",
            "Context result to first generated token of a disaggregated request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cache_usage = Gauge(
            "disagg_kv_cache_usage_ratio",
            "Used fraction of each worker's KV blocks.",
            ["worker"],
            registry=r,
        )
        self.rank_blocks = Gauge(
            "disagg_rank_kv_blocks",
            "KV blocks of each rank's cache of each worker instance (state: used or total).",
            ["worker", "rank", "state"],
            registry=r,
        )
        self.rank_mamba_slots = Gauge(
            "disagg_rank_mamba_slots",
            "Mamba state slots of each rank's cache of each worker instance (state: used or "
            "total; hybrid models only).",
            ["worker", "rank", "state"],
            registry=r,
        )
        self.cached_blocks = Gauge(
            "disagg_router_cached_blocks",
            "Reusable KV blocks the router knows each worker holds (from its KV events).",
            ["worker"],
            registry=r,
        )
        self.encoded_images = Gauge(
            "disagg_router_encoded_images",
            "Images whose embeddings the router knows each worker's encoder cache holds.",
            ["worker"],
            registry=r,
        )
        self.routed_cache_hits = Counter(
            "disagg_routed_cache_hits",
            "Dispatches to a worker known to hold a leading KV block of the prompt (cache: kv) "
            "or the embeddings of one of its images (cache: encoder).",
            ["worker", "phase", "cache"],
            registry=r,
        )
        self.worker_requests = Gauge(
            "disagg_worker_requests",
            "Requests each worker holds (waiting, running or transferring), as last polled.",
            ["worker"],
            registry=r,
        )
        self.encoder_cache = Gauge(
            "disagg_encoder_cache_images",
            "Images each worker's vision encoder served from its cache (hit) or ran (miss).",
            ["worker", "result"],
            registry=r,
        )
        self.snapshots = Gauge(
            "disagg_mamba_snapshots",
            "Hybrid prefix reuse per worker: prompts that found a Mamba state snapshot to "
            "resume from (hit) or none (miss), snapshots evicted for room (evicted) or "
            "dropped with a KV block under them (dropped), snapshots held (used) and "
            "slots for them (total).",
            ["worker", "kind"],
            registry=r,
        )
        self.snapshot_resumed_tokens = Gauge(
            "disagg_mamba_snapshot_resumed_tokens",
            "Prompt tokens each worker skipped by resuming at a Mamba state snapshot.",
            ["worker"],
            registry=r,
        )
        self.spec_tokens = Gauge(
            "disagg_spec_tokens",
            "Speculative decoding per worker since it started: draft tokens verified "
            "(drafted), accepted, and verifies run (one request's drafts in one step).",
            ["worker", "kind"],
            registry=r,
        )
        self.spec_acceptance = Gauge(
            "disagg_spec_acceptance",
            "Speculative decoding per worker and draft position (1 = the first draft): "
            "the share of verifies reaching that position that accepted its draft.",
            ["worker", "position"],
            registry=r,
        )
        self.dispatch_failures = Counter(
            "disagg_dispatch_failures",
            "Dispatches to a worker that failed (retried elsewhere while nothing was streamed).",
            ["phase"],
            registry=r,
        )
        self.engine_steps = Gauge(
            "disagg_engine_steps",
            "Engine steps each worker ran since it started, as last polled.",
            ["worker"],
            registry=r,
        )
        self.engine_busy = Gauge(
            "disagg_engine_busy_seconds",
            "Wall seconds each worker's engine spent in its steps since it started, as last "
            "polled (against elapsed time: how busy the engine was).",
            ["worker"],
            registry=r,
        )
        self.handed_back = Counter(
            "disagg_handed_back",
            "Requests a generation worker preempted but could not recompute (their images "
            "were encoded on a context worker), resumed through a new context prefill.",
            registry=r,
        )
        self.worker_node = Gauge(
            "disagg_worker_node",
            "1 for each worker, labelled with its role and the address of its Ray node.",
            ["worker", "role", "node"],
            registry=r,
        )
        self.in_flight = Gauge(
            "disagg_requests_in_flight", "Requests being served right now.", registry=r
        )
        self._worker_nodes: dict[str, tuple[str, str]] = {}  # worker -> (role, node)

    def place_worker(self, worker: str, role: str, node: str) -> None:
        """Label `worker` with the node it runs on now; a worker Ray restarted
        on another node loses its old node's label."""
        previous = self._worker_nodes.get(worker)
        if previous == (role, node):
            return
        if previous is not None:
            self.worker_node.remove(worker, *previous)
        self.worker_node.labels(worker, role, node).set(1)
        self._worker_nodes[worker] = (role, node)

    def record_rank_caches(self, worker: str, ranks: Iterable[RankCacheUsage]) -> None:
        """Set the per-rank cache gauges of one worker instance from its load report."""
        for usage in ranks:
            rank = str(usage.rank)
            self.rank_blocks.labels(worker, rank, "used").set(usage.num_used_blocks)
            self.rank_blocks.labels(worker, rank, "total").set(usage.num_total_blocks)
            if usage.num_mamba_slots:
                slots = self.rank_mamba_slots
                slots.labels(worker, rank, "used").set(usage.num_used_mamba_slots)
                slots.labels(worker, rank, "total").set(usage.num_mamba_slots)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def record_speculation(self, worker: str, load: WorkerLoad) -> None:
        """A worker's speculative decoding totals, as its load report gives them."""
        for kind, value in (
            ("drafted", load.spec_drafted),
            ("accepted", load.spec_accepted),
            ("verifies", load.spec_verifies),
        ):
            self.spec_tokens.labels(worker, kind).set(value)
        for position, (drafted, accepted) in enumerate(
            zip(load.spec_drafted_at, load.spec_accepted_at, strict=True), start=1
        ):
            rate = accepted / drafted if drafted else 0.0
            self.spec_acceptance.labels(worker, str(position)).set(rate)

    def record_snapshots(self, worker: str, load: WorkerLoad) -> None:
        """A hybrid worker's snapshot store, as its load report gives it."""
        for kind, value in (
            ("hit", load.snapshot_hits),
            ("miss", load.snapshot_misses),
            ("evicted", load.snapshot_evictions),
            ("dropped", load.snapshot_drops),
            ("used", load.num_snapshots),
            ("total", load.num_snapshot_slots),
        ):
            self.snapshots.labels(worker, kind).set(value)
        self.snapshot_resumed_tokens.labels(worker).set(load.snapshot_resumed_tokens)
