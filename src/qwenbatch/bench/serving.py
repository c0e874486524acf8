"""Client side of the serving benchmarks: streamed chat requests against a running server, timed."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import httpx
import orjson


@dataclass
class RequestTiming:
    """One streamed request as the client saw it."""

    ttft: float  # seconds from sending to the first content (or reasoning) token
    e2e: float  # seconds from sending to [DONE]
    prompt_tokens: int
    completion_tokens: int
    text: str


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
    started = time.perf_counter()
    ttft, pieces, usage = None, [], {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    pieces.append(text)
    e2e = time.perf_counter() - started
    return RequestTiming(
        ttft if ttft is not None else e2e,
        e2e,
        usage.get("prompt_tokens", 0),
        usage.get("completion_tokens", 0),
        "".join(pieces),
    )


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


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


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
