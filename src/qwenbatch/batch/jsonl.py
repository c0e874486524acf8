"""Batch files: the OpenAI Batch line formats, reading inputs lazily, and the crash-safe result log.

Input line (OpenAI Batch): ``{"custom_id", "method": "POST", "url", "body"}``; also accepted: a
JSONL of ``{"prompt": ...}`` or ``{"messages": [...]}`` (optionally with ``custom_id``), and a
plain text file of one prompt per line. Lines without a ``custom_id`` get ``line-<number>``.

Output line (OpenAI Batch): ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}``; a line that could not be sent at all has ``response: null`` and ``error:
{"code", "message"}``.

Exactly once: results are appended and flushed as they finish; on a restart the log is read
back, a torn last line (the process died mid-write) is cut off, and every line already answered
is skipped. A duplicate ``custom_id`` gets its own error line (code ``duplicate_custom_id``), so
the n-th occurrence of an id is answered once too.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import orjson

from qwenbatch.serving.protocol import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RERANK_URL

INPUT_FORMATS = ("auto", "openai", "jsonl", "prompts")
DUPLICATE = "duplicate_custom_id"


@dataclass
class BatchLine:
    """One input line: a request to send, or the error that stops it from being sent."""

    index: int  # 0-based position among the input's non-blank lines
    custom_id: str
    url: str | None = None
    body: dict | None = None
    error_code: str | None = None
    error_message: str | None = None
    occurrence: int = 0  # how many earlier lines had the same custom_id
    number: int = 0  # 1-based line number in the file (blank lines counted)

    @property
    def valid(self) -> bool:
        return self.error_code is None


class OverlongLine(str):
    """Stands for a line ``bounded_lines`` read past without keeping it; ``parse_lines`` makes it an error line."""


LINE_TOO_LONG = "line_too_long"


def bounded_lines(f: TextIO, max_chars: int) -> Iterator[str]:
    """The lines of ``f``, holding at most ``max_chars`` + 1 characters of one at a time: a longer line is
    read past in pieces and yields an OverlongLine, so one 150 MB line costs no 150 MB of memory."""
    while line := f.readline(max_chars + 1):
        if len(line) > max_chars and not line.endswith("\n"):
            while (rest := f.readline(max_chars + 1)) and not rest.endswith("\n"):
                pass
            yield OverlongLine()
        else:
            yield line


def parse_lines(
    lines: Iterable[str],
    input_format: str = "auto",
    endpoints: tuple[str, ...] = (CHAT_URL, COMPLETIONS_URL, RERANK_URL, EMBEDDINGS_URL),
    prompt_url: str = CHAT_URL,
    defaults: dict | None = None,
) -> Iterator[BatchLine]:
    """Parse input lines lazily. ``defaults`` fill body fields a line does not set (sampling flags);
    plain prompts go to ``prompt_url``. Bad lines come out as BatchLines with an error set."""
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input format must be one of {', '.join(INPUT_FORMATS)}, got {input_format!r}")
    seen: Counter[str] = Counter()
    index = 0
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if isinstance(raw, OverlongLine):
            message = f"line {number} is longer than the longest request body allowed"
            line = BatchLine(index, f"line-{number}", error_code=LINE_TOO_LONG, error_message=message)
        elif not text:
            continue
        else:
            line = _parse_one(text, number, index, input_format, endpoints, prompt_url)
        line.number = number
        if line.valid and defaults:
            line.body = {**defaults, **line.body}
        line.occurrence = seen[line.custom_id]
        seen[line.custom_id] += 1
        if line.occurrence:  # valid or not, a repeat is answered as a duplicate, so each occurrence once
            line.error_code = DUPLICATE
            line.error_message = f"custom_id {line.custom_id!r} appears more than once; the first one is run"
        index += 1
        yield line


def _parse_one(
    text: str, number: int, index: int, input_format: str, endpoints: tuple[str, ...], prompt_url: str
) -> BatchLine:
    fallback_id = f"line-{number}"
    if input_format == "prompts":
        body = {CHAT_URL: {"messages": [{"role": "user", "content": text}]}, EMBEDDINGS_URL: {"input": text}}.get(
            prompt_url, {"prompt": text}
        )
        return BatchLine(index, fallback_id, prompt_url, body)
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        return BatchLine(index, fallback_id, error_code="invalid_json", error_message=f"line {number}: {e}")
    if not isinstance(obj, dict):
        return BatchLine(index, fallback_id, error_code="invalid_line", error_message=f"line {number}: not an object")
    custom_id = obj.get("custom_id", fallback_id)
    if not isinstance(custom_id, str) or not custom_id:
        custom_id = fallback_id
    if "body" in obj or input_format == "openai":
        url, body = obj.get("url"), obj.get("body")
        if obj.get("method", "POST") != "POST":
            return _bad(index, custom_id, "invalid_method", f"line {number}: method must be POST")
        if url not in endpoints:
            allowed = ", ".join(endpoints)
            return _bad(index, custom_id, "invalid_url", f"line {number}: url {url!r} is not one of {allowed}")
        if not isinstance(body, dict):
            return _bad(index, custom_id, "invalid_body", f"line {number}: body must be an object")
        return BatchLine(index, custom_id, url, body)
    body = {k: v for k, v in obj.items() if k != "custom_id"}
    if "messages" in body:
        return BatchLine(index, custom_id, CHAT_URL, body)
    if "prompt" in body:
        return BatchLine(index, custom_id, COMPLETIONS_URL, body)
    if "input" in body:
        return BatchLine(index, custom_id, EMBEDDINGS_URL, body)
    return _bad(index, custom_id, "invalid_line", f"line {number}: needs body, messages, prompt or input")


def _bad(index: int, custom_id: str, code: str, message: str) -> BatchLine:
    return BatchLine(index, custom_id, error_code=code, error_message=message)


def result_line(custom_id: str, status_code: int | None, body: dict | None, error: dict | None = None) -> dict:
    """One output line in OpenAI's Batch format."""
    response = None
    if status_code is not None:
        response = {"status_code": status_code, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


def error_line(line: BatchLine) -> dict:
    return result_line(line.custom_id, None, None, {"code": line.error_code, "message": line.error_message})


@dataclass
class DoneSet:
    """What a result log already holds: ids answered, and duplicate-id error lines per id."""

    answered: set[str] = field(default_factory=set)
    duplicates: Counter[str] = field(default_factory=Counter)

    def has(self, line: BatchLine) -> bool:
        if line.occurrence == 0:
            return line.custom_id in self.answered
        return self.duplicates[line.custom_id] >= line.occurrence

    def add(self, result: dict) -> None:
        error = result.get("error") or {}
        if error.get("code") == DUPLICATE:
            self.duplicates[result["custom_id"]] += 1
        else:
            self.answered.add(result["custom_id"])

    def __len__(self) -> int:
        return len(self.answered) + sum(self.duplicates.values())


class ResultLog:
    """The output file, appended to and flushed per result so a killed job loses at most one torn line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done = DoneSet()
        self._file = None

    def open(self, resume: bool) -> DoneSet:
        """Open for appending; with ``resume`` read back what is done (cutting a torn last line),
        without it start the file afresh."""
        if resume and self.path.exists():
            self._repair_and_read()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_bytes(b"")
        self._file = open(self.path, "ab")  # noqa: SIM115 (closed by close())
        return self.done

    def _repair_and_read(self) -> None:
        good_end = 0
        with open(self.path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                try:
                    result = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    break
                self.done.add(result)
                good_end += len(raw)
        if good_end != self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good_end)

    def write(self, result: dict) -> None:
        self._file.write(orjson.dumps(result) + b"\n")
        self._file.flush()
        self.done.add(result)

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def write_in_input_order(output: Path, order: Iterable[tuple[str, int]]) -> None:
    """Rewrite ``output`` so its lines follow ``order`` ((custom_id, occurrence) per input line)."""
    offsets: dict[tuple[str, int], tuple[int, int]] = {}
    seen_duplicates: Counter[str] = Counter()
    with open(output, "rb") as f:
        position = 0
        for raw in f:
            result = orjson.loads(raw)
            custom_id = result["custom_id"]
            if (result.get("error") or {}).get("code") == DUPLICATE:
                seen_duplicates[custom_id] += 1
                key = (custom_id, seen_duplicates[custom_id])
            else:
                key = (custom_id, 0)
            offsets[key] = (position, len(raw))
            position += len(raw)
    tmp = output.with_name(output.name + ".ordering")
    with open(output, "rb") as src, open(tmp, "wb") as dst:
        for key in order:
            if key in offsets:
                start, length = offsets[key]
                src.seek(start)
                dst.write(src.read(length))
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, output)
