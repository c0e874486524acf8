"""EngineRequest: one prompt's sequences inside the engine, its timings, and the outputs it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from qwenbatch.engine.sequence import Sequence
from qwenbatch.outputs import CompletionOutput, RequestOutput


@dataclass(eq=False)
class EngineRequest:
    """A validated request, ready to queue. Built by ``LLMEngine.make_request`` on any thread."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    # True: every step that samples reports the new tokens and text (deltas) as a RequestOutput.
    # False: one RequestOutput when the request has finished, holding everything.
    stream: bool = False
    priority: int = 0  # every sequence's priority: lower is served earlier
    arrival_time: float = 0.0  # time.monotonic() when it was made
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: dict[int, float] = field(default_factory=dict)  # per seq_id

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def final_output(self) -> RequestOutput:
        """Everything the request produced, for a request that has finished."""
        if self.seqs[0].score_only:
            seq = self.seqs[0]
            out = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [], finished=True, score=seq.score)
            if seq.error:
                out.outputs = [CompletionOutput(0, "", [], finish_reason="error", error=seq.error)]
            return out
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.text if seq.detokenizer else "",
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=seq.logprobs,
                error=seq.error,
            )
            for seq in self.seqs
        ]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished=True)

    def delta_output(self) -> RequestOutput | None:
        """What is new since the last delta: tokens, text that no stop string can still cut, logprobs.

        Sequences with nothing new are left out; None when no sequence has anything to report.
        """
        outputs = []
        for seq in self.seqs:
            tokens = seq.output_token_ids[seq.num_streamed_tokens :]
            text = ""
            if seq.detokenizer is not None:
                end = seq.detokenizer.stable_length(final=seq.is_finished)
                text = seq.detokenizer.text[seq.num_streamed_chars : end]
                seq.num_streamed_chars = max(seq.num_streamed_chars, end)
            newly_finished = seq.is_finished and not seq.reported_finished
            if not tokens and not text and not newly_finished:
                continue
            logprobs = None
            if seq.logprobs is not None:
                logprobs = seq.logprobs[seq.num_streamed_tokens :]
            seq.num_streamed_tokens += len(tokens)
            seq.reported_finished = seq.is_finished
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=tokens,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=logprobs,
                    error=seq.error,
                )
            )
        if not outputs:
            return None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished=self.finished)
