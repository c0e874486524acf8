"""Client side of the serving benchmarks: streamed requests against a running server, timed.

``run_load`` is the load generator of ``qwenbatch bench serve`` (vLLM's ``bench serve`` manner):
Poisson arrivals at a rate (or all at once), at most ``max_concurrency`` in flight, streaming so
time to first token and inter-token latency are what a client sees.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import orjson

from qwenbatch.bench.stats import percentile


def free_port() -> int:
    """A TCP port free on loopback now, for a server child process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Poll ``url``/health until it answers 200. RuntimeError with the end of the process's stderr if it exits
    first, TimeoutError when ``timeout_s`` runs out (stopping the process is the caller's)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{proc.args[0]} did not become healthy within {timeout_s:.0f} s")


@dataclass
class RequestTiming:
    """One streamed request as the client saw it."""

    ttft: float  # seconds from sending to the first content (or reasoning) token
    e2e: float  # seconds from sending to [DONE]
    prompt_tokens: int
    completion_tokens: int
    text: str
    itl: list[float] = field(default_factory=list)  # seconds between successive text chunks
    status: int = 200  # HTTP status; 0 when the connection failed
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


async def stream_chat(client: httpx.AsyncClient, model: str, content: str, max_tokens: int) -> RequestTiming:
    """Send one greedy chat request with streaming on and time it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timing = await stream_request(client, "/v1/chat/completions", body)
    if not timing.ok:
        raise RuntimeError(f"HTTP {timing.status}: {timing.error}")
    return timing


async def stream_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestTiming:
    """POST ``body`` (chat or completions) with streaming on; failures are returned, not raised."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft, last, pieces, gaps, usage = None, None, [], [], {}
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return RequestTiming(
                    0.0, time.perf_counter() - started, 0, 0, "", status=response.status_code, error=text
                )
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    e2e = time.perf_counter() - started
                    return RequestTiming(0.0, e2e, 0, 0, "", status=200, error=chunk["error"]["message"])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    delta = choice.get("delta") or {}
                    text = choice.get("text") or (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                    if text:
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - started
                        else:
                            gaps.append(now - last)
                        last = now
                        pieces.append(text)
    except httpx.TransportError as e:
        return RequestTiming(0.0, time.perf_counter() - started, 0, 0, "", status=0, error=f"{type(e).__name__}: {e}")
    e2e = time.perf_counter() - started
    return RequestTiming(
        ttft if ttft is not None else e2e,
        e2e,
        usage.get("prompt_tokens", 0),
        usage.get("completion_tokens", 0),
        "".join(pieces),
        itl=gaps,
    )


def check_loopback(url: str) -> None:
    """ValueError unless ``url`` points at this machine (a load generator must not hit others by accident)."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"{url} is not a loopback address; pass --allow-remote to load another machine")


async def run_load(
    base_url: str,
    requests: list[tuple[str, dict]],
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    max_duration_s: float | None = None,
    api_key: str | None = None,
    seed: int = 0,
) -> tuple[float, list[RequestTiming], int]:
    """Send ``(url, body)`` requests with Poisson arrivals at ``request_rate`` per second (inf: all at once),
    at most ``max_concurrency`` in flight, no new ones after ``max_duration_s``.
    Returns wall seconds, the timings of the requests sent, and how many were not sent."""
    rng = random.Random(seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_concurrency or len(requests))
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits, headers=headers) as client:

        async def one(url: str, body: dict) -> RequestTiming:
            if slots is None:
                return await stream_request(client, url, body)
            async with slots:
                return await stream_request(client, url, body)

        started = time.perf_counter()
        tasks = []
        for url, body in requests:
            if max_duration_s is not None and time.perf_counter() - started > max_duration_s:
                break
            tasks.append(asyncio.ensure_future(one(url, body)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        timings = list(await asyncio.gather(*tasks))
        return time.perf_counter() - started, timings, len(requests) - len(tasks)


async def run_chat_batch(
    base_url: str, model: str, prompts: list[str], max_tokens: int, concurrent: bool
) -> tuple[float, list[RequestTiming]]:
    """All prompts at once (``concurrent``) or one after another; wall seconds and per-request timings."""
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        started = time.perf_counter()
        if concurrent:
            timings = await asyncio.gather(*(stream_chat(client, model, p, max_tokens) for p in prompts))
        else:
            timings = [await stream_chat(client, model, p, max_tokens) for p in prompts]
        return time.perf_counter() - started, list(timings)


def summarize(wall: float, timings: list[RequestTiming]) -> dict:
    """Wall time, throughput and latency percentiles of one batch of requests."""
    out_tokens = sum(t.completion_tokens for t in timings)
    ttfts = [t.ttft for t in timings]
    e2es = [t.e2e for t in timings]
    return {
        "requests": len(timings),
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tps": out_tokens / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "e2e_p50_s": statistics.median(e2es),
        "e2e_p99_s": percentile(e2es, 99),
    }


def serve_report(wall: float, timings: list[RequestTiming], not_sent: int = 0) -> dict:
    """Throughput, latency percentiles (ms) of the requests that succeeded, and failures by status."""
    done = [t for t in timings if t.ok]
    failed = [t for t in timings if not t.ok]
    out_tokens = sum(t.completion_tokens for t in done)
    in_tokens = sum(t.prompt_tokens for t in done)
    itls = [gap for t in done for gap in t.itl]
    report = {
        "sent": len(timings),
        "completed": len(done),
        "failed": len(failed),
        "not_sent": not_sent,
        "errors_by_status": dict(Counter(str(t.status) for t in failed)),
        "wall_s": wall,
        "request_throughput": len(done) / wall if wall else 0.0,
        "output_tps": out_tokens / wall if wall else 0.0,
        "total_tps": (in_tokens + out_tokens) / wall if wall else 0.0,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
    }
    for name, values in (("ttft", [t.ttft for t in done]), ("itl", itls), ("e2e", [t.e2e for t in done])):
        for q in (50, 95, 99):
            report[f"{name}_p{q}_ms"] = percentile(values, q) * 1000 if values else None
    return report


def format_serve_report(report: dict) -> str:
    """The report as a small table."""
    not_sent = f", {report['not_sent']} not sent (time bound)" if report["not_sent"] else ""
    lines = [
        f"requests: {report['completed']} completed, {report['failed']} failed "
        f"{report['errors_by_status'] or ''}{not_sent}",
        f"wall {report['wall_s']:.2f} s; {report['request_throughput']:.2f} req/s, "
        f"{report['output_tps']:.1f} output tok/s, {report['total_tps']:.1f} total tok/s",
        f"{'ms':<6}{'p50':>10}{'p95':>10}{'p99':>10}",
    ]
    for name in ("ttft", "itl", "e2e"):
        cells = [report[f"{name}_p{q}_ms"] for q in (50, 95, 99)]
        lines.append(f"{name:<6}" + "".join(f"{c:>10.1f}" if c is not None else f"{'-':>10}" for c in cells))
    return "\n".join(lines)
