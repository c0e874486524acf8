"""What the engine reports about its work, for metrics. Plain numbers: no Prometheus here."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    """One request that left the engine (finished, stopped, failed or aborted)."""

    finish_reason: str  # of its first sequence: "stop", "length", "abort" or "error"
    e2e_latency: float  # seconds from arrival to the last token
    queue_time: float  # seconds from arrival to its first scheduled step (0 if never scheduled)
    num_prompt_tokens: int
    num_generation_tokens: int  # over all of its sequences


MAX_PENDING_SAMPLES = 10_000


@dataclass
class IterationStats:
    """What happened since the last time stats were taken (one step, plus any aborts in between).

    The counts are exact however long stats go untaken; the per-sample lists keep at most
    MAX_PENDING_SAMPLES entries each, so an offline job that never takes them (``LLM.generate`` over a
    million prompts) holds a bounded amount; a consumer (the server's metrics) takes them every step.
    """

    num_batched_tokens: int = 0  # tokens computed in the step (prefill chunks and decodes)
    num_prompt_tokens: int = 0  # prompt tokens of requests whose prefill completed
    num_generation_tokens: int = 0  # tokens sampled
    num_preemptions: int = 0
    time_to_first_token: list[float] = field(default_factory=list)  # seconds, per request that got its first token
    inter_token_latency: list[float] = field(default_factory=list)  # seconds, per token after a sequence's first
    finished: list[FinishedRequestStats] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)  # one per sequence that finished

    def add_sample(self, samples: list, value) -> None:
        """Append ``value`` to one of the lists above unless it already holds MAX_PENDING_SAMPLES."""
        if len(samples) < MAX_PENDING_SAMPLES:
            samples.append(value)


@dataclass
class SchedulerStats:
    """The engine's state after a step."""

    num_running: int  # sequences with KV in the cache
    num_waiting: int  # sequences queued (new or preempted)
    kv_cache_usage: float  # fraction of KV blocks held by sequences, 0..1
    prefix_cache_queries: int  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # cumulative prompt tokens found there
    kv_cache_bytes: int = 0  # size of the KV pool (preallocated at start-up)
