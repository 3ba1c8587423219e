"""A pulled image request that its generation worker must preempt is handed
back and resumed, with the same greedy tokens as a run without preemption.

The generation worker holds only the image's hash (its bytes stay with the
context worker), so it cannot recompute the request: it ends it with
"preempted", and the router prefills the prompt plus the tokens already sent
on the context worker again (which encodes the image again) and pulls that.

To preempt it deterministically, every block of the generation worker but
the request's own prompt blocks stays pinned (`tests.pinned_blocks`) until
the test has seen the hand-back: the request runs alone, and its first
decode that needs a new block finds none.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.launch.launcher import init_local_ray
from cluster.metrics import ServingMetrics
from cluster.routing.policies import WorkerState
from cluster.routing.router import Router, RoutingSettings
from cluster.routing.worker_poller import WorkerEndpoint
from decode_worker.worker import GenerationWorker
from engine.multimodal import ImageInput
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig
from models.embedded.writer import write_checkpoint
from prefill_worker.worker import ContextWorker
from tests.integration.test_serve_images import picture
from tests.integration.test_tensor_parallel_transfer import _image_text, _image_token, _processing
from tests.pinned_blocks import blocks_pinned, until

BLOCK = 8
NEW_TOKENS = 10  # more than a block: the request needs a new block as it decodes
IMAGE_OFFSET = 4
# The generation side fits the request alone with room to spare, which the
# pin takes.
GEN_MAX_TOKENS = 256
SECRET = "handback-secret"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vl-preemption")
    # A wide initializer keeps logits well separated: no greedy near-ties.
    return write_checkpoint(root / "vl", "nemotron_vl", "tiny", seed=11, initializer_range=0.2)


@pytest.fixture(scope="module")
def image_request(checkpoint: Path) -> tuple[list[int], ImageInput]:
    """A prompt with one image's placeholders at `IMAGE_OFFSET`, and the image."""
    processing = _processing(checkpoint)
    buffer = io.BytesIO()
    picture(seed=3, width=128).save(buffer, format="PNG")
    grid = processing.patch_grid(64, 128)
    num_tokens = processing.num_image_tokens(grid)
    text = _image_text(checkpoint, num_tokens)
    prompt = [*range(20, 20 + IMAGE_OFFSET), *text, *range(30, 45)]
    data = buffer.getvalue()
    offset = IMAGE_OFFSET + text.index(_image_token(checkpoint))
    return prompt, ImageInput(hashlib.sha256(data).digest(), data, grid, offset, num_tokens)


@pytest.fixture(scope="module")
def workers(checkpoint: Path) -> Iterator[tuple[Any, Any]]:
    init_local_ray(2, log_to_driver=False)
    actors = []
    try:
        for role, cls, max_tokens in (
            ("context", ContextWorker, 512),
            ("generation", GenerationWorker, GEN_MAX_TOKENS),
        ):
            config = WorkerConfig(
                checkpoint=str(checkpoint),
                block_size=BLOCK,
                max_tokens=max_tokens,
                max_num_tokens=64,
                max_batch_size=4,
                transfer_timeout_s=60.0,
                cluster_secret=SECRET,
            )
            name = f"handback-{role}"
            actors.append(ray.remote(cls).options(num_cpus=0.25).remote(config, name))
        ray.get([actor.start.remote() for actor in actors])
        yield actors[0], actors[1]
        ray.get([actor.shutdown.remote() for actor in actors])
    finally:
        for actor in actors:
            ray.kill(actor)
        ray.shutdown()


def _router(ctx: Any, gen: Any) -> Router:
    """Every request disaggregated: the context worker encodes the image."""
    settings = RoutingSettings("round_robin", 0, BLOCK, BLOCK)
    endpoints = [WorkerEndpoint(n, a, WorkerState(n)) for n, a in (("ctx", ctx), ("gen", gen))]
    return Router(endpoints[:1], endpoints[1:], settings, ServingMetrics())


async def _tokens(router: Router, rid: str, prompt: list[int], image: ImageInput) -> list[int]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    events = [e async for e in router.generate(rid, prompt, params, (image,))]
    assert events[-1].finish_reason == "length", events[-1]
    assert all(e.num_prompt_tokens == len(prompt) for e in events), events
    return [t for e in events for t in e.token_ids]


async def test_a_preempted_image_request_resumes_with_the_same_tokens(
    workers: tuple[Any, Any], image_request: tuple[list[int], ImageInput]
) -> None:
    ctx, gen = workers
    prompt, image = image_request
    router = _router(ctx, gen)
    alone = await _tokens(router, "alone", prompt, image)
    assert (await gen.step_stats.remote())["handed_back"] == 0

    async def handed_back() -> bool:
        return bool((await gen.step_stats.remote())["handed_back"] == 1)

    prompt_blocks = -(-len(prompt) // BLOCK)
    async with blocks_pinned(gen, ctx, "pin", leave=prompt_blocks, block_size=BLOCK):
        squeezed = asyncio.ensure_future(_tokens(router, "squeezed", prompt, image))
        await until(handed_back, "hand-back")
    # Unpinned: the resumed request's pull finds room.
    assert await squeezed == alone
    assert router.metrics.handed_back._value.get() == 1
    for actor in (ctx, gen):

        async def idle(actor: Any = actor) -> bool:
            return bool((await actor.integrity.remote()).idle)

        await until(idle, "idle cache")
