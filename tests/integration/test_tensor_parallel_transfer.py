"""Disaggregation between instances of different tensor parallelism (TP 2 on
CPU, gloo): (context TP, generation TP) in (1, 2), (2, 1) and (2, 2) ==
transformers' greedy `generate`, token for token, on the Python transceiver
and, for the tiny Llama, on NIXL.

Each generation rank pulls its heads from every context rank: KV heads split
(tiny Llama, 2 KV heads at TP 2) and replicated (1 KV head: read from context
rank 0 only), and a Nemotron-H with M, *, - and E layers (Mamba conv state per
x | B | C section, SSM state per head). Prompts longer than a prefill chunk
prefill in several steps (on the context instance, and on the generation
instance, which runs the same prompts whole beside the pulled ones: aggregated
TP 2 parity too), and the generation side's cache is small enough that this
forces preemption. The managers differ across
most pairs (V1 <-> V2 bridged per segment). One Ray session for the module;
one checkpoint's four workers at a time.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
import transformers

from decode_worker.worker import GenerationWorker
from engine.messages import ContextRequest, GenerationRequest
from engine.worker_config import WorkerConfig
from models.embedded.writer import write_checkpoint
from prefill_worker.worker import ContextWorker
from tests.integration.test_workers_parity import (
    CHUNK,
    CTX_MAX_TOKENS,
    SECRET,
    _collect,
    _params,
    _reference,
)

# (role, tensor_parallel_size) -> manager: pairs (1,2) v1->v2, (2,1) v2->v1, (2,2) v2->v2.
WORKERS = {
    ("context", 1): "v1",
    ("context", 2): "v2",
    ("generation", 1): "v1",
    ("generation", 2): "v2",
}
PAIRS = [(1, 2), (2, 1), (2, 2)]
# NIXL reads raw descriptors: one manager (V2) on every instance.
NIXL = "llama-nixl"
PROMPT_LENGTHS = (3, 9, 23, 37)
# Generation side: 64 tokens (8 blocks) of KV; the prompts take 11 blocks,
# twice that with the local run beside the pulled one.
GEN_MAX_TOKENS = 64


def _one_kv_head(source: Path, out: Path) -> Path:
    """The tiny Llama with one KV head (replicated on both ranks at TP 2)."""
    shutil.copytree(source, out)
    config = transformers.AutoConfig.from_pretrained(source)
    config.num_key_value_heads = 1
    torch.manual_seed(37)  # greedy never lands on EOS, which the reference suppresses
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module", params=["llama", "llama-one-kv-head", "nemotron_h", NIXL])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    # A wide initializer keeps logits well separated: no greedy near-ties.
    if request.param == "llama-one-kv-head":
        llama = write_checkpoint(root / "llama", "llama", "tiny", seed=11, initializer_range=0.2)
        return _one_kv_head(llama, root / request.param)
    if request.param == NIXL:  # the tiny Llama again, every instance on NIXL and V2
        return write_checkpoint(root / NIXL, "llama", "tiny", seed=11, initializer_range=0.2)
    return write_checkpoint(
        root / request.param, request.param, "tiny", seed=11, initializer_range=0.2
    )


@pytest.fixture(scope="module")
def workers(ray_session: None, checkpoint: Path) -> Iterator[dict[tuple[str, int], Any]]:
    actors: dict[tuple[str, int], Any] = {}
    nixl = checkpoint.name == NIXL
    for (role, size), manager in WORKERS.items():
        config = WorkerConfig(
            checkpoint=str(checkpoint),
            manager="v2" if nixl else manager,
            transceiver="nixl" if nixl else "python",
            block_size=8,
            max_tokens=CTX_MAX_TOKENS if role == "context" else GEN_MAX_TOKENS,
            max_num_tokens=CHUNK,
            max_batch_size=8,
            lease_s=60.0,
            transfer_timeout_s=60.0,
            cluster_secret=SECRET,
            tensor_parallel_size=size,
        )
        cls = ContextWorker if role == "context" else GenerationWorker
        name = f"{role}-tp{size}"
        actors[(role, size)] = ray.remote(cls).options(num_cpus=0.25).remote(config, name)
    ray.get([actor.start.remote() for actor in actors.values()])
    yield actors
    ray.get([actor.shutdown.remote() for actor in actors.values()])
    for actor in actors.values():
        ray.kill(actor)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(10, 500, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    return _reference(checkpoint, prompts)


@pytest.mark.parametrize(("ctx_size", "gen_size"), PAIRS)
async def test_disaggregated_across_tensor_parallelism_equals_transformers(
    workers: dict[tuple[str, int], Any],
    prompts: list[list[int]],
    reference: list[list[int]],
    checkpoint: Path,
    ctx_size: int,
    gen_size: int,
) -> None:
    ctx, gen = workers[("context", ctx_size)], workers[("generation", gen_size)]
    tag = f"{checkpoint.name}-{ctx_size}-{gen_size}"
    preemptions_before = (await gen.step_stats.remote())["preemptions"]
    results = await asyncio.gather(
        *[
            ctx.prefill.remote(ContextRequest(f"{tag}-{i}", p, _params()))
            for i, p in enumerate(prompts)
        ]
    )
    # The pulled requests decode beside the same prompts run whole on the
    # generation instance: together they need far more blocks than it has.
    pulled = [
        GenerationRequest(r.request_id, p, _params(), r)
        for r, p in zip(results, prompts, strict=True)
    ]
    local = [GenerationRequest(f"{tag}-local-{i}", p, _params()) for i, p in enumerate(prompts)]
    streams = await asyncio.gather(*[_collect(gen.generate.remote(r)) for r in (*pulled, *local)])
    tokens = [[t for e in events for t in e.token_ids] for events in streams]
    firsts = [[r.first_token_id] for r in results]
    assert [f + t for f, t in zip(firsts, tokens[:4], strict=True)] == reference
    assert tokens[4:] == reference
    assert (await gen.step_stats.remote())["preemptions"] > preemptions_before
    # Nothing leaks: every block is free again on both sides once pulls released.
    for actor in (ctx, gen):
        load = await actor.load.remote()
        assert load.num_running == load.num_waiting == load.num_transferring == 0, load
        assert load.num_free_blocks == load.num_total_blocks, load
