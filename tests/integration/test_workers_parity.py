"""Mode parity on a local Ray cluster: 1P1D (each transceiver, each allowed
manager pair) == aggregated == transformers' greedy `generate`, token for token.

One Ray session and one set of worker actors per module. Prompts of mixed
lengths include ones longer than a prefill chunk, and the generation side's
cache is small enough that decoding them together forces preemption (pinned
smaller still while the disaggregated requests start, so that it does
whatever their timing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from cluster.launch.launcher import init_local_ray
from decode_worker.worker import GenerationWorker
from engine.errors import RequestFailedError
from engine.messages import ContextRequest, GenerationRequest, PrefetchRequest, TokenEvent
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig
from models.embedded.writer import write_checkpoint
from prefill_worker.worker import ContextWorker
from tests.launched_cluster import transformers_greedy
from tests.pinned_blocks import blocks_pinned, until

NEW_TOKENS = 10
CHUNK = 16  # max_num_tokens: prompts of 23 and 37 tokens take several steps
PROMPT_LENGTHS = (3, 9, 23, 37)
# Generation side: 96 tokens of KV. All four requests need 72 + 4 x 10 = 112,
# so they cannot all decode at once; the longest alone needs 47.
GEN_MAX_TOKENS = 96
# The longest prompt's blocks: its decode needs one more.
LONGEST_PROMPT_BLOCKS = -(-max(PROMPT_LENGTHS) // 8)
CTX_MAX_TOKENS = 160
SECRET = "parity-secret"

# (arch, context manager, generation manager, transceiver)
PAIRS = [
    ("llama", "v1", "v1", "python"),
    ("llama", "v1", "v2", "python"),
    ("llama", "v2", "v1", "python"),
    ("llama", "v2", "v2", "python"),
    ("llama", "v1", "v1", "nixl"),
    ("llama", "v2", "v2", "nixl"),
    ("nemotron_h", "v2", "v1", "python"),
    ("nemotron_h", "v2", "v2", "python"),
    ("nemotron_vl", "v2", "v2", "python"),
]


def _worker_keys() -> set[tuple[str, str, str, str]]:
    keys = set()
    for arch, ctx, gen, xcvr in PAIRS:
        keys.add(("context", arch, ctx, xcvr))
        keys.add(("generation", arch, gen, xcvr))
    return keys


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity")
    # A wide initializer keeps logits well separated, so greedy ties cannot
    # flip on float noise between implementations.
    return {
        arch: write_checkpoint(root / arch, arch, "tiny", seed=11, initializer_range=0.2)
        for arch in ("llama", "nemotron_h", "nemotron_vl")
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(10, 500, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def ray_session() -> Any:
    init_local_ray(4, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def workers(ray_session: Any, checkpoints: dict[str, Path]) -> dict[tuple[str, ...], Any]:
    actors: dict[tuple[str, ...], Any] = {}
    for key in sorted(_worker_keys()):
        role, arch, manager, xcvr = key
        config = WorkerConfig(
            checkpoint=str(checkpoints[arch]),
            manager=manager,
            transceiver=xcvr,
            block_size=8,
            max_tokens=CTX_MAX_TOKENS if role == "context" else GEN_MAX_TOKENS,
            max_num_tokens=CHUNK,
            max_batch_size=8,
            lease_s=60.0,
            transfer_timeout_s=30.0,
            cluster_secret=SECRET,
        )
        cls = ContextWorker if role == "context" else GenerationWorker
        name = "-".join(key)
        actors[key] = ray.remote(cls).options(num_cpus=0.25, name=name).remote(config, name)
    ray.get([actor.start.remote() for actor in actors.values()])
    yield actors
    ray.get([actor.shutdown.remote() for actor in actors.values()])
    for actor in actors.values():
        ray.kill(actor)


def _params() -> Any:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _reference(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate; VL wrappers run their language model."""
    config = json.loads((checkpoint / "config.json").read_text())
    if "llm_config" in config:
        checkpoint = _language_model_checkpoint(checkpoint, config["llm_config"])
    return transformers_greedy(checkpoint, prompts, NEW_TOKENS)


def _language_model_checkpoint(checkpoint: Path, llm_config: dict[str, Any]) -> Path:
    """The wrapper's language model as a standalone checkpoint next to it, so
    transformers loads it with its own name conversions."""
    from safetensors.torch import load_file, save_file

    out = checkpoint.parent / f"{checkpoint.name}-language-model"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(llm_config))
    prefix = "language_model."
    weights = load_file(str(checkpoint / "model.safetensors"))
    save_file(
        {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)},
        str(out / "model.safetensors"),
    )
    return out


@pytest.fixture(scope="module")
def references(
    checkpoints: dict[str, Path], prompts: list[list[int]]
) -> dict[str, list[list[int]]]:
    """Computed per architecture on first use, then shared by its pairs."""
    return _References(checkpoints, prompts)


class _References(dict[str, list[list[int]]]):
    def __init__(self, checkpoints: dict[str, Path], prompts: list[list[int]]) -> None:
        super().__init__()
        self._checkpoints, self._prompts = checkpoints, prompts

    def __missing__(self, arch: str) -> list[list[int]]:
        self[arch] = _reference(self._checkpoints[arch], self._prompts)
        return self[arch]


async def _collect(stream: Any) -> list[TokenEvent]:
    events = []
    async for ref in stream:
        events.append(await ref)
    return events


async def _disaggregated(ctx: Any, gen: Any, rid: str, prompt: list[int]) -> list[int]:
    result = await ctx.prefill.remote(ContextRequest(rid, prompt, _params()))
    assert result.handle is not None and result.finish_reason is None
    events = await _collect(gen.generate.remote(GenerationRequest(rid, prompt, _params(), result)))
    assert events[-1].finish_reason == "length", events[-1]
    return [result.first_token_id] + [t for e in events for t in e.token_ids]


async def _pipelined(ctx: Any, gen: Any, rid: str, prompt: list[int]) -> list[int]:
    """As the router runs a prompt longer than a chunk: the generation worker
    prefetches while the context worker prefills, then the submit joins it."""
    await gen.prefetch.remote(PrefetchRequest(rid, prompt, ctx))
    return await _disaggregated(ctx, gen, rid, prompt)


async def _aggregated(gen: Any, rid: str, prompt: list[int]) -> list[int]:
    events = await _collect(gen.generate.remote(GenerationRequest(rid, prompt, _params())))
    assert events[-1].finish_reason == "length", events[-1]
    return [t for e in events for t in e.token_ids]


def _pair(
    workers: dict[tuple[str, ...], Any], arch: str, ctx_mgr: str, gen_mgr: str, xcvr: str
) -> tuple[Any, Any, str]:
    """The context and generation actors of one pair, and a tag for request ids."""
    ctx = workers[("context", arch, ctx_mgr, xcvr)]
    gen = workers[("generation", arch, gen_mgr, xcvr)]
    return ctx, gen, f"{arch}-{ctx_mgr}-{gen_mgr}-{xcvr}"


@pytest.mark.parametrize(("arch", "ctx_mgr", "gen_mgr", "xcvr"), PAIRS)
async def test_disaggregated_equals_aggregated_equals_transformers(
    workers: dict[tuple[str, ...], Any],
    references: dict[str, list[list[int]]],
    prompts: list[list[int]],
    arch: str,
    ctx_mgr: str,
    gen_mgr: str,
    xcvr: str,
) -> None:
    ctx, gen, tag = _pair(workers, arch, ctx_mgr, gen_mgr, xcvr)
    preemptions_before = (await gen.step_stats.remote())["preemptions"]

    async def preempted() -> bool:
        return bool((await gen.step_stats.remote())["preemptions"] > preemptions_before)

    # Requests that arrive one after another may each find the cache to
    # themselves. Pinned down to the longest prompt's blocks, the cache is
    # short of that request's decode, however they arrive: it (or another)
    # is preempted before the pin goes.
    async with blocks_pinned(gen, ctx, f"pin-{tag}", leave=LONGEST_PROMPT_BLOCKS, block_size=8):
        disaggregated = asyncio.gather(
            *[_disaggregated(ctx, gen, f"d-{tag}-{i}", p) for i, p in enumerate(prompts)]
        )
        await until(preempted, "preemption")
    disagg = await disaggregated
    aggregated = await asyncio.gather(
        *[_aggregated(gen, f"a-{tag}-{i}", p) for i, p in enumerate(prompts)]
    )
    assert disagg == references[arch]
    assert aggregated == references[arch]
    # Nothing leaks: every block is free again on both sides once pulls released.
    for actor in (ctx, gen):
        load = await actor.load.remote()
        assert load.num_running == load.num_waiting == 0
        assert load.num_free_blocks == load.num_total_blocks, load


LLAMA_CTX = ("context", "llama", "v1", "python")
LLAMA_GEN = ("generation", "llama", "v1", "python")
LLAMA_CTX_PIPELINE = ("context", "llama", "v2", "python")
LONG_PROMPT = 80  # five prefill chunks on the context side; fits the generation cache


def _llama_config(checkpoints: dict[str, Path], **fields: Any) -> WorkerConfig:
    """An in-process worker's config over the tiny Llama checkpoint."""
    return WorkerConfig(
        checkpoint=str(checkpoints["llama"]), block_size=8, cluster_secret=SECRET, **fields
    )


def _assert_unpinned(worker: ContextWorker | GenerationWorker) -> None:
    """Nothing pinned or in transfer, every block free (an in-process worker)."""
    load = worker.load()
    assert load.num_transferring == 0 and load.num_free_blocks == load.num_total_blocks, load


async def _assert_idle(actor: Any) -> None:
    load = await actor.load.remote()
    assert load.num_running == load.num_waiting == load.num_transferring == 0, load
    assert load.num_free_blocks == load.num_total_blocks, load


async def test_workers_are_healthy_and_size_torch_threads_from_their_cpu_grant(
    workers: dict[tuple[str, ...], Any],
) -> None:
    health = await workers[LLAMA_GEN].health.remote()
    assert health.healthy and health.role == "generation"
    assert health.torch_threads == 1  # num_cpus=0.25 rounds to one thread


async def test_abort_ends_the_stream_and_frees_the_cache(
    workers: dict[tuple[str, ...], Any], prompts: list[list[int]]
) -> None:
    gen = workers[LLAMA_GEN]
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    stream = gen.generate.remote(GenerationRequest("abort-me", prompts[0], params))
    first = await (await stream.__anext__())
    assert first.token_ids and not first.finished
    await gen.abort.remote("abort-me")
    rest = await _collect(stream)
    assert rest[-1].finish_reason == "abort"
    assert 1 + sum(len(e.token_ids) for e in rest) < 80
    await _assert_idle(gen)


async def test_prompt_larger_than_the_cache_fails_with_a_clear_error(
    workers: dict[tuple[str, ...], Any],
) -> None:
    prompt = list(range(10, 10 + CTX_MAX_TOKENS + 1))
    with pytest.raises(RequestFailedError, match="raise max_tokens"):
        await workers[LLAMA_CTX].prefill.remote(ContextRequest("too-long-c", prompt, _params()))
    events = await _collect(
        workers[LLAMA_GEN].generate.remote(GenerationRequest("too-long-g", prompt, _params()))
    )
    assert events[-1].finish_reason == "error" and "raise max_tokens" in (events[-1].error or "")
    await _assert_idle(workers[LLAMA_CTX])
    await _assert_idle(workers[LLAMA_GEN])


async def test_request_done_at_its_first_token_pins_nothing(
    workers: dict[tuple[str, ...], Any], prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    result = await workers[LLAMA_CTX].prefill.remote(ContextRequest("one", prompts[2], params))
    assert result.handle is None and result.finish_reason == "length"
    await _assert_idle(workers[LLAMA_CTX])


async def test_unpulled_cache_is_freed_when_its_lease_expires(
    checkpoints: dict[str, Path], prompts: list[list[int]]
) -> None:
    config = _llama_config(checkpoints, max_tokens=CTX_MAX_TOKENS, lease_s=0.3)
    ctx = ContextWorker(config, "lease-test")
    await ctx.start()
    try:
        result = await ctx.prefill(ContextRequest("lease", prompts[3], _params()))
        assert result.handle is not None
        load = ctx.load()
        assert load.num_transferring == 1 and load.num_free_blocks < load.num_total_blocks
        await asyncio.sleep(0.6)
        _assert_unpinned(ctx)
    finally:
        await ctx.shutdown()


async def test_a_prefill_that_arrives_after_its_abort_is_refused_and_pins_nothing(
    checkpoints: dict[str, Path], prompts: list[list[int]]
) -> None:
    config = _llama_config(checkpoints, max_tokens=CTX_MAX_TOKENS)
    ctx = ContextWorker(config, "late-abort-test")
    await ctx.start()
    try:
        ctx.abort("late")  # the router's abort overtook its prefill call
        with pytest.raises(RequestFailedError, match="aborted before it reached"):
            await ctx.prefill(ContextRequest("late", prompts[3], _params()))
        _assert_unpinned(ctx)
        # The id is consumed: the next request runs, and aborting it after it
        # was published unpins it at once instead of remembering the id.
        result = await ctx.prefill(ContextRequest("late", prompts[3], _params()))
        assert result.handle is not None and ctx.load().num_transferring == 1
        ctx.abort("late")
        await asyncio.sleep(0.05)
        _assert_unpinned(ctx)
        assert len(ctx._aborted) == 0
    finally:
        await ctx.shutdown()


async def test_an_abort_during_the_step_that_finishes_the_prompt_unpins_it(
    checkpoints: dict[str, Path], prompts: list[list[int]]
) -> None:
    """The abort lands while the model computes the prompt's last chunk: the
    step still hands the prompt off and publishes its cache after the abort
    ran, and that publish is released too, not kept until its lease."""
    config = _llama_config(checkpoints, max_tokens=CTX_MAX_TOKENS)
    ctx = ContextWorker(config, "abort-in-step")
    await ctx.start()
    computing, proceed = threading.Event(), threading.Event()
    execute = ctx.engine.core.execute

    def held_execute(plan: Any) -> Any:
        computing.set()
        proceed.wait(10)
        return execute(plan)

    ctx.engine.core.execute = held_execute  # type: ignore[method-assign]
    try:
        prefill = asyncio.ensure_future(ctx.prefill(ContextRequest("mid", prompts[3], _params())))
        while not computing.is_set():
            await asyncio.sleep(0.005)
        ctx.abort("mid")  # the router gave up on it
        proceed.set()
        with contextlib.suppress(RequestFailedError):
            await asyncio.wait_for(prefill, 10)
        for _ in range(100):
            if ctx.load().num_transferring == 0:
                break
            await asyncio.sleep(0.01)
        _assert_unpinned(ctx)
    finally:
        proceed.set()
        await ctx.shutdown()


async def test_an_abort_after_submit_ran_cancels_without_refusing_the_id_later(
    checkpoints: dict[str, Path], prompts: list[list[int]]
) -> None:
    # The router's clean-up when a worker's event stream broke after `submit`
    # ran: it must not turn into a refusal of a retry with the same id.
    worker = GenerationWorker(_llama_config(checkpoints), "forget-test", role="aggregated")
    await worker.start()
    try:
        worker.abort("gone", remember=False)  # no such request here: nothing to do
        assert len(worker._aborted) == 0
        events = [
            e async for e in worker.generate(GenerationRequest("gone", prompts[1], _params()))
        ]
        assert events[-1].finish_reason == "length"
        stream = worker.generate(GenerationRequest("running", prompts[1], _params()))
        first = await anext(stream)
        assert first.token_ids
        worker.abort("running", remember=False)  # still here: cancelled
        rest = [e async for e in stream]
        assert rest[-1].finish_reason == "abort"
        await asyncio.sleep(0.05)
        _assert_unpinned(worker)
    finally:
        await worker.shutdown()


async def test_prefix_reuse_skips_cached_blocks_and_keeps_outputs(
    checkpoints: dict[str, Path],
    prompts: list[list[int]],
    references: dict[str, list[list[int]]],
) -> None:
    config = WorkerConfig(
        checkpoint=str(checkpoints["llama"]),
        manager="v2",
        block_size=8,
        max_tokens=GEN_MAX_TOKENS,
        max_num_tokens=CHUNK,
        enable_block_reuse=True,
    )
    worker = GenerationWorker(config, "reuse-test", role="aggregated")
    await worker.start()
    try:
        for attempt in range(2):
            rid = f"reuse-{attempt}"
            events = [
                e async for e in worker.generate(GenerationRequest(rid, prompts[3], _params()))
            ]
            assert [t for e in events for t in e.token_ids] == references["llama"][3]
            # 37 prompt tokens: the second run finds its 4 full blocks cached.
            assert events[-1].num_cached_tokens == (0 if attempt == 0 else 32)
    finally:
        await worker.shutdown()


async def test_failed_pull_reports_an_error_and_leaks_nothing(
    checkpoints: dict[str, Path], prompts: list[list[int]]
) -> None:
    config = _llama_config(checkpoints, max_tokens=GEN_MAX_TOKENS, transfer_timeout_s=5.0)
    ctx = ContextWorker(config, "gone-context")
    gen = GenerationWorker(config, "pulling-generation")
    await ctx.start()
    await gen.start()
    try:
        result = await ctx.prefill(ContextRequest("orphan", prompts[2], _params()))
        await ctx.shutdown()  # the holder goes away before the pull
        assert ctx.load().num_free_blocks == ctx.load().num_total_blocks
        request = GenerationRequest("orphan", prompts[2], _params(), result)
        events = [e async for e in gen.generate(request)]
        assert events[-1].finish_reason == "error"
        assert "cache transfer failed" in (events[-1].error or "")
        await asyncio.sleep(0.05)  # the free runs between engine steps
        _assert_unpinned(gen)
    finally:
        await gen.shutdown()


async def test_stop_tokens_and_seeded_sampling_through_the_engine(
    checkpoints: dict[str, Path],
    prompts: list[list[int]],
    references: dict[str, list[list[int]]],
) -> None:
    config = WorkerConfig(checkpoint=str(checkpoints["llama"]), block_size=8, max_tokens=256)
    worker = GenerationWorker(config, "sampling-test", role="aggregated")
    await worker.start()

    async def run(rid: str, params: Any) -> list[TokenEvent]:
        request = GenerationRequest(rid, prompts[1], params)
        return [e async for e in worker.generate(request)]

    try:
        expected = references["llama"][1]
        stop = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=(expected[3],))
        events = await run("stop", stop)
        cut = expected.index(expected[3]) + 1  # the first occurrence ends it
        assert [t for e in events for t in e.token_ids] == expected[:cut]
        assert events[-1].finish_reason == "stop"
        seeded = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=1234)
        first = await run("seed-a", seeded)
        second = await run("seed-b", seeded)
        assert [e.token_ids for e in first] == [e.token_ids for e in second]
    finally:
        await worker.shutdown()


# Llama on V1. V2 at TP 2 (Llama, Nemotron-H, the VL wrapper) runs whole
# prompts beside its pulled ones, with chunked prefill and preemption, in
# test_tensor_parallel_transfer.py.
@pytest.mark.parametrize(("arch", "manager"), [("llama", "v1")])
async def test_a_tensor_parallel_aggregated_instance_equals_transformers(
    ray_session: Any,
    checkpoints: dict[str, Path],
    references: dict[str, list[list[int]]],
    prompts: list[list[int]],
    arch: str,
    manager: str,
) -> None:
    """Two ranks (gloo) with the generation side's small cache: chunked prefill
    and preemption happen on rank 0's schedule, every rank runs each step."""
    config = WorkerConfig(
        checkpoint=str(checkpoints[arch]),
        manager=manager,
        block_size=8,
        max_tokens=GEN_MAX_TOKENS,
        max_num_tokens=CHUNK,
        max_batch_size=8,
        cluster_secret=SECRET,
        tensor_parallel_size=2,
    )
    name = f"tp2-{arch}"
    actor = ray.remote(GenerationWorker).options(num_cpus=0.25, name=name)
    worker = actor.remote(config, name, "aggregated")
    try:
        await worker.start.remote()
        outputs = await asyncio.gather(
            *[_aggregated(worker, f"{name}-{i}", p) for i, p in enumerate(prompts)]
        )
        assert outputs == references[arch]
        assert (await worker.step_stats.remote())["preemptions"] > 0
        await _assert_idle(worker)
    finally:
        await worker.shutdown.remote()
        ray.kill(worker)


# Chunk-pipelined pulls: both transceivers, both managers (and V1 <-> V2), both
# model families; the generation side preempts as in the parity test above.
PIPELINED = [
    ("llama", "v1", "v2", "python"),
    ("llama", "v2", "v2", "nixl"),
    ("llama", "v1", "v1", "nixl"),
    ("nemotron_h", "v2", "v1", "python"),
    ("nemotron_h", "v2", "v2", "python"),
]


@pytest.mark.parametrize(("arch", "ctx_mgr", "gen_mgr", "xcvr"), PIPELINED)
async def test_pipelined_disaggregation_equals_transformers(
    workers: dict[tuple[str, ...], Any],
    references: dict[str, list[list[int]]],
    prompts: list[list[int]],
    arch: str,
    ctx_mgr: str,
    gen_mgr: str,
    xcvr: str,
) -> None:
    ctx, gen, tag = _pair(workers, arch, ctx_mgr, gen_mgr, xcvr)
    before = await gen.step_stats.remote()
    # Each prompt twice: pulls placed early must still overflow the generation cache.
    outputs = await asyncio.gather(
        *[_pipelined(ctx, gen, f"p-{tag}-{i}", p) for i, p in enumerate(prompts + prompts)]
    )
    assert outputs == references[arch] + references[arch]
    after = await gen.step_stats.remote()
    assert after["preemptions"] > before["preemptions"]
    for actor in (ctx, gen):
        integrity = await actor.integrity.remote()
        assert integrity.idle, integrity


async def test_offered_blocks_are_final_before_the_prompt_is_published(
    workers: dict[tuple[str, ...], Any],
) -> None:
    """The holder's side of the protocol: offers while it prefills, then the rest."""
    ctx = workers[LLAMA_CTX_PIPELINE]
    prompt = list(range(10, 10 + LONG_PROMPT))
    rid = "offers"
    first = ctx.blocks_ready.remote(rid, 0)  # may run before the prefill: it waits
    prefill = ctx.prefill.remote(ContextRequest(rid, prompt, _params()))
    ready = await first
    assert ready.handle is not None and not ready.final
    assert ready.first_block == 0 and 2 <= ready.end_block < LONG_PROMPT // 8
    assert {j for _, j in ready.handle.regions.kv_segments} == set(range(ready.end_block))
    result = await prefill
    rest = await ctx.blocks_ready.remote(rid, ready.end_block)
    assert rest.final and rest.handle is not None
    assert rest.handle.transfer_id == ready.handle.transfer_id == result.handle.transfer_id
    assert rest.end_block == -(-LONG_PROMPT // 8)
    assert rest.handle.regions.block_ids == result.handle.regions.block_ids[ready.end_block :]
    await ctx.abort.remote(rid)
    integrity = await ctx.integrity.remote()
    assert integrity.idle, integrity


async def test_a_long_prompt_moves_chunk_by_chunk_with_the_same_tokens(
    workers: dict[tuple[str, ...], Any],
) -> None:
    ctx, gen = workers[LLAMA_CTX_PIPELINE], workers[LLAMA_GEN]
    prompt = list(range(30, 30 + LONG_PROMPT))
    whole = await _disaggregated(ctx, gen, "long-whole", prompt)
    before = (await gen.step_stats.remote())["pipelined_blocks"]
    chunked = await _pipelined(ctx, gen, "long-chunked", prompt)
    assert chunked == whole
    # Five chunks: the prefetch asked long before the last one ended.
    assert (await gen.step_stats.remote())["pipelined_blocks"] > before
    for actor in (ctx, gen):
        assert await _becomes_idle(actor)


@pytest.mark.parametrize("xcvr", ["python", "nixl"])
async def test_abort_mid_prompt_frees_both_sides_of_a_pipelined_pull(
    workers: dict[tuple[str, ...], Any], xcvr: str
) -> None:
    ctx = workers[("context", "llama", "v1", xcvr)]
    gen = workers[("generation", "llama", "v1" if xcvr == "nixl" else "v2", xcvr)]
    # An unpulled 100-token cache pins 13 of the holder's 20 blocks, so the
    # 80-token prompt runs a few chunks, is preempted for want of blocks (its
    # offers withdrawn), and tries again until the abort: it is always mid-prompt.
    ballast = f"ballast-{xcvr}"
    await ctx.prefill.remote(ContextRequest(ballast, list(range(40, 140)), _params()))
    prompt = list(range(20, 20 + LONG_PROMPT))
    rid = f"abort-pipelined-{xcvr}"
    await gen.prefetch.remote(PrefetchRequest(rid, prompt, ctx))
    prefill = ctx.prefill.remote(ContextRequest(rid, prompt, _params()))
    await ctx.blocks_ready.remote(rid, 0)  # its first chunk ran (offered or withdrawn)
    # The router's abort after a client disconnect reaches both sides.
    await asyncio.gather(ctx.abort.remote(rid), gen.abort.remote(rid))
    with pytest.raises(RequestFailedError, match="abort"):
        await prefill
    assert await _becomes_idle(gen)
    await ctx.abort.remote(ballast)
    assert await _becomes_idle(ctx)


async def _becomes_idle(actor: Any) -> bool:
    """Whether the actor's cache is all free again within a few seconds (frees
    run between engine steps, and a NIXL holder's after a READ's window)."""
    for _ in range(100):
        if (await actor.integrity.remote()).idle:
            return True
        await asyncio.sleep(0.05)
    return False
