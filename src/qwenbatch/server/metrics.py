"""Prometheus metrics with vLLM's names under our prefix, fed from the engine thread's stats."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import prometheus_client
import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from qwenbatch.engine.stats import IterationStats, SchedulerStats

prometheus_client.disable_created_metrics()  # vLLM does the same: *_created series only add noise

P = "qwenbatch:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# Average throughput gauges look back this far (vLLM logs its averages over a similar interval).
THROUGHPUT_WINDOW_S = 10.0


class ServerMetrics:
    """All metrics of one server, in their own registry (so several apps can live in one process)."""

    def __init__(self, model_name: str, device: str = "cpu") -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(P + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(P + name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(P + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self._success = Counter(
            P + "request_success", "Finished sequences by reason.", ["model_name", "finished_reason"], registry=r
        )
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)  # present at 0 from the start
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens of a sequence.", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled step.", LATENCY_BUCKETS)
        self.req_prompt = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.req_generation = histogram("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.iteration = histogram("iteration_tokens_total", "Tokens computed per engine step.", TOKEN_BUCKETS)
        gauge("avg_prompt_throughput_toks_per_s", "Prompt tokens/s over the last 10 s.").set_function(
            lambda: self._rate(1)
        )
        gauge("avg_generation_throughput_toks_per_s", "Generated tokens/s over the last 10 s.").set_function(
            lambda: self._rate(2)
        )
        self.kv_cache_bytes = gauge("kv_cache_bytes", "Bytes of the preallocated KV pool.")
        process = psutil.Process()
        gauge("process_resident_memory_bytes", "Resident memory of the server process (RSS).").set_function(
            lambda: process.memory_info().rss
        )
        if device == "cuda":
            import torch

            for name, read, doc in (
                ("gpu_memory_allocated_bytes", torch.cuda.memory_allocated, "GPU memory held by tensors now."),
                ("gpu_memory_reserved_bytes", torch.cuda.memory_reserved, "GPU memory the allocator holds now."),
                ("gpu_memory_peak_allocated_bytes", torch.cuda.max_memory_allocated, "Peak GPU memory of tensors."),
                ("gpu_memory_peak_reserved_bytes", torch.cuda.max_memory_reserved, "Peak GPU memory reserved."),
            ):
                gauge(name, doc).set_function(read)
        self.model_name = model_name
        self._window: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated tokens)
        self._lock = threading.Lock()
        self._prefix_seen = (0, 0)

    def track_batch_worker(self, state: Callable[[], str]) -> None:
        """Export the Batch API worker's health: 1 while it runs (or starts), 0 while it retries or stopped."""
        doc = "1 while the Batch API worker runs, 0 while it retries after an error or has stopped."
        up = Gauge(P + "batch_worker_up", doc, ["model_name"], registry=self.registry).labels(self.model_name)
        up.set_function(lambda: float(state() in ("starting", "running")))

    def record(self, it: IterationStats, sched: SchedulerStats) -> None:
        """Fold one step's stats in (called on the engine thread)."""
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.kv_usage.set(sched.kv_cache_usage)
        self.kv_cache_bytes.set(sched.kv_cache_bytes)
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        self.preemptions.inc(it.num_preemptions)
        queries, hits = self._prefix_seen
        self.prefix_queries.inc(sched.prefix_cache_queries - queries)
        self.prefix_hits.inc(sched.prefix_cache_hits - hits)
        self._prefix_seen = (sched.prefix_cache_queries, sched.prefix_cache_hits)
        if it.num_batched_tokens:
            self.iteration.observe(it.num_batched_tokens)
        for value in it.time_to_first_token:
            self.ttft.observe(value)
        for value in it.inter_token_latency:
            self.itl.observe(value)
        for reason in it.finished_reasons:
            self._success.labels(self.model_name, reason).inc()
        for f in it.finished:
            self.e2e.observe(f.e2e_latency)
            self.queue.observe(f.queue_time)
            self.req_prompt.observe(f.num_prompt_tokens)
            self.req_generation.observe(f.num_generation_tokens)
        if it.num_prompt_tokens or it.num_generation_tokens:
            with self._lock:
                self._window.append((time.monotonic(), it.num_prompt_tokens, it.num_generation_tokens))

    def _rate(self, column: int) -> float:
        now = time.monotonic()
        with self._lock:
            while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
                self._window.popleft()
            total = sum(entry[column] for entry in self._window)
        return total / THROUGHPUT_WINDOW_S
