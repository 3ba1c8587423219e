"""Disaggregation between instances of different tensor parallelism (TP 2 on
CPU, gloo): (context TP, generation TP) in (1, 2), (2, 1) and (2, 2) ==
transformers' greedy `generate`, token for token, on the Python transceiver
and, for the tiny Llama, on NIXL.

Each generation rank pulls its heads from every context rank: KV heads split
(tiny Llama, 2 KV heads at TP 2) and replicated (1 KV head: read from context
rank 0 only), a Nemotron-H with M, *, - and E layers (Mamba conv state per
x | B | C section, SSM state per head), and the Nemotron Omni VL wrapper with
an image in two of its prompts (rank 0 of the context instance encodes it;
the pulled cache holds its effect). Prompts longer than a prefill chunk
prefill in several steps (on the context instance, and on the generation
instance, which runs the same prompts whole beside the pulled ones: aggregated
TP 2 parity too), and the generation side's cache is small enough that they
cannot all decode at once (pinned smaller still while they start, so that one
is preempted whatever their timing). The managers differ across most pairs
(V1 <-> V2 bridged per segment). One Ray session for the module; one
checkpoint's four workers at a time.

A context instance of two ranks whose request is aborted as its cache is
published unpins it on both ranks at once, not when the lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import shutil
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
import transformers
from PIL import Image

from cluster.launch.launcher import init_local_ray
from decode_worker.worker import GenerationWorker
from engine.errors import RequestFailedError
from engine.messages import ContextRequest, GenerationRequest, TokenEvent
from engine.multimodal import ImageInput
from engine.request import Request
from engine.worker_config import WorkerConfig
from models.embedded.writer import write_checkpoint
from models.hf_config import load_model_config
from models.image_processing import (
    ImageProcessorConfig,
    image_prompt_text,
    load_image_processor_config,
    preprocess_image,
)
from prefill_worker.worker import ContextWorker
from tests.integration.test_serve_images import picture
from tests.integration.test_workers_parity import (
    CHUNK,
    CTX_MAX_TOKENS,
    LONGEST_PROMPT_BLOCKS,
    NEW_TOKENS,
    SECRET,
    _collect,
    _params,
    _reference,
)
from tests.launched_cluster import greedy_generate
from tests.pinned_blocks import until

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
VL = "nemotron_vl"
# The VL prompts with an image, and where it starts: its placeholders cross
# the first prefill chunk's end.
PROMPTS_WITH_IMAGES = (2, 3)
IMAGE_OFFSET = 10
LEASE_S = 60.0
# Far longer than an abort takes to unpin a cache on every rank.
ABORT_LEASE_S = 300.0
# Generation side: 64 tokens (8 blocks) of KV; the prompts take 11 blocks,
# twice that with the local run beside the pulled one. Pinned down to the
# longest prompt's blocks, it is short of that request's decode.
GEN_MAX_TOKENS = 64
# The VL model's generation side fits every request at once (all eight take
# 40 of its 64 blocks): none is preempted, whatever their timing. A pulled
# request with an image cannot be computed again there (its image bytes stay
# with the context worker): when no other request can give way, it is handed
# back with finish reason "preempted" for the router to resume, and no router
# runs here (tests/integration/test_vl_preemption.py covers that); chunked
# prefill and preemption are the other models' cases.
VL_GEN_MAX_TOKENS = 512


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
    init_local_ray(4, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module", params=["llama", "llama-one-kv-head", "nemotron_h", VL, NIXL])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    # A wide initializer keeps logits well separated: no greedy near-ties.
    if request.param == VL:  # transformers has the Omni wrapper's class
        return write_checkpoint(
            root / VL,
            VL,
            "tiny",
            seed=11,
            initializer_range=0.2,
            vl_architecture="NemotronH_Omni_Reasoning_V3",
        )
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
    # Ray's workers cannot import this test module: its classes travel by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actors: dict[tuple[str, int], Any] = {}
    nixl = checkpoint.name == NIXL
    gen_max_tokens = VL_GEN_MAX_TOKENS if checkpoint.name == VL else GEN_MAX_TOKENS
    for (role, size), manager in WORKERS.items():
        config = WorkerConfig(
            checkpoint=str(checkpoint),
            manager="v2" if nixl else manager,
            transceiver="nixl" if nixl else "python",
            block_size=8,
            max_tokens=CTX_MAX_TOKENS if role == "context" else gen_max_tokens,
            max_num_tokens=CHUNK,
            max_batch_size=8,
            lease_s=LEASE_S,
            transfer_timeout_s=60.0,
            cluster_secret=SECRET,
            tensor_parallel_size=size,
        )
        cls = ContextWorker if role == "context" else PinningGenerationWorker
        name = f"{role}-tp{size}"
        actors[(role, size)] = ray.remote(cls).options(num_cpus=0.25).remote(config, name)
    ray.get([actor.start.remote() for actor in actors.values()])
    yield actors
    ray.get([actor.shutdown.remote() for actor in actors.values()])
    for actor in actors.values():
        ray.kill(actor)


@pytest.fixture(scope="module")
def images(checkpoint: Path) -> list[tuple[ImageInput, ...]]:
    """Per prompt, its images: one in two of the VL model's prompts, none else."""
    if checkpoint.name != VL:
        return [() for _ in PROMPT_LENGTHS]
    processing = _processing(checkpoint)
    found: list[tuple[ImageInput, ...]] = []
    for i in range(len(PROMPT_LENGTHS)):
        if i not in PROMPTS_WITH_IMAGES:
            found.append(())
            continue
        buffer = io.BytesIO()
        picture(seed=i, width=128).save(buffer, format="PNG")
        grid = processing.patch_grid(64, 128)
        num_tokens = processing.num_image_tokens(grid)
        # The placeholders follow the image start text `<img>`.
        offset = IMAGE_OFFSET + _image_text(checkpoint, num_tokens).index(_image_token(checkpoint))
        data = buffer.getvalue()
        image = ImageInput(hashlib.sha256(data).digest(), data, grid, offset, num_tokens)
        found.append((image,))
    return found


def _processing(checkpoint: Path) -> ImageProcessorConfig:
    vision = load_model_config(checkpoint).vision
    assert vision is not None
    return load_image_processor_config(checkpoint, vision)


def _image_token(checkpoint: Path) -> int:
    vision = load_model_config(checkpoint).vision
    assert vision is not None
    return vision.image_token_id


def _image_text(checkpoint: Path, num_tokens: int) -> list[int]:
    """The token ids of an image's prompt text: `<img>`, one `<image>` per
    embedding, `</img>`."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    ids: list[int] = tokenizer(image_prompt_text(num_tokens, "<image>"), add_special_tokens=False)[
        "input_ids"
    ]
    assert ids.count(_image_token(checkpoint)) == num_tokens, ids
    return ids


@pytest.fixture(scope="module")
def prompts(checkpoint: Path, images: list[tuple[ImageInput, ...]]) -> list[list[int]]:
    """Random tokens; a prompt with an image holds its text at `IMAGE_OFFSET`."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 500, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    for prompt, with_images in zip(prompts, images, strict=True):
        for image in with_images:
            prompt[IMAGE_OFFSET:IMAGE_OFFSET] = _image_text(checkpoint, image.num_tokens)
    return prompts


@pytest.fixture(scope="module")
def reference(
    checkpoint: Path, prompts: list[list[int]], images: list[tuple[ImageInput, ...]]
) -> list[list[int]]:
    if checkpoint.name == VL:
        return _image_reference(checkpoint, prompts, images)
    return _reference(checkpoint, prompts)


def _image_reference(
    checkpoint: Path, prompts: list[list[int]], images: list[tuple[ImageInput, ...]]
) -> list[list[int]]:
    """transformers' Omni wrapper, greedy, with each prompt's image as pixels."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    model = NemotronH_Omni_Reasoning_V3.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processing = _processing(checkpoint)
    pixels: list[dict[str, torch.Tensor]] = []
    for with_images in images:
        inputs: dict[str, torch.Tensor] = {}
        for image in with_images:
            grid = image.grid_hw
            inputs["pixel_values"] = preprocess_image(
                Image.open(io.BytesIO(image.data)), grid, processing
            )
            inputs["image_grid_hw"] = torch.tensor(processing.encoder_grids(grid))
        pixels.append(inputs)
    return greedy_generate(model, prompts, NEW_TOKENS, pixels)


@pytest.mark.parametrize(("ctx_size", "gen_size"), PAIRS)
async def test_disaggregated_across_tensor_parallelism_equals_transformers(
    workers: dict[tuple[str, int], Any],
    prompts: list[list[int]],
    images: list[tuple[ImageInput, ...]],
    reference: list[list[int]],
    checkpoint: Path,
    ctx_size: int,
    gen_size: int,
) -> None:
    ctx, gen = workers[("context", ctx_size)], workers[("generation", gen_size)]
    tag = f"{checkpoint.name}-{ctx_size}-{gen_size}"
    stats_before = await gen.step_stats.remote()

    async def preempted() -> bool:
        stats = await gen.step_stats.remote()
        return bool(stats["preemptions"] > stats_before["preemptions"])

    results = await asyncio.gather(
        *[
            ctx.prefill.remote(ContextRequest(f"{tag}-{i}", p, _params(), images[i]))
            for i, p in enumerate(prompts)
        ]
    )
    # The pulled requests decode beside the same prompts run whole on the
    # generation instance: together they need far more blocks than it has
    # (but for the VL model's, see VL_GEN_MAX_TOKENS).
    # As the router sends them: a pulled request's images without their bytes.
    pulled = [
        GenerationRequest(r.request_id, p, _params(), r, tuple(i.without_data() for i in found))
        for r, p, found in zip(results, prompts, images, strict=True)
    ]
    local = [
        GenerationRequest(f"{tag}-local-{i}", p, _params(), images=images[i])
        for i, p in enumerate(prompts)
    ]

    def all_streams() -> asyncio.Future[list[list[TokenEvent]]]:
        return asyncio.gather(*[_collect(gen.generate.remote(r)) for r in (*pulled, *local)])

    if checkpoint.name == VL:
        streams = await all_streams()
    else:
        # Requests that arrive one after another may each find the cache to
        # themselves: pinned, it is short of the longest one's decode however
        # they arrive, so it (or another) is preempted before the pin goes.
        async with _blocks_pinned(gen, f"pin-{tag}", leave=LONGEST_PROMPT_BLOCKS):
            running = all_streams()
            await until(preempted, "preemption")
        streams = await running
    assert all(events[-1].finish_reason == "length" for events in streams), streams
    tokens = [[t for e in events for t in e.token_ids] for events in streams]
    firsts = [[r.first_token_id] for r in results]
    assert [f + t for f, t in zip(firsts, tokens[:4], strict=True)] == reference
    assert tokens[4:] == reference
    stats = await gen.step_stats.remote()
    assert stats["handed_back"] == stats_before["handed_back"]
    if checkpoint.name == VL:
        assert stats["preemptions"] == stats_before["preemptions"]
    # Nothing leaks: every block is free again on both sides once pulls
    # released, well before a lease would free it. (A NIXL holder hears of
    # the release by a notification, which may land after the last token.)
    await _until_idle(ctx, gen, within_s=LEASE_S / 4)


class PinningGenerationWorker(GenerationWorker):
    """A generation worker whose free blocks a test can hold, as the prefetch
    of `tests.pinned_blocks` holds them; an instance of several ranks starts
    no prefetch."""

    async def pin(self, pin_id: str, leave: int) -> None:
        """Allocate all free blocks but `leave` to `pin_id`, as a pull would."""
        await self.start()
        manager = self.engine.manager

        def allocate() -> bool:
            num_tokens = (manager.num_free_blocks - leave) * manager.block_size
            return num_tokens > 0 and manager.allocate_for_transfer(pin_id, num_tokens)

        assert await self._between_steps(allocate), f"cannot pin all free blocks but {leave}"

    async def unpin(self, pin_id: str) -> None:
        await self._between_steps(lambda: self.engine.manager.free(pin_id))


@contextlib.asynccontextmanager
async def _blocks_pinned(gen: Any, pin_id: str, leave: int) -> AsyncIterator[None]:
    """All of the idle `gen`'s free blocks but `leave` stay pinned inside the block."""
    await gen.pin.remote(pin_id, leave)
    try:
        yield
    finally:
        await gen.unpin.remote(pin_id)


async def _until_idle(*actors: Any, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    for actor in actors:
        while not (integrity := await actor.integrity.remote()).idle:
            assert time.monotonic() < deadline, integrity
            await asyncio.sleep(0.1)


class AbortedAsItPublishes(ContextWorker):
    """A context worker whose every request is aborted just as its cache is
    published: the router's abort (its client went away) overtaking the
    publish calls to ranks 1.."""

    def _publish(self, request: Request) -> None:
        super()._publish(request)
        self.abort(request.request_id)


async def test_an_abort_as_the_ranks_publish_unpins_every_rank_at_once(
    ray_session: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    llama = write_checkpoint(tmp_path_factory.mktemp("abort") / "llama", "llama", "tiny", seed=11)
    config = WorkerConfig(
        checkpoint=str(llama),
        manager="v2",
        transceiver="python",
        block_size=8,
        max_tokens=CTX_MAX_TOKENS,
        max_num_tokens=CHUNK,
        lease_s=ABORT_LEASE_S,
        cluster_secret=SECRET,
        tensor_parallel_size=2,
    )
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # as in `workers`
    ctx = ray.remote(AbortedAsItPublishes).options(num_cpus=0.25).remote(config, "abort-tp2")
    try:
        prompt = list(range(10, 47))  # three prefill chunks
        # Whether the caller still hears of the cache does not matter here.
        with contextlib.suppress(RequestFailedError):
            await ctx.prefill.remote(ContextRequest("abort-tp2", prompt, _params()))
        # Both ranks' pins go long before the lease would end them.
        await _until_idle(ctx, within_s=ABORT_LEASE_S / 10)
    finally:
        await ctx.shutdown.remote()
        ray.kill(ctx)
