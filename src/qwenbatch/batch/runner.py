"""Run a batch file through a backend: stream lines in, results out as they finish, resumable.

The input is read lazily and at most ``backend.capacity`` requests are in flight, so memory
stays flat however long the file is. Each result is appended and flushed as it arrives (see
``jsonl.ResultLog``); a restart with the same command skips what is done.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from qwenbatch.batch import text
from qwenbatch.batch.backends import Backend
from qwenbatch.batch.jsonl import (
    CHAT_URL,
    BatchLine,
    ResultLog,
    error_line,
    parse_lines,
    result_line,
    write_in_input_order,
)

logger = logging.getLogger(__name__)

LOG_EVERY_S = 30.0  # progress log interval when stderr is not a terminal


@dataclass
class BatchOptions:
    """How lines are read, sent and written."""

    input_format: str = "auto"  # auto | openai | jsonl | prompts
    prompt_url: str = CHAT_URL  # where plain prompts go
    defaults: dict = field(default_factory=dict)  # body fields a line does not set (e.g. max_tokens)
    resume: bool = True  # skip what the output already holds
    ordered: bool = False  # rewrite the output in input order at the end
    normalize_input: bool = False
    max_input_chars: int | None = None
    clean_output: bool = False
    bucket_by_length: bool = False  # sort each window of lines by prompt length before sending
    progress: bool | None = None  # a progress bar; default: when stderr is a terminal


@dataclass
class BatchSummary:
    """What a run did."""

    total: int = 0  # lines in the input
    ok: int = 0  # answered with status 200 in this run
    failed: int = 0  # error lines written in this run
    skipped: int = 0  # already in the output from an earlier run
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0

    def format(self) -> str:
        tps = (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s else 0.0
        out_tps = self.output_tokens / self.wall_s if self.wall_s else 0.0
        return (
            f"{self.ok} ok, {self.failed} failed, {self.skipped} already done (of {self.total}); "
            f"{self.prompt_tokens} prompt + {self.output_tokens} output tokens in {self.wall_s:.1f} s "
            f"({tps:.1f} tok/s, {out_tps:.1f} output tok/s)"
        )


def read_lines(path: Path, options: BatchOptions) -> Iterator[BatchLine]:
    # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first line.
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        yield from parse_lines(f, options.input_format, prompt_url=options.prompt_url, defaults=options.defaults)


def scan(path: Path, options: BatchOptions) -> tuple[int, int]:
    """(lines, valid lines); ValueError before anything loads when no line can run."""
    total = valid = 0
    for line in read_lines(path, options):
        total += 1
        valid += line.valid
    if not valid:
        raise ValueError(f"{path}: no valid request line (of {total})")
    return total, valid


async def run_batch(
    input_path: Path,
    output_path: Path,
    backend: Backend,
    options: BatchOptions,
    on_result: Callable[[dict], None] | None = None,
) -> BatchSummary:
    """Run every line of ``input_path`` not yet in ``output_path`` through ``backend``; ``on_result`` is
    called with each result line once it is safely in the output."""
    summary = BatchSummary()
    summary.total, _ = scan(input_path, options)
    log = ResultLog(output_path)
    done = log.open(options.resume)
    started = time.perf_counter()
    show_bar = sys.stderr.isatty() if options.progress is None else options.progress
    bar = tqdm(total=summary.total, initial=len(done), unit="req", disable=not show_bar, dynamic_ncols=True)
    if len(done):
        logger.info("resuming: %d of %d lines are done", len(done), summary.total)
    last_log = started
    tasks: set[asyncio.Task] = set()
    # Only a resumed job can have nothing left; then it loads no model (and starts no Ray cluster).
    needs_backend = not len(done) or any(line.valid and not done.has(line) for line in read_lines(input_path, options))
    try:
        if needs_backend:
            await backend.start()
        started = time.perf_counter()
        slots = asyncio.Semaphore(max(1, backend.capacity))

        def finished(result: dict, tokens: tuple[int, int]) -> None:
            nonlocal last_log
            log.write(result)
            if on_result is not None:
                on_result(result)
            ok = succeeded(result)
            summary.ok += ok
            summary.failed += not ok
            summary.prompt_tokens += tokens[0]
            summary.output_tokens += tokens[1]
            bar.update(1)
            elapsed = max(time.perf_counter() - started, 1e-9)
            bar.set_postfix_str(f"{summary.output_tokens / elapsed:.0f} out tok/s")
            if not show_bar and time.perf_counter() - last_log > LOG_EVERY_S:
                last_log = time.perf_counter()
                logger.info(
                    "%d/%d done, %.1f output tok/s", len(log.done), summary.total, summary.output_tokens / elapsed
                )

        async def run_one(line: BatchLine) -> None:
            try:
                status, body = await backend.send(line.url, _prepare(line, options))
                if status == 200 and options.clean_output:
                    _clean(body)
                finished(result_line(line.custom_id, status, body), _usage(body))
            finally:
                slots.release()

        for line in _ordered_for_sending(read_lines(input_path, options), options, backend.capacity):
            if done.has(line):
                summary.skipped += 1
                continue
            if not line.valid:
                finished(error_line(line), (0, 0))
                continue
            await slots.acquire()
            task = asyncio.ensure_future(run_one(line))
            tasks.add(task)
            task.add_done_callback(_forget_if_ok(tasks))
            _raise_first_failure(tasks)
        while tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            _raise_first_failure(tasks)
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
        log.close()
        await backend.close()
    summary.wall_s = time.perf_counter() - started
    if options.ordered:
        write_in_input_order(
            output_path, ((line.custom_id, line.occurrence) for line in read_lines(input_path, options))
        )
    return summary


def succeeded(result: dict) -> bool:
    """Whether a result line is an answer (status 200) rather than an error."""
    return result["error"] is None and result["response"]["status_code"] == 200


def _forget_if_ok(tasks: set[asyncio.Task]):
    """Drop finished tasks from ``tasks``, but keep failed ones so the loop sees their error."""

    def forget(task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            tasks.discard(task)

    return forget


def _raise_first_failure(tasks: set[asyncio.Task]) -> None:
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()


def _ordered_for_sending(lines: Iterator[BatchLine], options: BatchOptions, capacity: int) -> Iterator[BatchLine]:
    """Lines in input order, or with ``bucket_by_length`` each window of 4 x capacity lines sorted by
    prompt length, so the requests in flight together have similar lengths."""
    if not options.bucket_by_length:
        yield from lines
        return
    window: list[BatchLine] = []
    for line in lines:
        window.append(line)
        if len(window) >= 4 * max(1, capacity):
            yield from sorted(window, key=_prompt_chars)
            window = []
    yield from sorted(window, key=_prompt_chars)


def _prompt_chars(line: BatchLine) -> int:
    body = line.body or {}
    if "messages" in body:
        return sum(len(str(m.get("content", ""))) for m in body["messages"] if isinstance(m, dict))
    prompt = body.get("prompt", "")
    return len(prompt) if isinstance(prompt, str | list) else 0


def _prepare(line: BatchLine, options: BatchOptions) -> dict:
    body = line.body
    if not options.normalize_input:
        return body
    body = dict(body)

    def norm(value):
        return text.normalize_input(value, options.max_input_chars) if isinstance(value, str) else value

    if isinstance(body.get("messages"), list):
        messages = []
        for m in body["messages"]:
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                m = {**m, "content": norm(m["content"])}
            elif isinstance(m, dict) and isinstance(m.get("content"), list):
                parts = [
                    {**p, "text": norm(p["text"])} if isinstance(p, dict) and "text" in p else p for p in m["content"]
                ]
                m = {**m, "content": parts}
            messages.append(m)
        body["messages"] = messages
    if isinstance(body.get("query"), str):  # a rerank line
        body["query"] = norm(body["query"])
    if isinstance(body.get("documents"), list):
        body["documents"] = [
            {**d, "text": norm(d["text"])} if isinstance(d, dict) and "text" in d else norm(d)
            for d in body["documents"]
        ]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        body["prompt"] = norm(prompt)
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        body["prompt"] = [norm(p) for p in prompt]
    return body


def _clean(body: dict) -> None:
    for choice in body.get("choices", []):
        message = choice.get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            message["content"] = text.clean_output(message["content"])
        elif isinstance(choice.get("text"), str):
            choice["text"] = text.clean_output(choice["text"])


def _usage(body: dict) -> tuple[int, int]:
    usage = body.get("usage") or {}
    return usage.get("prompt_tokens", usage.get("total_tokens", 0)), usage.get("completion_tokens", 0)
