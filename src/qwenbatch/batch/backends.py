"""Where a batch job's requests run: in this process, on OpenAI-compatible servers, or on Ray actors.

Every backend answers ``send(url, body) -> (status, body)`` with the server's exact response
bodies (in process, the serving layer the HTTP server also calls), so a job's results are the same
whichever backend ran it. ``capacity`` is how many requests it wants in flight.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Protocol

import httpx
import orjson

from qwenbatch.batch.fair_share import FairShare
from qwenbatch.config import EngineConfig
from qwenbatch.engine.async_engine import AsyncEngine, EngineState
from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.serving.api import OpenAIServingAPI

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})
BUSY_STATUSES = frozenset({429, 503})  # in process: the queue is full for now, or the engine is going away
RETRY_FIRST_DELAY_S, RETRY_MAX_DELAY_S = 0.05, 2.0


class ServersUnavailableError(RuntimeError):
    """No server answered a request after every retry; the job stops so nothing is recorded as failed."""


class Backend(Protocol):
    capacity: int

    async def start(self) -> None: ...

    async def send(self, url: str, body: dict) -> tuple[int, dict]: ...

    async def close(self) -> None: ...


def response_json(response: httpx.Response) -> dict:
    """A response's JSON body, or an OpenAI-shaped error holding its text when it is not JSON."""
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return {"error": {"message": response.text[:500], "type": "invalid_response", "param": None, "code": None}}


class EngineUnavailable(RuntimeError):
    """The engine failed to load, stopped or died while a job ran; what is done is saved, the rest resumes."""


class ServingBackend:
    """Requests answered in this process by the serving layer over one engine client, with no HTTP: the
    bodies are exactly the server's. A busy answer (429, 503: the queue is full for now) is retried, never
    recorded; EngineUnavailable ends the run when the engine is gone.

    ``priority_floor``: no line runs better than this (the Batch API's worker runs at the scheduler's
    background priority, below interactive requests). ``fair_share``/``owner``: each line first waits for
    one of its owner's slots. ``own_engine``: start the engine with the backend and stop it with it, and
    answer whatever model a line names (a job file's model is the one this process loaded).
    """

    def __init__(
        self,
        serving: OpenAIServingAPI,
        capacity: int,
        priority_floor: int = 0,
        fair_share: FairShare | None = None,
        owner: str = "",
        own_engine: bool = False,
    ) -> None:
        self.serving = serving
        self.capacity = capacity
        self.priority_floor = priority_floor
        self.fair_share = fair_share
        self.owner = owner
        self.own_engine = own_engine

    async def start(self) -> None:
        """Wait for the model to load (starting the engine if the backend owns it)."""
        engine = self.serving.engine
        if self.own_engine:
            engine.start()
        while engine.state is EngineState.LOADING:
            await asyncio.sleep(0.05)
        if engine.state is not EngineState.READY:
            raise EngineUnavailable(f"the model failed to load: {engine.error}")

    async def send(self, url: str, body: dict) -> tuple[int, dict]:
        if self.own_engine:
            body = {k: v for k, v in body.items() if k != "model"}
        priority = body.get("priority")
        priority = max(self.priority_floor, priority if isinstance(priority, int) else 0)
        if self.fair_share is None:
            return await self._send(url, body, priority)
        async with self.fair_share.slot(self.owner):
            return await self._send(url, body, priority)

    async def _send(self, url: str, body: dict, priority: int) -> tuple[int, dict]:
        delay = RETRY_FIRST_DELAY_S
        while True:
            status, response = await self.serving.call(url, body, priority)
            if status not in BUSY_STATUSES:
                return status, response
            engine = self.serving.engine
            if not engine.is_healthy:
                raise EngineUnavailable(f"the engine is {engine.state.value}")
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_DELAY_S)

    async def close(self) -> None:
        if self.own_engine:
            await asyncio.to_thread(self.serving.engine.stop)


def in_process_backend(engine_config: EngineConfig, lookahead: int | None = None) -> ServingBackend:
    """A backend that loads ``engine_config``'s model in this process and owns its engine."""
    # The queue bound is the job's own in-flight limit (capacity).
    engine = AsyncEngine(lambda: LLMEngine(engine_config), max_waiting_seqs=2**31)
    # Enough requests in flight to keep every batch slot busy, few enough to keep memory flat.
    capacity = lookahead or 2 * engine_config.resolved_max_num_seqs
    return ServingBackend(OpenAIServingAPI(engine, ["batch"]), capacity, own_engine=True)


class _Server:
    def __init__(self, url: str, max_concurrency: int) -> None:
        self.url = url.rstrip("/")
        self.slots = asyncio.Semaphore(max_concurrency)
        self.in_flight = 0
        self.down_until = 0.0  # monotonic time before which it is not tried
        self.failures = 0  # consecutive


class ServersBackend:
    """OpenAI-compatible servers (ours, vLLM, ...): non-streaming requests, at most ``max_concurrency``
    in flight per server, spread to the least busy server that is up; 429/5xx-busy answers and
    connection errors back the server off (exponentially, with jitter) and retry elsewhere."""

    def __init__(
        self,
        urls: list[str],
        max_concurrency: int = 32,
        api_key: str | None = None,
        model: str | None = None,
        max_attempts: int = 12,
        max_backoff_s: float = 30.0,
    ) -> None:
        if not urls:
            raise ValueError("give at least one --server URL")
        self.servers = [_Server(u, max_concurrency) for u in urls]
        self.capacity = len(urls) * max_concurrency
        self.model = model
        self.max_attempts = max_attempts
        self.max_backoff_s = max_backoff_s
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=self.capacity),
        )

    async def start(self) -> None:
        pass

    def _pick(self) -> _Server | None:
        now = time.monotonic()
        up = [s for s in self.servers if s.down_until <= now]
        return min(up, key=lambda s: s.in_flight) if up else None

    def _back_off(self, server: _Server, why: str) -> None:
        server.failures += 1
        delay = min(self.max_backoff_s, 0.25 * 2 ** (server.failures - 1)) * random.uniform(0.8, 1.2)
        server.down_until = time.monotonic() + delay
        logger.warning("server %s: %s; backing off %.1f s", server.url, why, delay)

    async def send(self, url: str, body: dict) -> tuple[int, dict]:
        if self.model is not None:
            body = {**body, "model": self.model}
        else:
            body = {k: v for k, v in body.items() if k != "model"}
        payload = orjson.dumps(body)
        for _attempt in range(self.max_attempts):
            server = self._pick()
            if server is None:
                wake = min(s.down_until for s in self.servers)
                await asyncio.sleep(max(0.0, wake - time.monotonic()))
                continue
            async with server.slots:
                server.in_flight += 1
                try:
                    response = await self._client.post(server.url + url, content=payload)
                except httpx.TransportError as e:
                    self._back_off(server, f"{type(e).__name__}: {e}")
                    continue
                finally:
                    server.in_flight -= 1
            if response.status_code in RETRY_STATUSES:
                self._back_off(server, f"HTTP {response.status_code}")
                continue
            server.failures = 0
            return response.status_code, response_json(response)
        raise ServersUnavailableError(f"no server answered after {self.max_attempts} attempts")

    async def close(self) -> None:
        await self._client.aclose()
