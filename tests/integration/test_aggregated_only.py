"""An aggregated-only cluster (`context_servers.num_instances: 0`) served end to end.

Its generation instance runs every request whole, as an "aggregated" worker
with no transceiver, and gets the Ray CPU grant (and torch threads) its
section's `num_cpus` asks for.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx

from cluster.config.plan import resolve_plan
from cluster.config.reader import load_config
from cluster.serving import ServingCluster
from engine.process_env import CPU_ENGINE_ENV
from models.embedded.writer import write_checkpoint

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "aggregated.yaml"


async def test_an_aggregated_only_cluster_serves_whole_requests_on_its_cpu_grant(
    tmp_path: Path,
) -> None:
    checkpoint = write_checkpoint(tmp_path / "llama", "llama", "tiny")
    config = load_config(CONFIG).model_copy(update={"model": str(checkpoint), "port": 0})
    plan = resolve_plan(config)
    async with ServingCluster(config, plan) as serving:
        assert serving.cluster is not None and not serving.cluster.actors("context")
        [instance] = serving.cluster.actors("generation")
        health = await instance.actor.health.remote()
        assert health.role == "aggregated" and health.torch_threads == 2
        # Its OpenMP threads spin briefly between parallel regions, and its
        # malloc keeps freed activations (`engine.process_env`).
        env = await instance.actor.__ray_call__.remote(lambda _self: dict(os.environ))
        assert env["GOMP_SPINCOUNT"] == CPU_ENGINE_ENV["GOMP_SPINCOUNT"] and "PYTHONPATH" in env
        assert env["MALLOC_ARENA_MAX"] == "1"
        # It runs at this process's niceness, not at the 15 Ray gives its
        # workers, below the router and everything else on the node.
        niceness = await instance.actor.__ray_call__.remote(
            lambda _self: os.getpriority(os.PRIO_PROCESS, 0)
        )
        assert niceness == os.getpriority(os.PRIO_PROCESS, 0)
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:
            model = (await client.get("/models")).json()["data"][0]["id"]
            body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 5, "ignore_eos": True}
            reply = await client.post("/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5
        routed = serving.metrics.registry.get_sample_value(
            "disagg_routed_requests_total", {"worker": instance.plan.name, "phase": "whole"}
        )
        assert routed == 1
        # The HTTP server exits on its own (as uvicorn does on a signal it
        # caught): waiting for the stop returns, and the URL is still the one
        # bound, though the server closed its socket.
        url = serving.url
        assert serving._server is not None
        serving._server.should_exit = True
        await asyncio.wait_for(serving.wait_stopped(), 30)
        assert serving.url == url
