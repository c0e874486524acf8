"""Fair shares of the batch worker's in-flight capacity among the API keys whose batches are running.

While k keys run batches, each may have at most ``max(1, capacity // k)`` of the ``capacity`` lines in
flight. The engine serves lines of equal priority first come first served, so equal numbers in flight
give each key an equal part of the engine, whatever the size of its batch: one key's 50,000-line batch no
longer makes every other key wait until it is done. A freed slot goes to the waiting key that holds the
fewest (and is under its share), so a newcomer's lines go in as the old key's lines finish, and the total
in flight never passes ``capacity``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class FairShare:
    """Slots of one capacity, shared evenly among the owners that joined; asyncio, one event loop."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._joined: dict[str, int] = {}  # owner -> how many of its runs joined (a run is one batch)
        self._held: dict[str, int] = {}  # owner -> slots in use
        self._total = 0
        self._waiting: dict[str, deque[asyncio.Future]] = {}  # owner -> its senders waiting, in order

    def share(self) -> int:
        """The most slots one owner may hold now."""
        return max(1, self.capacity // max(1, len(self._joined)))

    def held(self, owner: str) -> int:
        """How many slots ``owner`` holds now."""
        return self._held.get(owner, 0)

    def join(self, owner: str) -> None:
        """``owner`` starts running a batch: every share shrinks to make room for it."""
        self._joined[owner] = self._joined.get(owner, 0) + 1

    def leave(self, owner: str) -> None:
        """``owner``'s batch stopped running: the others' shares grow, and free slots go to their senders."""
        self._joined[owner] -= 1
        if not self._joined[owner]:
            del self._joined[owner]
        self._grant()

    @asynccontextmanager
    async def slot(self, owner: str) -> AsyncIterator[None]:
        """Hold one of ``owner``'s slots for the body of the ``async with``."""
        await self._acquire(owner)
        try:
            yield
        finally:
            self._release(owner)

    async def _acquire(self, owner: str) -> None:
        queue = self._waiting.get(owner)
        if not queue and self._total < self.capacity and self.held(owner) < self.share():
            self._take(owner)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(owner, deque()).append(waiter)
        try:
            await waiter  # resolved by _grant, which took the slot for us
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # granted, then cancelled: give the slot on
                self._release(owner)
            else:
                self._forget(owner, waiter)
            raise

    def _take(self, owner: str) -> None:
        self._held[owner] = self.held(owner) + 1
        self._total += 1

    def _release(self, owner: str) -> None:
        self._held[owner] -= 1
        if not self._held[owner]:
            del self._held[owner]
        self._total -= 1
        self._grant()

    def _grant(self) -> None:
        """Hand free slots to waiting senders: each to the owner under its share that holds the fewest."""
        share = self.share()
        while self._total < self.capacity:
            for owner in list(self._waiting):  # drop senders cancelled while waiting
                while self._waiting[owner] and self._waiting[owner][0].done():
                    self._waiting[owner].popleft()
                if not self._waiting[owner]:
                    del self._waiting[owner]
            candidates = [owner for owner in self._waiting if self.held(owner) < share]
            if not candidates:
                return
            owner = min(candidates, key=self.held)
            self._take(owner)
            self._waiting[owner].popleft().set_result(None)

    def _forget(self, owner: str, waiter: asyncio.Future) -> None:
        queue = self._waiting.get(owner)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[owner]
