"""Where a batch job's requests run: in this process, on OpenAI-compatible servers, or on Ray actors.

Every backend answers ``send(url, body) -> (status, body)`` with the server's exact response
bodies (in-process runs the same FastAPI app through an in-memory transport), so a job's results
are the same whichever backend ran it. ``capacity`` is how many requests it wants in flight.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Protocol

import httpx
import orjson

from qwenbatch.config import EngineConfig

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})


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


class InProcessBackend:
    """The server's app in this process, called through httpx's in-memory ASGI transport."""

    def __init__(self, engine_config: EngineConfig, lookahead: int | None = None) -> None:
        from qwenbatch.server.app import ServerSettings, build_app

        # The queue bound is the job's own in-flight limit; bodies are as large as a line.
        settings = ServerSettings(
            served_model_names=["batch"], max_waiting_seqs=2**31, max_body_bytes=2**31, batch_api=False
        )
        self.app = build_app(settings, engine_config)
        # Enough requests in flight to keep every batch slot busy, few enough to keep memory flat.
        self.capacity = lookahead or 2 * engine_config.max_num_seqs
        self._lifespan = None
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        from qwenbatch.engine.async_engine import EngineState

        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        engine = self.app.state.ctx.engine
        while engine.state is EngineState.LOADING:
            await asyncio.sleep(0.05)
        if engine.state is not EngineState.READY:
            raise RuntimeError(f"the model failed to load: {engine.error}")
        transport = httpx.ASGITransport(app=self.app)
        self._client = httpx.AsyncClient(transport=transport, base_url="http://in-process", timeout=None)

    async def send(self, url: str, body: dict) -> tuple[int, dict]:
        body = {k: v for k, v in body.items() if k != "model"}  # one model here, whatever the file names
        response = await self._client.post(
            url, content=orjson.dumps(body), headers={"content-type": "application/json"}
        )
        return response.status_code, response_json(response)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)


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
