"""The FIFO admission gate in front of a runner.

Requests start in arrival order: `acquire` hands out at most `max_active` permits and queues
the rest in a bounded line. A full line refuses at once (the caller renders 429 / 529 / 503 with
Retry-After) rather than letting a client hang. A waiter that goes away (client disconnect) is
taken out of the line and never receives a permit.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from turbospark.errors import ApiError, ErrorKind


class GenerationQueue:
    def __init__(self, max_active: int = 1, max_waiting: int = 64, retry_after: float = 1.0) -> None:
        if max_active < 1 or max_waiting < 0:
            raise ValueError("max_active must be >= 1 and max_waiting >= 0")
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self.num_active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.num_active < self.max_active and not self._waiters:
            self.num_active += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise ApiError(
                ErrorKind.OVERLOADED,
                f"server is at capacity: {self.num_active} generating, {len(self._waiters)} waiting; "
                "retry later",
                retry_after=self.retry_after,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release_one()  # the permit arrived as we were cancelled: pass it on
            elif waiter in self._waiters:  # a release may already have dropped the cancelled waiter
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self._release_one()

    def _release_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the permit moves to the next in line; num_active unchanged
                return
        self.num_active -= 1
        assert self.num_active >= 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()
