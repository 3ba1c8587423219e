"""How far each prompt's prefill has come, for pullers that pull it chunk by chunk.

A generation worker that prefetches a prompt asks the context worker, again
and again, "which blocks past the first `n` are final?" (`blocks_ready`).
The answers come from here. The table is updated between engine steps only
(`on_step`, `published`, `ended`), so a block table read here is never
changed by a step in flight:

    step ends:   prompt has 37 of 64 tokens computed, block size 8
                 -> blocks [0, 4) are final (block 4 is still being written)
    handoff:     published -> the rest and the Mamba state, in one final pull
    preemption:  withdrawn  -> no more offers; the puller pulls the whole
                 prompt after the handoff, as without pipelining

On a GPU a step returns before its kernels finish. Each progress keeps the
event recorded after the cache writes of the step it last changed with
(`engine.step_event`), and nothing it names is exposed before that event is
done (`settled`): a one-sided READ must never see a block half written.

A prompt is *held* (`KVCacheManager.hold`) from the first step at which a
puller wanted it, so a preemption cannot hand blocks that a pull may be
reading to another request; the worker gives them back once the offers are
withdrawn and no read is in flight, or when the published cache is released.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.request import Request
from engine.step_event import HostEvent, StepEvent, wait_for
from kvcache.manager import KVCacheManager
from transfer.handle import TransferHandle


@dataclass
class PromptProgress:
    """One prompt, as pullers see it."""

    wanted: bool = False  # a puller asked; hold and snapshot from the next step
    held: bool = False
    block_ids: tuple[int, ...] = ()  # its leading final blocks, as of the last step
    published: TransferHandle | None = None  # the whole cache, after the handoff
    ended: bool = False  # no cache will come: failed, aborted, done at its first token
    withdrawn: bool = False  # preempted after offers: no more offers
    # After the writes of the step that made `block_ids` or `published` what they are.
    written: StepEvent = field(default_factory=HostEvent)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_ready(self) -> int:
        return len(self.block_ids)

    def answers(self, num_pulled: int) -> bool:
        """Whether a puller that has `num_pulled` blocks gets an answer now."""
        return (
            self.published is not None
            or self.ended
            or self.withdrawn
            or self.num_ready > num_pulled
        )

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class ChunkProgress:
    """Prompt id -> `PromptProgress`, for the prompts pullers asked about or
    that were published."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager
        self._prompts: dict[str, PromptProgress] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    def get(self, request_id: str) -> PromptProgress:
        progress = self._prompts.get(request_id)
        if progress is None:
            progress = self._prompts[request_id] = PromptProgress()
        return progress

    def forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)

    async def wait(self, request_id: str, num_pulled: int, timeout_s: float) -> PromptProgress:
        """The prompt's progress once it has an answer for a puller holding
        `num_pulled` blocks, or after `timeout_s` (then `answers` is False)."""
        progress = self.get(request_id)
        progress.wanted = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not progress.answers(num_pulled):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await progress.changed.wait()
        return progress

    async def settled(self, progress: PromptProgress) -> None:
        """Return once the steps that wrote what `progress` names have
        finished on the device; at once, without yielding, if they have.
        Nothing may be awaited between this and exposing the blocks: a step
        in between would change `progress` again."""
        while not progress.written.done():
            await wait_for(progress.written)

    def on_step(
        self, prefilling: Sequence[Request], preempted: Sequence[Request], written: StepEvent
    ) -> list[str]:
        """Record a finished step (between steps), whose cache writes end at
        `written`. Returns the prompts that were preempted after offers: the
        caller withdraws them."""
        withdrawn = []
        for request in preempted:
            progress = self._prompts.get(request.request_id)
            if progress is not None and progress.held and not progress.withdrawn:
                progress.withdrawn = True
                progress.block_ids = ()
                progress.notify()
                withdrawn.append(request.request_id)
        for request in prefilling:
            progress = self._prompts.get(request.request_id)
            if progress is None or not progress.wanted or progress.withdrawn:
                continue
            if not progress.held:
                self._manager.hold(request.request_id)
                progress.held = True
            num_final = request.num_computed_tokens // self._manager.block_size
            if num_final > progress.num_ready:
                table = self._manager.block_table(request.request_id)
                progress.block_ids = tuple(table[:num_final])
                progress.written = written
                progress.notify()
        return withdrawn

    def published(self, request_id: str, handle: TransferHandle, written: StepEvent) -> None:
        """The whole cache is published, written by steps up to `written`."""
        progress = self.get(request_id)
        progress.published = handle
        progress.written = written
        progress.notify()

    def ended(self, request_id: str) -> None:
        """No cache will come for this prompt; pullers waiting on it are told."""
        progress = self._prompts.get(request_id)
        if progress is not None:
            progress.ended = True
            progress.notify()
