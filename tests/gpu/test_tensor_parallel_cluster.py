"""Tensor-parallel instances launched as `disagg serve` would: NCCL on two
GPUs (one per rank), and the same code over gloo on CPU.

- aggregated TP 2: one generation instance of two ranks prefills (in chunks:
  the longer prompts take several steps) and decodes every request;
- context TP 2 -> generation TP 1: two context ranks prefill, the generation
  instance pulls each rank's heads. This build's config check says whether
  it runs a tensor-parallel context instance; where it refuses one, the case
  is skipped with that refusal.

Greedy tokens must equal transformers' (fp32) on the same checkpoint. The
NCCL cases need two CUDA devices and cover Llama (GQA, KV heads split) and
Nemotron-H (Mamba2, attention, MLP, MoE); the gloo case (context TP 2 ->
generation TP 1 on Nemotron-H) runs everywhere, so the helpers the GPU
cases use run on every `make test`. Aggregated TP 2 over gloo is served
through `disagg serve` in tests/integration/test_tensor_parallel_serve.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cluster.launch.launcher import init_local_ray
from models.embedded.writer import ensure_checkpoint
from tests.launched_cluster import context_parallel_refusal, serve_greedy, transformers_greedy

NCCL = [
    pytest.param("llama", 1, id="llama-nccl", marks=pytest.mark.gpu(2)),
    pytest.param("nemotron_h", 1, id="nemotron_h-nccl", marks=pytest.mark.gpu(2)),
]
CASES = [*NCCL, pytest.param("nemotron_h", 0, id="nemotron_h-gloo")]


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    init_local_ray(4, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _checkpoint(root: Path, arch: str) -> Path:
    # A wide initializer keeps greedy choices clear of near-ties.
    return ensure_checkpoint(root / arch, arch, "tiny", initializer_range=0.2)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp-cluster")


@pytest.mark.parametrize(("arch", "num_gpus"), NCCL)
async def test_aggregated_tp2_equals_transformers(
    ray_session: None, root: Path, arch: str, num_gpus: int
) -> None:
    checkpoint = _checkpoint(root, arch)
    outputs = await serve_greedy(checkpoint, num_gpus, context_tp=0, generation_tp=2)
    assert outputs == transformers_greedy(checkpoint)


@pytest.mark.parametrize(("arch", "num_gpus"), CASES)
async def test_context_tp2_to_generation_tp1_equals_transformers(
    ray_session: None, root: Path, arch: str, num_gpus: int
) -> None:
    checkpoint = _checkpoint(root, arch)
    refusal = context_parallel_refusal(checkpoint)
    if refusal is not None:
        pytest.skip(refusal)
    outputs = await serve_greedy(checkpoint, num_gpus, context_tp=2, generation_tp=1)
    assert outputs == transformers_greedy(checkpoint)
