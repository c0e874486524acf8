"""A soak run against a live server: many requests at bounded concurrency, some clients hanging up at random
points, some requests malformed; then the server must be clean: no 5xx, every request out of the engine,
every KV block free, and its memory near where it started.

``run_soak(url, SoakConfig(...))`` returns a ``SoakReport``; ``benchmarks/soak.py`` runs it against a
``qwenbatch serve`` it starts, and a test runs a short one in CI.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class SoakConfig:
    """What a soak run sends."""

    requests: int = 2000
    concurrency: int = 32
    disconnect_fraction: float = 0.2  # clients that hang up: mid-stream, or before a whole answer
    bad_fraction: float = 0.1  # malformed or refused requests (each must get a 4xx)
    max_tokens: int = 16
    model: str | None = None  # default: the first the server lists
    api_key: str | None = None
    seed: int = 0
    settle_timeout_s: float = 60.0  # how long the engine may take to drop what the hung-up clients left


@dataclass
class SoakReport:
    """What happened, and the state the server was left in."""

    requests: int = 0
    duration_s: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)  # "200", "400", ... and "disconnected"
    kinds: dict[str, int] = field(default_factory=dict)  # how many of each request kind were sent
    server_errors: int = 0  # 5xx answers
    unexpected: list[str] = field(default_factory=list)  # the first few answers that were not what was due
    left_running: float | None = None  # qwenbatch:num_requests_running once settled
    left_waiting: float | None = None
    kv_cache_usage: float | None = None  # 0 when every block is free
    rss_start_bytes: float | None = None
    rss_end_bytes: float | None = None
    kv_cache_bytes: float | None = None  # the KV pool, preallocated but touched page by page as it fills

    @property
    def clean(self) -> bool:
        """No 5xx, nothing unexpected, nothing left in the engine, every KV block free."""
        return (
            not self.server_errors
            and not self.unexpected
            and self.left_running == 0
            and self.left_waiting == 0
            and self.kv_cache_usage == 0
        )

    def to_json(self) -> dict:
        return {**asdict(self), "clean": self.clean}


# Malformed or refused requests: (path, body or raw bytes, the status due)
_BAD_REQUESTS: list[tuple[str, object, int]] = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["s"] * 1000}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "no-such-model"}, 404),
    ("/v1/completions", {"prompt": "x", "temperature": -3}, 400),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 1000}, 400),
]


async def run_soak(url: str, config: SoakConfig) -> SoakReport:
    """Soak the server at ``url`` (e.g. "http://127.0.0.1:8000"); see the module docstring."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    rng = random.Random(config.seed)
    report = SoakReport(requests=config.requests)
    statuses: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=config.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120.0, limits=limits) as client:
        model = config.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        report.rss_start_bytes = await _metric(client, "process_resident_memory_bytes")
        report.kv_cache_bytes = await _metric(client, "kv_cache_bytes")
        plans = [_plan(rng, config, model, i) for i in range(config.requests)]
        slots = asyncio.Semaphore(config.concurrency)

        async def one(plan: _Plan) -> None:
            async with slots:
                kinds[plan.kind] += 1
                status, problem = await plan.send(client)
                statuses[status] += 1
                if status.startswith("5"):
                    report.server_errors += 1
                if problem and len(report.unexpected) < 20:
                    report.unexpected.append(f"{plan.kind}: {problem}")

        started = time.perf_counter()
        await asyncio.gather(*(one(plan) for plan in plans))
        report.duration_s = time.perf_counter() - started
        report.left_running, report.left_waiting, report.kv_cache_usage = await _settled(
            client, config.settle_timeout_s
        )
        report.rss_end_bytes = await _metric(client, "process_resident_memory_bytes")
    report.statuses, report.kinds = dict(statuses), dict(kinds)
    return report


@dataclass
class _Plan:
    """One request of the soak: what to send and how the client behaves."""

    kind: str
    path: str
    body: object
    expect: int = 200
    stream: bool = False
    hang_up_after_chunks: int | None = None  # a stream read this far, then the connection closed
    hang_up_after_s: float | None = None  # a non-streaming request given up after this long

    async def send(self, client: httpx.AsyncClient) -> tuple[str, str | None]:
        """(the status, or "disconnected"; a description of what was wrong, or None)."""
        content = self.body if isinstance(self.body, bytes) else None
        json_body = None if content is not None else self.body
        if self.hang_up_after_s is not None:
            try:
                response = await asyncio.wait_for(
                    client.post(self.path, json=json_body, content=content), self.hang_up_after_s
                )
            except TimeoutError:
                return "disconnected", None
            return _check(self, response.status_code, response.text)
        if not self.stream:
            response = await client.post(self.path, json=json_body, content=content)
            return _check(self, response.status_code, response.text)
        async with client.stream("POST", self.path, json=json_body) as response:
            if response.status_code != 200:
                return _check(self, response.status_code, (await response.aread()).decode(errors="replace"))
            chunks = 0
            text = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    text.append(line)
                    if self.hang_up_after_chunks is not None and chunks >= self.hang_up_after_chunks:
                        return "disconnected", None  # leaving the block closes the connection mid-stream
            done = bool(text) and text[-1] == "data: [DONE]"
            return "200", None if done else f"the stream ended without [DONE] after {chunks} chunks"


def _check(plan: _Plan, status: int, text: str) -> tuple[str, str | None]:
    if status == plan.expect:
        return str(status), None
    return str(status), f"got {status}, expected {plan.expect}: {text[:200]}"


def _plan(rng: random.Random, config: SoakConfig, model: str, i: int) -> _Plan:
    roll = rng.random()
    if roll < config.bad_fraction:
        path, body, expect = rng.choice(_BAD_REQUESTS)
        return _Plan("bad", path, body, expect)
    chat = rng.random() < 0.6
    stream = rng.random() < 0.5
    max_tokens = rng.randint(1, config.max_tokens)
    if chat:
        path = "/v1/chat/completions"
        body: dict = {"model": model, "messages": [{"role": "user", "content": f"Request {i}: say something."}]}
    else:
        path = "/v1/completions"
        body = {"model": model, "prompt": f"Request {i}:", "n": rng.choice((1, 1, 2))}
    body.update(max_tokens=max_tokens, temperature=rng.choice((0.0, 0.8)), seed=i)
    kind = ("chat" if chat else "completion") + ("-stream" if stream else "")
    plan = _Plan(kind, path, body, stream=stream)
    if roll < config.bad_fraction + config.disconnect_fraction:
        plan.kind += "-hang-up"
        if stream:
            body.update(max_tokens=config.max_tokens * 4)  # long enough to be cut
            plan.hang_up_after_chunks = rng.randint(1, 4)
        else:
            plan.hang_up_after_s = rng.uniform(0.001, 0.2)
    if stream:
        body["stream"] = True
    return plan


def metric_value(exposition: str, name: str) -> float | None:
    """The sum of a metric's samples named ``name`` in a Prometheus text exposition; None if absent."""
    values = [
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name
    ]
    return sum(values) if values else None


async def _metric(client: httpx.AsyncClient, name: str) -> float | None:
    text = (await client.get("/metrics")).text
    return metric_value(text, "qwenbatch:" + name)


async def _settled(client: httpx.AsyncClient, timeout_s: float) -> tuple[float | None, float | None, float | None]:
    """(running, waiting, KV usage) once the engine is empty, or as they are after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = (await client.get("/metrics")).text
        values = tuple(
            metric_value(text, "qwenbatch:" + name)
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        )
        if values == (0, 0, 0) or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.2)
