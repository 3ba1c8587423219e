"""Greedy requests through a cluster launched in this process.

The launcher places each instance (a tensor-parallel one as one
placement-group bundle per rank, packed onto one node), a router sends whole
or disaggregated requests, and the outputs can be compared with
transformers' greedy `generate`. The GPU tests use it, and the gloo twin of
the NCCL cases (`tests/gpu/test_tensor_parallel_cluster.py`) runs the same
code on CPU: only `num_gpus` differs (a rank's device is "cuda" when it is
positive).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from cluster.config.plan import resolve_plan
from cluster.config.schema import config_from_dict
from cluster.launch.launcher import RunningCluster, launch
from cluster.metrics import ServingMetrics
from cluster.routing.policies import WorkerState
from cluster.routing.router import Router, RoutingSettings
from cluster.routing.worker_poller import WorkerEndpoint
from engine.sampling import SamplingParams

PROMPTS = [[11 + (5 * i + j) % 450 for j in range(9 + 17 * i)] for i in range(3)]
NEW_TOKENS = 8
# Every prompt runs whole on a generation instance under this limit.
ALL_LOCAL = 1 << 20


def router_over(cluster: RunningCluster, max_local_prefill_length: int) -> Router:
    """A round-robin router over the cluster's instances."""

    def endpoints(role: str) -> list[WorkerEndpoint]:
        return [
            WorkerEndpoint(i.plan.name, i.actor, WorkerState(i.plan.name))
            for i in cluster.actors(role)
        ]

    settings = RoutingSettings("round_robin", max_local_prefill_length, 16, 16)
    return Router(endpoints("context"), endpoints("generation"), settings, ServingMetrics())


async def greedy_outputs(
    router: Router, tag: str, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """Each prompt's `new_tokens` greedy tokens, all requests in flight together."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        events = [e async for e in router.generate(f"{tag}-{i}", prompt, params)]
        assert events[-1].finish_reason == "length", events[-1]
        return [t for e in events for t in e.token_ids]

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def cluster_config(
    checkpoint: Path, num_gpus: float, context_tp: int, generation_tp: int
) -> dict[str, Any]:
    """One generation instance of `generation_tp` ranks, and one context
    instance of `context_tp` ranks (none when 0: aggregated only)."""
    return {
        "model": str(checkpoint),
        "port": 0,
        "dtype": "float32",
        "cache_transceiver": {"backend": "python", "timeout_s": 60},
        "kv_cache": {"block_size": 16, "max_tokens": 1024},
        "max_num_tokens": 32,  # the longer prompts prefill in chunks
        "context_servers": {
            "num_instances": 1 if context_tp else 0,
            "tensor_parallel_size": max(1, context_tp),
            "num_gpus": num_gpus,
        },
        "generation_servers": {
            "num_instances": 1,
            "tensor_parallel_size": generation_tp,
            "num_gpus": num_gpus,
        },
    }


def context_parallel_refusal(checkpoint: Path) -> str | None:
    """Why this build refuses a tensor-parallel context instance, or None
    where it runs one (the config check is where that support is declared)."""
    try:
        config_from_dict(cluster_config(checkpoint, 0, 2, 1))
    except ValueError as error:
        return str(error)
    return None


async def serve_greedy(
    checkpoint: Path, num_gpus: float, context_tp: int, generation_tp: int
) -> list[list[int]]:
    """Launch the cluster, run `PROMPTS` (disaggregated when there is a
    context instance), check every instance ends idle, stop it."""
    plan = resolve_plan(
        config_from_dict(cluster_config(checkpoint, num_gpus, context_tp, generation_tp))
    )
    cluster = await launch(plan, 300)
    try:
        router = router_over(cluster, 0 if context_tp else ALL_LOCAL)
        tag = f"tp-{context_tp}-{generation_tp}"
        outputs = await greedy_outputs(router, tag, PROMPTS, NEW_TOKENS)
        for instance in cluster.instances:
            integrity = await instance.actor.integrity.remote()
            assert integrity.idle, integrity
        return outputs
    finally:
        await cluster.shutdown()


def transformers_greedy(
    checkpoint: Path, prompts: list[list[int]] = PROMPTS, new_tokens: int = NEW_TOKENS
) -> list[list[int]]:
    """transformers' greedy `generate` of each prompt on CPU, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return greedy_generate(model, prompts, new_tokens)


def greedy_generate(
    model: Any,
    prompts: list[list[int]],
    new_tokens: int,
    inputs: list[dict[str, torch.Tensor]] | None = None,
) -> list[list[int]]:
    """Exactly `new_tokens` greedy tokens of each prompt from a transformers
    model's `generate`; `inputs[i]` (pixels, say) goes with prompt `i`."""
    if inputs is not None and len(inputs) != len(prompts):
        raise ValueError(f"{len(inputs)} inputs for {len(prompts)} prompts")
    outputs = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
                **(inputs[i] if inputs is not None else {}),
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
