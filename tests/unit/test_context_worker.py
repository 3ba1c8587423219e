"""The context worker exposes no cache before the device has written it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from engine.core import StepResult
from engine.messages import ContextRequest
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig
from models.embedded.writer import write_checkpoint
from prefill_worker.worker import ContextWorker
from tests.step_events import GatedEvent


async def test_no_handle_leaves_before_the_steps_that_wrote_its_blocks_are_done(
    tmp_path: Path,
) -> None:
    """Every step of a chunked prompt looks, to the worker, as if its kernels
    still ran (a GPU running behind the host): a puller asking for finished
    blocks and the prefill call both wait for the step's event, and no offer
    is made before it is done."""
    write_checkpoint(tmp_path, "llama", "tiny")
    config = WorkerConfig(
        checkpoint=str(tmp_path),
        block_size=4,
        max_tokens=256,
        max_num_tokens=8,  # a 32-token prompt prefills in four steps
        cluster_secret="test-secret",
    )
    worker = ContextWorker(config, "ctx")
    running = GatedEvent()
    on_step = worker.engine.loop.on_step
    assert on_step is not None

    def still_running(result: StepResult) -> None:
        result.written = running
        on_step(result)

    worker.engine.loop.on_step = still_running
    offers: list[bool] = []  # whether the step was done at each offer
    offer = worker.transceiver.offer

    def recording_offer(*args: Any) -> Any:
        offers.append(running.done())
        return offer(*args)

    worker.transceiver.offer = recording_offer
    await worker.start()
    try:
        ready = asyncio.ensure_future(worker.blocks_ready("r", 0))
        params = SamplingParams(max_tokens=4, temperature=0.0)
        prefill = asyncio.ensure_future(
            worker.prefill(ContextRequest("r", list(range(5, 37)), params))
        )
        for _ in range(500):  # every step ran and the first token's cache is published
            if worker.transceiver.num_pinned:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert worker.transceiver.num_pinned == 1 and running.waited
        assert not ready.done() and not prefill.done() and offers == []

        running.complete()
        answer = await asyncio.wait_for(ready, 10)
        result = await asyncio.wait_for(prefill, 10)
        assert answer.handle is not None and result.handle is not None
        assert all(offers)
    finally:
        await worker.shutdown()
