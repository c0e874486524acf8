"""LLMEngine, the engine core: queued requests in, one scheduled forward step at a time, outputs out.

Three parts, as vLLM v1 splits them: ``InputProcessor`` makes validated requests (tokenizing, chat and
reranker formatting; any thread), this core schedules and runs steps (one thread), and ``OutputProcessor``
turns sampled tokens into text, stop decisions and ``RequestOutput``s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from qwenbatch.config import EngineConfig
from qwenbatch.engine.block_manager import BlockManager
from qwenbatch.engine.input_processor import InputProcessor
from qwenbatch.engine.memory import gpu_kv_cache_budget, kv_cache_budget, num_kv_blocks
from qwenbatch.engine.model_runner import ModelRunner, PromptLogprobsChunk, kv_cache_bytes_per_token
from qwenbatch.engine.output_processor import OutputProcessor
from qwenbatch.engine.request import EngineRequest
from qwenbatch.engine.scheduler import Scheduler
from qwenbatch.engine.sequence import Sequence
from qwenbatch.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats
from qwenbatch.engine.structured_output import GrammarCompiler, OutputGrammar
from qwenbatch.layers.host_allocator import cache_step_buffers, return_cached_buffers
from qwenbatch.layers.moe import grouped_mm_capturable
from qwenbatch.layers.sampler import NO_PROMPT_IDS, SamplingRow
from qwenbatch.loader import load_model, resolve_model_dir
from qwenbatch.loader.heap import release_freed_heap
from qwenbatch.loader.kernels import prepare_kernels
from qwenbatch.models.generation_config import sampling_defaults
from qwenbatch.outputs import RequestOutput
from qwenbatch.rerank import DEFAULT_MAX_LENGTH, RerankFormatter, score_token_ids
from qwenbatch.sampling_params import SamplingParams
from qwenbatch.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


WARM_UP_FIRST_TOKEN = 1000


def warm_up_first_token(vocab_size: int) -> int:
    """The token id a warm-up prompt counts up from: WARM_UP_FIRST_TOKEN, or a quarter of a smaller vocabulary."""
    return min(WARM_UP_FIRST_TOKEN, vocab_size // 4)


class LLMEngine:
    """Continuous batching over one model: ``add_request``, then ``step`` until ``has_unfinished`` is False."""

    def __init__(self, config: EngineConfig) -> None:
        # The batch limits this machine's device takes where they are unset, and the task "auto" stood for
        # (GET /config shows these).
        config = dataclasses.replace(
            config,
            max_num_seqs=config.resolved_max_num_seqs,
            max_num_batched_tokens=config.resolved_max_num_batched_tokens,
            task=config.resolved_task,
        )
        self.config = config
        self.dtype = config.torch_dtype
        device = self.device = config.resolved_device
        torch.manual_seed(config.seed)
        self.task = config.resolved_task
        loaded = load_model(
            config.model,
            config.load_format,
            self.dtype,
            device,
            config.seed,
            without_head=self.task == "embed",
            quantization=config.quantization,
            reads_head=self.task == "rerank",
        )
        self.model_config = loaded.config
        self.sampling_defaults = sampling_defaults(config.generation_config, loaded.folder, config.generation_overrides)
        if self.sampling_defaults.changed():
            logger.info(
                "sampling defaults for what a request leaves unset: %s (--generation-config %s; vllm: OpenAI's)",
                ", ".join(f"{k}={v}" for k, v in self.sampling_defaults.changed().items()),
                config.generation_config,
            )
        tokenizer_dir = resolve_model_dir(config.tokenizer) if config.tokenizer else loaded.tokenizer_dir
        self.tokenizer = Tokenizer(tokenizer_dir, loaded.config.eos_token_ids) if tokenizer_dir else None
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else loaded.config.eos_token_ids
        score_weight = None
        if self.task == "rerank":
            if self.tokenizer is None:
                raise ValueError("--task rerank needs a tokenizer (dummy weights: pass --tokenizer default)")
            # The "no" and "yes" rows of the LM head, in float32, before the kernels change its layout.
            rows = list(score_token_ids(self.tokenizer))
            score_weight = loaded.model.lm_head.weight.detach()[rows].float().clone()
        if self.task == "embed":  # logits never run: no packed or quantized copy of the vocabulary's rows
            loaded.model.lm_head = torch.nn.Identity()
        kernels = prepare_kernels(
            loaded.model,
            self.dtype,
            device,
            config.quantization,
            config.uses_cpu_kernels,
            required=config.cpu_kernels == "on" or config.quantization == "int8",  # auto falls back
            compile=config.compile,
            checkpoint=loaded.checkpoint,
        )
        release_freed_heap()  # before the KV pool's size, which may be a fraction of what is available
        self.runner = ModelRunner(
            loaded.model,
            loaded.config,
            config.block_size,
            self.dtype,
            device,
            kernels,
            config.resolved_attention_backend,
            score_weight,
            embeds=self.task == "embed",
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
        # Freed step buffers are kept for the next step while there is work, and unmapped when there is none.
        # (Not where the kernels were wanted and failed to build: a second try would fail the same way.)
        self._caches_step_buffers = config.caches_step_buffers and (kernels.cpu_kernels or not config.uses_cpu_kernels)
        if self._caches_step_buffers:
            try:
                cache_step_buffers()
            except RuntimeError as e:  # a --compile engine, which builds the kernels for this alone
                logger.warning("step buffers not cached (the CPU kernels did not build): %s", e)
                self._caches_step_buffers = False
        if device.type == "cuda" and not config.enforce_eager:
            if loaded.config.moe is not None and not grouped_mm_capturable(self.dtype, device):
                # torch's grouped matmul is one kernel in bf16 on compute capability 9.x/10.x alone; elsewhere its
                # fallback copies the group ends to the host, which a graph capture cannot hold.
                logger.info("no decode CUDA graphs: a mixture of experts in %s runs its experts eagerly", self.dtype)
            else:
                self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        formatter = None
        if self.task == "rerank":
            formatter = RerankFormatter(self.tokenizer, min(DEFAULT_MAX_LENGTH, self.max_model_len))
        grammars = None
        if self.tokenizer is not None:
            grammars = GrammarCompiler(self.tokenizer.hf, loaded.config.vocab_size, self.eos_token_ids)
        self.inputs = InputProcessor(
            self.tokenizer,
            loaded.config.vocab_size,
            self.max_model_len,
            formatter,
            self.sampling_defaults,
            grammars,
            embeds=self.task == "embed",
        )
        self.outputs = OutputProcessor(self.eos_token_ids, str(self.dtype).removeprefix("torch."))
        self._requests: dict[str, EngineRequest] = {}
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

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, **options) -> None:
        """Make (``InputProcessor.make_request``'s ``options``) and queue a request; ValueError when it cannot
        fit (the message names the numbers)."""
        self.add(self.inputs.make_request(request_id, prompt, params, **options))

    def add(self, request: EngineRequest) -> None:
        """Queue a request made by ``self.inputs`` (the InputProcessor)."""
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

    def warm_up(self) -> None:
        """Run one short greedy request (16 prompt tokens, 2 output) to its end, so that one-time costs (first
        allocations and touches, kernels' first calls) fall outside whatever is timed next; its stats are dropped.
        For benchmarks and sweeps, with nothing else queued: the steps it takes are all its own."""
        if self.has_unfinished():
            raise RuntimeError("warm_up runs on an idle engine; requests are queued")
        start = warm_up_first_token(self.model_config.vocab_size)
        prompt = [start + i for i in range(16)]
        if self.task == "embed":
            self.add(self.inputs.make_embed_request("warm-up", prompt))
        else:
            self.add(self.inputs.make_request("warm-up", prompt, SamplingParams(temperature=0, max_tokens=2)))
        while self.has_unfinished():
            self.step()
        self.take_iteration_stats()

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
            if s.seq.prompt_logprobs_from is not None:
                self._record_prompt_logprobs(s.seq, result.prompt_logprobs[s.seq.seq_id], s.num_new_tokens)
            s.seq.num_computed_tokens += s.num_new_tokens
        sampled = [s.seq for s in sched.scheduled if s.samples and not s.seq.score_only]
        scored = [s.seq for s in sched.scheduled if s.samples and s.seq.score_only]
        touched: dict[str, EngineRequest] = {}
        for seq, value in zip(scored, result.pooled, strict=True):
            req = self._requests[seq.request_id]
            self._record_score(req, now)
            self._finish(seq, self.outputs.process_pooled(req, seq, value))
            touched[req.request_id] = req
        for seq, token, lp, bad in zip(sampled, result.token_ids, result.logprobs, result.non_finite, strict=True):
            req = self._requests[seq.request_id]
            self._record_token(req, seq, now)
            reason = self.outputs.process_token(req, seq, token, lp, bad)
            if reason is not None:
                self._finish(seq, reason)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            output = self.outputs.output(req)
            if output is not None:
                outputs.append(output)
            if req.finished:
                del self._requests[req.request_id]
                self._record_finished(req, now)
        if self._caches_step_buffers and not self.scheduler.has_unfinished():
            return_cached_buffers()
        return outputs

    def _record_prompt_logprobs(self, seq: Sequence, chunk: PromptLogprobsChunk, num_new_tokens: int) -> None:
        """Append a prompt chunk's logprobs to its request's; the sequence wants none once the prompt's are all in."""
        req = self._requests[seq.request_id]
        assert req.prompt_logprobs is not None and req.prompt_token_ranks is not None
        assert chunk.start + 1 == len(req.prompt_logprobs), "prompt logprobs out of order"
        req.prompt_logprobs += chunk.logprobs
        req.prompt_token_ranks += chunk.ranks
        last = seq.num_prompt_tokens - 1  # the last prompt position predicts the output
        done = max(seq.prompt_logprobs_from, min(seq.num_computed_tokens + num_new_tokens, last))
        seq.prompt_logprobs_from = None if done >= last else done

    def _record_score(self, req: EngineRequest, now: float) -> None:
        req.first_token_time = now
        self._stats.add_sample(self._stats.time_to_first_token, now - req.arrival_time)
        self._stats.num_prompt_tokens += len(req.prompt_token_ids)

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
        request = self._requests[seq.request_id]
        prompt_ids = NO_PROMPT_IDS
        if p.repetition_penalty != 1.0:
            if request.distinct_prompt_ids is None:
                request.distinct_prompt_ids = torch.tensor(sorted(set(request.prompt_token_ids)), dtype=torch.long)
            prompt_ids = request.distinct_prompt_ids
        state = request.samples[seq.index]
        return SamplingRow(
            p,
            seq.output_ids_so_far() if p.has_penalties else (),
            prompt_ids,
            state.generator,
            suppressed,
            _allowed_token_bits(state.grammar, request.allowed_token_bits),
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)


def _allowed_token_bits(
    grammar: OutputGrammar | None, allowed: torch.Tensor | None
) -> Callable[[], torch.Tensor] | None:
    """What a sequence may sample next, asked for when the sampler needs it: its structured output's match and its
    request's allowed_token_ids, both where both are set; None where neither is."""
    if grammar is None:
        return None if allowed is None else lambda: allowed
    if allowed is None:
        return grammar.allowed_token_bits
    return lambda: grammar.allowed_token_bits() & allowed
