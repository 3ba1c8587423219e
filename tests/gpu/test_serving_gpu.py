"""1P1D on GPUs through the launcher and router: disaggregated == aggregated.

Each cluster is launched from a config as `disagg serve` would (placement
groups with GPU bundles; a worker's device is "cuda" when its `num_gpus` is
positive), and the same prompts run twice through a router: disaggregated
(prefill on the context worker, the cache pulled by the generation worker)
and whole on the generation worker. Greedy outputs must be equal token for
token, and both workers must end with every block free.

GPUs needed: `test_1p1d_one_gpu_per_worker` 2 (one per worker), for NIXL
(pools registered as VRAM) and the Python transceiver (device pools staged
through host chunks); `test_1p1d_sharing_one_gpu` 1 (`num_gpus: 0.5` each).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.config.plan import resolve_plan
from cluster.config.schema import config_from_dict
from cluster.launch.launcher import init_local_ray, launch
from cluster.routing.router import Router
from models.embedded.writer import write_checkpoint
from tests.launched_cluster import greedy_outputs, router_over

PROMPTS = [[11 + (5 * i + j) % 450 for j in range(9 + 17 * i)] for i in range(4)]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = write_checkpoint(tmp_path_factory.mktemp("gpu") / "llama", "llama", "tiny", seed=3)
    init_local_ray(4, log_to_driver=False)
    try:
        yield path
    finally:
        ray.shutdown()


def _config(checkpoint: Path, backend: str, num_gpus: float) -> dict[str, Any]:
    return {
        "model": str(checkpoint),
        "port": 0,
        "dtype": "float32",
        "cache_transceiver": {"backend": backend, "timeout_s": 30},
        "kv_cache": {"manager": "v1", "block_size": 16, "max_tokens": 2048},
        "context_servers": {"num_instances": 1, "num_gpus": num_gpus},
        "generation_servers": {"num_instances": 1, "num_gpus": num_gpus},
    }


async def _outputs(router: Router, tag: str) -> list[list[int]]:
    return await greedy_outputs(router, tag, PROMPTS, NEW_TOKENS)


async def _disaggregated_equals_aggregated(checkpoint: Path, backend: str, gpus: float) -> None:
    plan = resolve_plan(config_from_dict(_config(checkpoint, backend, gpus)))
    assert {i.device for i in plan.instances} == {"cuda"}
    cluster = await launch(plan, 300)
    try:
        disaggregated = await _outputs(router_over(cluster, 0), f"disagg-{backend}-{gpus}")
        aggregated = await _outputs(router_over(cluster, 1 << 20), f"whole-{backend}-{gpus}")
        assert disaggregated == aggregated
        for instance in cluster.instances:
            integrity = await instance.actor.integrity.remote()
            assert integrity.idle, integrity
    finally:
        await cluster.shutdown()


@pytest.mark.gpu(2)
@pytest.mark.parametrize("backend", ["nixl", "python"])
async def test_1p1d_one_gpu_per_worker(checkpoint: Path, backend: str) -> None:
    await _disaggregated_equals_aggregated(checkpoint, backend, 1.0)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("backend", ["nixl", "python"])
async def test_1p1d_sharing_one_gpu(checkpoint: Path, backend: str) -> None:
    await _disaggregated_equals_aggregated(checkpoint, backend, 0.5)


@pytest.mark.gpu(1)
async def test_two_half_gpu_instances_sized_by_memory_fraction_fit_together(
    checkpoint: Path,
) -> None:
    """Each worker sizes its cache from its half of the GPU after loading its
    weights: both start, serve, and together stay within the fraction (plus
    the CUDA contexts) whichever measured first."""
    import torch

    config = _config(checkpoint, "python", 0.5)
    config["kv_cache"] = {"manager": "v1", "block_size": 16, "memory_fraction": 0.4}
    plan = resolve_plan(config_from_dict(config))
    assert {i.num_blocks for i in plan.instances} == {None}
    cluster = await launch(plan, 300)
    try:
        outputs = await _outputs(router_over(cluster, 0), "by-memory")
        assert [len(o) for o in outputs] == [NEW_TOKENS] * len(PROMPTS)
        free, total = torch.cuda.mem_get_info()
        assert total - free <= 0.45 * total, (free, total)
    finally:
        await cluster.shutdown()
