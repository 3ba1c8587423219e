"""Flow control: a bound on the bytes a worker has in flight at once.

Many transfers are multiplexed on one worker; without a bound, a burst of
large pulls would each push hundreds of MB into socket buffers at once and
starve small, latency-critical transfers. Senders take a budget slice per
chunk and give it back once the kernel has accepted the chunk.
"""

from __future__ import annotations

import asyncio


class ByteBudget:
    """An asyncio counting semaphore measured in bytes.

    `acquire(n)` waits until `n` bytes fit under `limit`; a request larger than
    the whole limit is clamped so it can still proceed alone.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"byte budget must be positive, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> int:
        """Wait for room and take `min(n, limit)` bytes; returns what was taken."""
        n = min(n, self.limit)
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_flight + n <= self.limit)
            self.in_flight += n
        return n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.in_flight -= n
            self._cond.notify_all()
