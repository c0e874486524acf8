"""OutputProcessor: sampled tokens in, text, stop decisions and ``RequestOutput``s out.

It owns each sequence's ``SampleState`` after the request is made: the incremental detokenizer and
stop strings, logprobs, errors, scores and the stream cursors. The engine core hands it what a step
produced and finishes the sequences it says are done.
"""

from __future__ import annotations

import logging
import math

import torch

from qwenbatch.engine.request import EngineRequest
from qwenbatch.engine.sequence import Sequence
from qwenbatch.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Applies one model's stop rules and builds its requests' outputs; runs on the engine thread."""

    def __init__(self, eos_token_ids: tuple[int, ...], dtype_name: str) -> None:
        self.eos_token_ids = eos_token_ids
        self.dtype_name = dtype_name  # for the error that non-finite logits raise

    def process_token(
        self, req: EngineRequest, seq: Sequence, token: int, logprobs: dict[int, float] | None, non_finite: bool
    ) -> str | None:
        """Append a sampled token to ``seq``; the finish reason if it ends the sequence, else None."""
        state = req.samples[seq.index]
        if non_finite:
            state.error = (
                f"the model produced non-finite logits (NaN or inf) in {self.dtype_name}; "
                "this usually means the dtype overflows: try --dtype bfloat16"
            )
            logger.error("request %s failed: %s", seq.request_id, state.error)
            return "error"
        seq.token_ids.append(token)
        if state.logprobs is not None and logprobs is not None:
            state.logprobs.append(logprobs)
        p = seq.params
        if token in p.stop_token_ids:
            state.stop_reason = token
            return "stop"
        if token in self.eos_token_ids and not p.ignore_eos:
            return "stop"
        if state.grammar is not None and not state.grammar.accept(token):
            state.error = f"the structured output's match refused token {token}: {state.grammar.error}"
            logger.error("request %s failed: %s", seq.request_id, state.error)
            return "error"
        if state.detokenizer is not None:
            stop_str = state.detokenizer.add(token)
            if stop_str is not None:
                state.stop_reason = stop_str
                return "stop"
        if state.grammar is not None and state.grammar.complete:
            return "stop"
        if seq.num_output_tokens >= seq.max_tokens:
            return "length"
        return None

    def process_pooled(self, req: EngineRequest, seq: Sequence, value: float | torch.Tensor) -> str:
        """Record a score-only sequence's P(yes) or embedding; its finish reason ("error" if not finite)."""
        state = req.samples[seq.index]
        if isinstance(value, torch.Tensor):
            if bool(torch.isfinite(value).all()):
                state.embedding = value
                return "stop"
        elif math.isfinite(value):
            state.score = value
            return "stop"
        state.error = f"the model produced a non-finite result in {self.dtype_name}: try --dtype bfloat16"
        return "error"

    def output(self, req: EngineRequest) -> RequestOutput | None:
        """What ``req`` reports after a step that touched it: a delta if it streams, else its final output
        once finished; None when there is nothing to report."""
        if req.stream:
            return self.delta_output(req)
        return self.final_output(req) if req.finished else None

    def final_output(self, req: EngineRequest) -> RequestOutput:
        """Everything a finished request produced."""
        if req.score_only:
            state = req.samples[0]
            out = RequestOutput(
                req.request_id,
                req.prompt,
                req.prompt_token_ids,
                [],
                finished=True,
                score=state.score,
                embedding=state.embedding,
            )
            if state.error:
                out.outputs = [CompletionOutput(0, "", [], finish_reason="error", error=state.error)]
            return out
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=state.detokenizer.text if state.detokenizer else "",
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason,
                stop_reason=state.stop_reason,
                logprobs=state.logprobs,
                error=state.error,
            )
            for seq, state in zip(req.seqs, req.samples, strict=True)
        ]
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            outputs,
            finished=True,
            prompt_logprobs=req.prompt_logprobs,
            prompt_token_ranks=req.prompt_token_ranks,
        )

    def delta_output(self, req: EngineRequest) -> RequestOutput | None:
        """What is new since the last delta: tokens, text that no stop string can still cut, logprobs.

        Sequences with nothing new are left out; None when no sequence has anything to report. A request with
        prompt logprobs reports nothing until they are all computed (its first sequence computes them, and another
        may start sampling from a cached prompt before), then sends them in that first delta.
        """
        if req.prompt_logprobs is not None and len(req.prompt_logprobs) < len(req.prompt_token_ids):
            return None
        outputs = []
        for seq, state in zip(req.seqs, req.samples, strict=True):
            tokens = seq.token_ids[seq.num_prompt_tokens + state.num_streamed_tokens :]
            text = ""
            if state.detokenizer is not None:
                end = state.detokenizer.stable_length(final=seq.is_finished)
                text = state.detokenizer.text[state.num_streamed_chars : end]
                state.num_streamed_chars = max(state.num_streamed_chars, end)
            newly_finished = seq.is_finished and not state.reported_finished
            if not tokens and not text and not newly_finished:
                continue
            logprobs = None
            if state.logprobs is not None:
                logprobs = state.logprobs[state.num_streamed_tokens :]
            state.num_streamed_tokens += len(tokens)
            state.reported_finished = seq.is_finished
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=tokens,
                    finish_reason=seq.finish_reason,
                    stop_reason=state.stop_reason,
                    logprobs=logprobs,
                    error=state.error,
                )
            )
        if not outputs:
            return None
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, finished=req.finished)
        if not req.prompt_logprobs_reported and req.prompt_logprobs is not None:
            out.prompt_logprobs, out.prompt_token_ranks = list(req.prompt_logprobs), list(req.prompt_token_ranks)
            req.prompt_logprobs_reported = True
        return out
