"""LLMEngine: requests in, one scheduled forward step at a time, outputs (final or streamed deltas) out."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time

import torch

from qwenbatch.config import EngineConfig
from qwenbatch.engine.block_manager import BlockManager
from qwenbatch.engine.memory import gpu_kv_cache_budget, kv_cache_budget, num_kv_blocks
from qwenbatch.engine.model_runner import ModelRunner, kv_cache_bytes_per_token
from qwenbatch.engine.request import EngineRequest
from qwenbatch.engine.scheduler import Scheduler
from qwenbatch.engine.sequence import Sequence
from qwenbatch.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats
from qwenbatch.layers.sampler import SamplingRow
from qwenbatch.loader import load_model, resolve_model_dir
from qwenbatch.outputs import RequestOutput
from qwenbatch.rerank import DEFAULT_MAX_LENGTH, RerankFormatter, score_token_ids
from qwenbatch.sampling_params import SamplingParams
from qwenbatch.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

NOT_A_RERANKER = "this model does not score pairs: serve a Qwen3-Reranker, or pass --task rerank"
SCORE_PARAMS = SamplingParams(temperature=0, max_tokens=1)  # placeholder: score-only sequences never sample


def _check_priority(priority: int) -> None:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an int, not {type(priority).__name__}")


class LLMEngine:
    """Continuous batching over one model: ``add_request``, then ``step`` until ``has_unfinished`` is False."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.dtype = config.torch_dtype
        device = self.device = config.resolved_device
        torch.manual_seed(config.seed)
        loaded = load_model(config.model, config.load_format, self.dtype, device, config.seed)
        self.model_config = loaded.config
        tokenizer_dir = resolve_model_dir(config.tokenizer) if config.tokenizer else loaded.tokenizer_dir
        self.tokenizer = Tokenizer(tokenizer_dir, loaded.config.eos_token_ids) if tokenizer_dir else None
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else loaded.config.eos_token_ids
        self.task = config.resolved_task
        score_ids = None
        if self.task == "rerank":
            if self.tokenizer is None:
                raise ValueError("--task rerank needs a tokenizer (dummy weights: pass --tokenizer default)")
            score_ids = score_token_ids(self.tokenizer)

        self.runner = ModelRunner(
            loaded.model,
            loaded.config,
            config.block_size,
            self.dtype,
            device,
            config.resolved_attention_backend,
            score_ids,
            config.quantization,
        )
        per_token = kv_cache_bytes_per_token(loaded.config, self.dtype)
        kv_bytes = self._kv_cache_bytes()
        num_blocks = num_kv_blocks(kv_bytes, per_token, config.block_size, on_host=device.type == "cpu")
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={kv_bytes} bytes holds no block of {config.block_size} tokens "
                f"({per_token} bytes per token)"
            )
        pool_tokens = num_blocks * config.block_size
        self.max_model_len = self._resolve_max_model_len(pool_tokens)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner.allocate_kv_cache(num_blocks)
        if device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        self._rerank_formatter = None
        if self.task == "rerank":
            self._rerank_formatter = RerankFormatter(self.tokenizer, min(DEFAULT_MAX_LENGTH, self.max_model_len))
        self._requests: dict[str, EngineRequest] = {}
        self._seq_ids = itertools.count()
        self._stats = IterationStats()

    def _kv_cache_bytes(self) -> int:
        """The KV pool's size: on CUDA what ``gpu_memory_utilization`` leaves after the weights and a
        worst-case step (unless ``kv_cache_memory`` sets it); on CPU as ``kv_cache_memory`` says."""
        config = self.config
        if self.device.type != "cuda" or isinstance(config.kv_cache_memory, int):
            return kv_cache_budget(config.kv_cache_memory)
        num_tokens = config.max_num_batched_tokens
        peak = self.runner.profile_step_peak(num_tokens, min(config.max_num_seqs, num_tokens))
        free, total = torch.cuda.mem_get_info(self.device)
        budget = gpu_kv_cache_budget(total, free, peak, config.gpu_memory_utilization)
        logger.info(
            "GPU memory: %.2f GiB in use after loading, worst-case step %.2f GiB, KV pool %.2f GiB "
            "(gpu_memory_utilization %.2f of %.2f GiB)",
            (total - free) / 2**30,
            peak / 2**30,
            budget / 2**30,
            config.gpu_memory_utilization,
            total / 2**30,
        )
        return budget

    def _resolve_max_model_len(self, pool_tokens: int) -> int:
        model_len = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is not None:
            if wanted > pool_tokens:
                raise ValueError(
                    f"max_model_len={wanted} does not fit in the KV cache ({pool_tokens} tokens); "
                    "raise kv_cache_memory or lower max_model_len"
                )
            return wanted
        if model_len > pool_tokens:
            logger.warning("max_model_len capped from %d to %d: the KV cache holds no more", model_len, pool_tokens)
        return min(model_len, pool_tokens)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        stream: bool = False,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request; ValueError when it cannot fit (the message names the numbers)."""
        self.add(self.make_request(request_id, prompt, params, stream, priority))

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        stream: bool = False,
        priority: int = 0,
    ) -> EngineRequest:
        """Tokenize and validate a request without touching the queue, so it may run on another thread.

        ``stream=True`` makes ``step`` report the request's new tokens every step it samples.
        ``priority``: lower is served earlier (vLLM's convention); see scheduler.py.
        """
        _check_priority(priority)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (dummy weights): pass prompt token ids")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the prompt is not valid Unicode text ({e.reason} at {e.start})") from e
            prompt_text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            prompt_text, token_ids = None, list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        n_prompt = len(token_ids)
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n_prompt} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        room = self.max_model_len - n_prompt
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({self.max_model_len})"
            )
        seqs = []
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed((params.seed + i) % 2**64)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
                )
            seq = Sequence(
                next(self._seq_ids),
                request_id,
                i,
                list(token_ids),
                n_prompt,
                params,
                max_tokens,
                generator,
                detok,
                priority=priority,
                logprobs=[] if params.logprobs is not None else None,
            )
            seqs.append(seq)
        return EngineRequest(
            request_id, prompt_text, token_ids, seqs, stream, priority=priority, arrival_time=time.monotonic()
        )

    @property
    def rerank_formatter(self) -> RerankFormatter:
        """Builds reranker prompts; ValueError when the engine does not score (not --task rerank)."""
        if self._rerank_formatter is None:
            raise ValueError(NOT_A_RERANKER)
        return self._rerank_formatter

    def make_score_request(self, request_id: str, token_ids: list[int], priority: int = 0) -> EngineRequest:
        """A request that prefills ``token_ids`` and reports P(yes) at the last position (reranker)."""
        _check_priority(priority)
        if self._rerank_formatter is None:
            raise ValueError(NOT_A_RERANKER)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the pair has {len(token_ids)} tokens; max_model_len is {self.max_model_len}")
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            0,
            list(token_ids),
            len(token_ids),
            SCORE_PARAMS,
            1,
            priority=priority,
            score_only=True,
        )
        return EngineRequest(request_id, None, list(token_ids), [seq], priority=priority, arrival_time=time.monotonic())

    def add(self, request: EngineRequest) -> None:
        """Queue a request made by ``make_request``."""
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        self._requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")
        self._record_finished(req, time.monotonic())

    def abort_all(self) -> None:
        """Abort every request in the engine."""
        for request_id in list(self._requests):
            self.abort(request_id)

    def update_limits(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> dict:
        """Change the batch limits from the next step on (the server's ``POST /config``).

        Lowering ``max_num_seqs`` below the running count preempts nothing: the excess finish
        and no new ones are admitted until the count is below the new limit (a waiting sequence of
        better priority than running ones still preempts them, down to the limit, to get a seat).
        """
        changes = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
        changes = {k: v for k, v in changes.items() if v is not None}
        config = dataclasses.replace(self.config, **changes)  # validates
        self.config = config
        self.scheduler.max_num_seqs = config.max_num_seqs
        self.scheduler.max_num_batched_tokens = config.max_num_batched_tokens
        return {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens}

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- stepping ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward step. Returns the requests that finished in it and, for streaming
        requests, what they gained (a delta ``RequestOutput`` whose ``finished`` says if it is the last)."""
        sched = self.scheduler.schedule()
        self._stats.num_preemptions += len(sched.preempted)
        if not sched.scheduled:
            return []
        now = time.monotonic()
        for s in sched.scheduled:
            req = self._requests[s.seq.request_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        rows = [self._sampling_row(s.seq) for s in sched.scheduled if s.samples and not s.seq.score_only]
        result = self.runner.execute(sched, rows)
        now = time.monotonic()
        self._stats.num_batched_tokens += sched.num_batched_tokens
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        sampled = [s.seq for s in sched.scheduled if s.samples and not s.seq.score_only]
        scored = [s.seq for s in sched.scheduled if s.samples and s.seq.score_only]
        touched: dict[str, EngineRequest] = {}
        for seq, value in zip(scored, result.scores, strict=True):
            req = self._requests[seq.request_id]
            self._record_score(req, seq, value, now)
            touched[req.request_id] = req
        for seq, token, lp, bad in zip(sampled, result.token_ids, result.logprobs, result.non_finite, strict=True):
            req = self._requests[seq.request_id]
            self._record_token(req, seq, now)
            self._append(seq, token, lp, bad)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            finished = req.finished
            if req.stream:
                delta = req.delta_output()
                if delta is not None:
                    outputs.append(delta)
            elif finished:
                outputs.append(req.final_output())
            if finished:
                del self._requests[req.request_id]
                self._record_finished(req, now)
        return outputs

    def _record_score(self, req: EngineRequest, seq: Sequence, value: float, now: float) -> None:
        req.first_token_time = now
        self._stats.add_sample(self._stats.time_to_first_token, now - req.arrival_time)
        self._stats.num_prompt_tokens += len(req.prompt_token_ids)
        if math.isfinite(value):
            seq.score = value
            self._finish(seq, "stop")
        else:
            seq.error = f"the model produced a non-finite score in {self.dtype}: try --dtype bfloat16"
            self._finish(seq, "error")

    def _record_token(self, req: EngineRequest, seq: Sequence, now: float) -> None:
        stats = self._stats
        stats.num_generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            stats.add_sample(stats.time_to_first_token, now - req.arrival_time)
            stats.num_prompt_tokens += len(req.prompt_token_ids)
        last = req.last_token_time.get(seq.seq_id)
        if last is not None:
            stats.add_sample(stats.inter_token_latency, now - last)
        req.last_token_time[seq.seq_id] = now

    def _record_finished(self, req: EngineRequest, now: float) -> None:
        queued = (req.first_scheduled_time or req.arrival_time) - req.arrival_time
        stats = self._stats
        stats.add_sample(
            stats.finished,
            FinishedRequestStats(
                finish_reason=req.seqs[0].finish_reason or "abort",
                e2e_latency=now - req.arrival_time,
                queue_time=queued,
                num_prompt_tokens=len(req.prompt_token_ids),
                num_generation_tokens=sum(seq.num_output_tokens for seq in req.seqs),
            ),
        )
        for seq in req.seqs:
            stats.add_sample(stats.finished_reasons, seq.finish_reason or "abort")

    def take_iteration_stats(self) -> IterationStats:
        """What happened since the last call (steps and aborts), for metrics."""
        stats, self._stats = self._stats, IterationStats()
        return stats

    def scheduler_stats(self) -> SchedulerStats:
        """Queue lengths, KV-cache usage and prefix-cache counters now."""
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=1.0 - bm.num_free_blocks / bm.num_blocks,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            kv_cache_bytes=self.runner.kv_cache_bytes,
        )

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.params
        suppressed: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens:
            suppressed = tuple(p.stop_token_ids) + (() if p.ignore_eos else self.eos_token_ids)
        return SamplingRow(
            p,
            seq.output_token_ids,
            seq.prompt_token_ids if p.repetition_penalty != 1.0 else [],
            seq.generator,
            suppressed,
        )

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, non_finite: bool) -> None:
        if non_finite:
            seq.error = (
                f"the model produced non-finite logits (NaN or inf) in {self.dtype}; "
                "this usually means the dtype overflows: try --dtype bfloat16"
            )
            logger.error("request %s failed: %s", seq.request_id, seq.error)
            self._finish(seq, "error")
            return
        seq.token_ids.append(token)
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        p = seq.params
        if token in p.stop_token_ids:
            seq.stop_reason = token
            self._finish(seq, "stop")
            return
        if token in self.eos_token_ids and not p.ignore_eos:
            self._finish(seq, "stop")
            return
        if seq.detokenizer is not None:
            stop_str = seq.detokenizer.add(token)
            if stop_str is not None:
                seq.stop_reason = stop_str
                self._finish(seq, "stop")
                return
        if seq.num_output_tokens >= seq.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
