"""``qwenbatch bench throughput``: a workload on our engine and, optionally, on transformers in the same run."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch

from qwenbatch.bench.machine import PeakGPUMemory, PeakRSS, copy_bandwidth_gbs, gpu_memory_report
from qwenbatch.bench.workloads import BenchRequest
from qwenbatch.config import EngineConfig
from qwenbatch.models.config import ModelConfig
from qwenbatch.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class SystemResult:
    system: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    peak_rss_mib: float
    extra: dict = field(default_factory=dict)
    finished_at: float = field(default_factory=time.time)  # seconds since the epoch, when the result was made

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def to_dict(self) -> dict:
        return {**asdict(self), "output_tps": self.output_tps, "total_tps": self.total_tps}


def matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul parameters of the decoder layers that each token runs through, parameters of the LM head): a
    mixture-of-experts layer counts its router, the experts a token uses and any shared expert."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h = cfg.hidden_size
    attention = h * (q + 2 * kv) + q * h
    sparse = len(cfg.sparse_layers)
    layers = (attention + 3 * h * cfg.intermediate_size) * cfg.num_hidden_layers
    if sparse:
        moe = cfg.moe
        experts = moe.experts_per_token * 3 * h * moe.intermediate_size
        shared = (3 * h * moe.shared_intermediate_size + h) if moe.shared_intermediate_size else 0
        layers += sparse * (h * moe.num_experts + experts + shared - 3 * h * cfg.intermediate_size)
    return layers, cfg.vocab_size * h


def run_ours(config: EngineConfig, requests: list[BenchRequest], llm=None) -> tuple[SystemResult, object]:
    """Run ``requests`` on our engine (as each asks: greedy unless it sets a temperature); returns the result and the
    LLM for reuse."""
    from qwenbatch.llm import LLM

    peak_kv = 0.0
    with PeakRSS() as rss:
        llm = llm or LLM(**vars(config))
        on_gpu = llm.engine.device.type == "cuda"
        llm.engine.warm_up()  # as the baseline is: its batch-size sweep, or a warm-up, runs before its timed run
        bm = llm.engine.block_manager
        hits0, queries0, preempt0 = bm.prefix_cache_hits, bm.prefix_cache_queries, llm.engine.scheduler.num_preemptions
        params = [
            SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.output_len, ignore_eos=r.ignore_eos)
            for r in requests
        ]
        with PeakGPUMemory(llm.engine.device) if on_gpu else nullcontext() as gpu:
            start = time.perf_counter()
            outputs = []
            prompts = [r.prompt_token_ids for r in requests]
            for item in llm.generate_iter(prompts, params, use_tqdm=True, total=len(requests)):
                outputs.append(item)
                peak_kv = max(peak_kv, llm.engine.scheduler_stats().kv_cache_usage)
            wall = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for _, o in outputs)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    hits = bm.prefix_cache_hits - hits0
    queries = bm.prefix_cache_queries - queries0
    layer_params, head_params = matmul_params(llm.engine.model_config)
    computed = prompt_tokens - hits + produced - len(requests)  # the last sampled token is never fed back
    model_flops = 2 * (layer_params * computed + head_params * produced)
    extra = {
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "preemptions": llm.engine.scheduler.num_preemptions - preempt0,
        "model_gflops": model_flops / wall / 1e9,
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "max_num_seqs": config.resolved_max_num_seqs,
        "max_num_batched_tokens": config.resolved_max_num_batched_tokens,
        "prefix_caching": config.enable_prefix_caching,
        "device": llm.engine.device.type,
        "linear_kernels": llm.engine.runner.linear_kernels,
        "prefill_attention": llm.engine.runner.prefill_attention,
        "decode_attention": llm.engine.runner.decode_attention,
    }
    if on_gpu:
        extra.update(gpu_memory_report(gpu, llm.engine, peak_kv))
    result = SystemResult("qwenbatch", len(requests), prompt_tokens, produced, wall, rss.peak_mib, extra)
    return result, llm


@dataclass
class OursRun:
    """One run of ours, and what was asked beside it on the same engine."""

    result: SystemResult
    flipped: SystemResult | None = None  # ours again with prefix caching the other way
    prefix_caching_speedup: float | None = None
    batch1: dict | None = None


def run_ours_and_extras(
    config: EngineConfig, requests: list[BenchRequest], compare_prefix_caching: bool = False, batch1: bool = False
) -> OursRun:
    """``run_ours``, then, where asked, ours with prefix caching flipped and batch-1 decode (on the last engine)."""
    result, llm = run_ours(config, requests)
    run = OursRun(result)
    if compare_prefix_caching:
        del llm
        flipped = EngineConfig(**{**vars(config), "enable_prefix_caching": not config.enable_prefix_caching})
        run.flipped, llm = run_ours(flipped, requests)
        run.flipped.system = f"qwenbatch (prefix caching {'on' if flipped.enable_prefix_caching else 'off'})"
        with_cache, without = (result, run.flipped) if config.enable_prefix_caching else (run.flipped, result)
        run.prefix_caching_speedup = without.wall_s / with_cache.wall_s
    if batch1:
        run.batch1 = batch1_bandwidth(llm)
    return run


def run_transformers(
    config: EngineConfig, requests: list[BenchRequest], sizes: list[int], batch_size: int | None = None
) -> SystemResult:
    """The baseline at ``batch_size``, or at its best batch size of a sweep over ``sizes``."""
    from qwenbatch.bench import baseline
    from qwenbatch.loader import resolve_model_dir

    with PeakRSS() as rss:
        model = baseline.load_hf_model(resolve_model_dir(config.model), config.torch_dtype)
        pad_id = baseline.pad_token_id(model)
        if batch_size is None:
            best, sweep = baseline.best_batch_size(model, requests, sizes, pad_id)
        else:
            best, sweep = batch_size, []
            baseline.warm_up(model, best, pad_id)
        run = baseline.run_static(model, requests, best, pad_id)
    del model
    extra = {
        "best_batch_size": best,
        "sweep": sweep,
        "effective_token_ratio": (run.prompt_tokens + run.output_tokens) / run.computed_tokens,
    }
    return SystemResult(
        "transformers", len(requests), run.prompt_tokens, run.output_tokens, run.wall_s, rss.peak_mib, extra
    )


def batch1_bandwidth(llm, output_len: int = 48) -> dict:
    """Batch-1 decode: weight bytes read per step x steps/s, beside the measured copy bandwidth."""
    from qwenbatch.engine.llm_engine import warm_up_first_token

    # Every matmul weight is read once a step; the embedding only one row per token.
    layer_params, head_params = matmul_params(llm.engine.model_config)
    weight_bytes = (layer_params + head_params) * torch.tensor([], dtype=llm.engine.dtype).element_size()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.engine.warm_up()
    first = warm_up_first_token(llm.engine.model_config.vocab_size)
    start = time.perf_counter()
    llm.generate([[first + 2 * i for i in range(16)]], params, use_tqdm=False)  # no prefix of the warm-up's
    steps_per_s = output_len / (time.perf_counter() - start)  # the prefill step is one of them
    achieved = weight_bytes * steps_per_s / 1e9
    copy = copy_bandwidth_gbs()
    return {
        "weight_bytes_per_step": weight_bytes,
        "steps_per_s": steps_per_s,
        "achieved_read_gbs": achieved,
        "copy_bandwidth_gbs": copy,
        "fraction_of_copy": achieved / copy,
    }
