"""One setting of a tuning sweep, measured in a process of its own.

``python -m qwenbatch.tune.measure JOB.json RESULT.json`` loads the model, runs the job's requests
once at the job's batch setting and writes a Measurement. A fresh process per setting makes each
figure stand alone: peak memory is this setting's, the prefix cache starts empty, and a setting
that runs out of memory (even one the kernel kills) costs only its own process.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields

from qwenbatch.bench.stats import percentile
from qwenbatch.bench.workloads import BenchRequest
from qwenbatch.config import EngineConfig

SYSTEMS = ("qwenbatch", "transformers")


@dataclass
class Measurement:
    """What one system did at one batch setting; ``error`` is set (and the figures zero) when it failed."""

    system: str  # "qwenbatch" or "transformers" (static batches of max_num_seqs)
    max_num_seqs: int
    max_num_batched_tokens: int | None  # None for transformers, which has no token budget
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    latency_mean_s: float = 0.0  # from the start of the run to each request's end (all arrive at once)
    latency_p95_s: float = 0.0
    ttft_mean_s: float | None = None  # None where it is not measured (transformers)
    ttft_p95_s: float | None = None
    # RSS on CPU while the requests ran; on CUDA the GPU memory the run needed (peak allocated less the
    # part of the preallocated KV pool it never filled); None against a server.
    peak_memory_mib: float | None = None
    peak_kv_usage: float | None = None  # largest share of KV blocks in use after a step
    preemptions: int = 0
    error: str | None = None
    runs_output_tps: list[float] = field(default_factory=list)  # each run's output tok/s, when it was repeated

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s if self.ok and self.wall_s else 0.0

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.ok and self.wall_s else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.ok and self.wall_s else 0.0

    @property
    def label(self) -> str:
        budget = "" if self.max_num_batched_tokens is None else f", {self.max_num_batched_tokens} tokens"
        return f"{self.system} {self.max_num_seqs} seqs{budget}"

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "output_tps": self.output_tps,
            "total_tps": self.total_tps,
            "requests_per_s": self.requests_per_s,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Measurement:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _timing_fields(latencies: list[float], ttfts: list[float] | None) -> dict:
    out = {"latency_mean_s": statistics.fmean(latencies), "latency_p95_s": percentile(latencies, 95)}
    if ttfts:
        out.update(ttft_mean_s=statistics.fmean(ttfts), ttft_p95_s=percentile(ttfts, 95))
    return out


def measure_engine(config: EngineConfig, requests: list[BenchRequest]) -> Measurement:
    """Run every request on our engine, all queued at once, greedy; stats come from the engine's own."""
    from contextlib import nullcontext

    from qwenbatch.bench.machine import PeakGPUMemory, PeakRSS, gpu_memory_report
    from qwenbatch.engine.llm_engine import LLMEngine
    from qwenbatch.sampling_params import SamplingParams

    engine = LLMEngine(config)
    engine.warm_up()
    latencies, ttfts, failed, preemptions, peak_kv = [], [], 0, 0, 0.0
    produced = 0
    on_gpu = engine.device.type == "cuda"
    gpu = PeakGPUMemory(engine.device) if on_gpu else nullcontext()
    with PeakRSS() as rss, gpu:
        start = time.perf_counter()
        for i, r in enumerate(requests):
            params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=r.ignore_eos)
            engine.add(engine.inputs.make_request(f"tune-{i}", r.prompt_token_ids, params))
        while engine.has_unfinished():
            for output in engine.step():
                produced += output.num_output_tokens
                failed += output.outputs[0].finish_reason == "error"
            stats = engine.take_iteration_stats()
            ttfts += stats.time_to_first_token
            latencies += [f.e2e_latency for f in stats.finished]
            preemptions += stats.num_preemptions
            peak_kv = max(peak_kv, engine.scheduler_stats().kv_cache_usage)
        wall = time.perf_counter() - start
    peak_memory = gpu_memory_report(gpu, engine, peak_kv)["gpu_memory_needed_mib"] if on_gpu else rss.peak_mib
    return Measurement(
        "qwenbatch",
        config.resolved_max_num_seqs,
        config.resolved_max_num_batched_tokens,
        requests=len(requests),
        failed=failed,
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=produced,
        wall_s=wall,
        peak_memory_mib=peak_memory,
        peak_kv_usage=peak_kv,
        preemptions=preemptions,
        **_timing_fields(latencies, ttfts),
    )


def measure_static(config: EngineConfig, requests: list[BenchRequest]) -> Measurement:
    """The transformers baseline: length-sorted static batches of ``max_num_seqs``, left padded."""
    from qwenbatch.bench.baseline import load_hf_model, pad_token_id, run_static
    from qwenbatch.bench.machine import PeakRSS
    from qwenbatch.loader import resolve_model_dir

    model = load_hf_model(resolve_model_dir(config.model), config.torch_dtype)
    with PeakRSS() as rss:
        run = run_static(model, requests, config.resolved_max_num_seqs, pad_token_id(model))
    return Measurement(
        "transformers",
        config.resolved_max_num_seqs,
        None,
        requests=len(requests),
        prompt_tokens=run.prompt_tokens,
        output_tokens=run.output_tokens,
        wall_s=run.wall_s,
        peak_memory_mib=rss.peak_mib,
        **_timing_fields(run.latencies, None),
    )


def write_job(path, system: str, config: EngineConfig, requests: list[BenchRequest]) -> None:
    """The job file a measuring process reads."""
    job = {
        "system": system,
        "engine": asdict(config),
        "requests": [[r.prompt_token_ids, r.output_len, r.ignore_eos] for r in requests],
    }
    with open(path, "w") as f:
        json.dump(job, f)


def main(argv: list[str]) -> int:
    job_path, result_path = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with open(job_path) as f:
        job = json.load(f)
    config = EngineConfig(**job["engine"])
    requests = [BenchRequest(ids, n, ignore_eos) for ids, n, ignore_eos in job["requests"]]
    measure = measure_engine if job["system"] == "qwenbatch" else measure_static
    result = measure(config, requests)
    with open(result_path, "w") as f:
        json.dump(result.to_dict(), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
