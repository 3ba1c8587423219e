"""The transceiver of a tensor-parallel rank 1.., on an event loop of its own.

Rank 0 (the worker actor) keeps the requests' bookkeeping; every other rank
holds its heads' bytes of the same blocks and slots, so each rank moves its
own bytes. On a context instance each rank publishes the request's regions
(rank 0's: every rank's pool has the same layout, so they address the rank's
own bytes) with its own signature, which names its heads. On a generation
instance each rank pulls its heads from every context rank
(`Transceiver.pull_ranks`).

A rank actor runs its steps one at a time on its default thread; transfers
run in the actor's "transfer" concurrency group and on this loop, so a pull
never waits behind a step, nor a step behind a pull.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import torch

from engine.worker_config import WorkerConfig
from kvcache.layout import LayoutSignature, RequestRegions
from transfer.base import Transceiver
from transfer.handle import TransferHandle

T = TypeVar("T")


class RankTransfer:
    """One rank's started transceiver over its pool, and the loop it runs on."""

    def __init__(
        self,
        config: WorkerConfig,
        buffers: Mapping[str, torch.Tensor],
        signature: LayoutSignature,
        name: str,
    ) -> None:
        self.signature = signature
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._xcvr: Transceiver = self._run(self._start(config, buffers, name))

    @staticmethod
    async def _start(
        config: WorkerConfig, buffers: Mapping[str, torch.Tensor], name: str
    ) -> Transceiver:
        xcvr = config.create_transceiver(buffers, name)
        await xcvr.start()
        return xcvr

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def publish(self, request_id: str, regions: RequestRegions, lease_s: float) -> TransferHandle:
        """Pin this rank's bytes of `regions` for pulling. Rank 0 frees the
        blocks (its own lease ends last), so a release here frees nothing."""

        async def publish() -> TransferHandle:
            return self._xcvr.publish(request_id, regions, self.signature, lease_s, _nothing)

        return self._run(publish())

    def pull(
        self, handles: Sequence[TransferHandle], regions: RequestRegions, timeout_s: float
    ) -> None:
        """Pull this rank's heads of one request from every holder rank."""
        self._run(self._xcvr.pull_ranks(handles, regions, self.signature, timeout_s))

    def abort(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._xcvr.abort, request_id)

    @property
    def num_pinned(self) -> int:
        """Requests this rank published and no puller or abort released yet."""
        return self._xcvr.num_pinned

    def close(self) -> None:
        self._run(self._xcvr.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def _nothing(request_id: str) -> None:
    del request_id
