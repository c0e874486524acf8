"""Tokenizer loading, chat templates, incremental detokenization and the <think> split."""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

THINK_START, THINK_END = "<think>", "</think>"


class Tokenizer:
    """A Hugging Face fast tokenizer plus the Qwen chat template and eos ids."""

    def __init__(self, folder: Path, eos_token_ids: tuple[int, ...] = ()) -> None:
        from transformers import AutoTokenizer  # deferred: heavy import, only needed with a tokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as e:
            raise ValueError(f"{folder}: cannot load the tokenizer ({e})") from e
        ids = set(eos_token_ids)
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(ids))
        self.backend = self.hf.backend_tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # The Rust tokenizer directly: transformers' encode resets truncation state on every call,
        # which fails ("Already borrowed") when another thread detokenizes at the same time.
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (byte-level: "Ġ" for a leading space)."""
        return [self.backend.id_to_token(t) or "" for t in token_ids]

    def token_text(self, token_id: int) -> str:
        """One token as text (for logprobs); a byte-level piece of a character may decode to '\ufffd'."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def has_token(self, text: str) -> bool:
        return self.backend.token_to_id(text) is not None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        enable_thinking: bool | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """Render ``messages`` with the model's template; ``enable_thinking`` is Qwen3's switch, ``tools`` the
        functions it offers the model (OpenAI's ``tools``); ``continue_final_message`` leaves the last message open
        (no end of turn), for the model to go on with it."""
        if self.hf.chat_template is None:
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        return self.hf.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text as they arrive and applies stop strings.

    Multi-byte characters split over several tokens are held back until complete (the Rust
    ``DecodeStream`` does this), so streamed Chinese text never shows a replacement character.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the stop string that ended the text, if one appeared."""
        piece = self.stream.step(self.tokenizer.backend, token_id)
        if not piece:
            return None
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += piece
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1:
                self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
                return s
        return None

    def stable_length(self, final: bool) -> int:
        """How much of ``text`` a stop string can no longer cut: all of it once the sequence is final."""
        if final or self.max_stop_len <= 1:
            return len(self.text)
        return max(0, len(self.text) - (self.max_stop_len - 1))


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """Split a thinking model's output into (reasoning, answer).

    Handles both Qwen3 styles: the model writes ``<think>`` itself, or the template already
    opened it (``opened``: the prompt ends with ``<think>``) and only ``</think>`` appears. An
    unfinished thought is all reasoning; text that starts no thought is all answer.
    """
    head = text.lstrip()
    if head.startswith(THINK_START):
        body = head[len(THINK_START) :]
    elif opened:
        body = text
    else:
        return None, text
    if THINK_END in body:
        reasoning, answer = body.split(THINK_END, 1)
        return reasoning.strip(), answer.lstrip("\n")
    return body.strip(), ""


class ReasoningStream:
    """``split_reasoning`` for text that arrives in pieces: ``feed`` returns (reasoning, answer) deltas.

    Text that may still turn out to be part of ``<think>`` or ``</think>`` (or whitespace that the
    split would strip) is held back until the next piece or ``finish``.
    """

    def __init__(self, opened: bool = False) -> None:
        self.state = "reasoning" if opened else "start"
        self.pending = ""
        self.reasoning_started = False
        self.answer_started = False
        self.thought = False  # a </think> was seen

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = ""
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(THINK_START):
                self.pending, self.state = head[len(THINK_START) :], "reasoning"
            elif not head or THINK_START.startswith(head):
                return "", ""
            else:
                self.state = "answer"
        if self.state == "reasoning":
            if not self.reasoning_started:
                self.pending = self.pending.lstrip()
                self.reasoning_started = bool(self.pending)
            at = self.pending.find(THINK_END)
            if at != -1:
                reasoning = self.pending[:at].rstrip()
                self.pending, self.state = self.pending[at + len(THINK_END) :], "answer"
                self.thought = True
            else:
                keep = partial_suffix(self.pending, THINK_END)
                body = self.pending[: len(self.pending) - keep]
                cut = len(body.rstrip())  # trailing whitespace waits: it is stripped if </think> follows
                reasoning, self.pending = body[:cut], self.pending[cut:]
                return reasoning, ""
        if not self.answer_started and self.thought:
            self.pending = self.pending.lstrip("\n")  # the blank line after </think>
        self.answer_started = self.answer_started or bool(self.pending)
        answer, self.pending = self.pending, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """Flush what was held back at the end of the output."""
        rest, self.pending = self.pending, ""
        if self.state == "reasoning":
            return rest.rstrip(), ""
        return "", rest


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
