"""`qwenbatch run-batch`: input formats, error lines, exactly-once after SIGKILL, ordering, servers, Ray.

Everything runs on the tiny random Qwen3 checkpoint (float32, gibberish text), greedy with ``ignore_eos``
so texts and token counts are fixed; results are compared with what the server (``tiny_server``) or an
uninterrupted run gives for the same request rather than with expected words.

Fast cases call ``qwenbatch.cli.main`` in this process (the model loads in a fraction of a second once
warm); the crash tests start the CLI as a subprocess so ``kill -9`` is real. Runner plumbing that a random
model cannot show (``--clean-output``, the in-flight bound) uses a canned backend object.
"""

from __future__ import annotations

import asyncio
import functools
import io
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson
import pytest

from qwenbatch.batch import backends
from qwenbatch.batch.runner import BatchOptions, run_batch
from qwenbatch.cli import main
from qwenbatch.config import EngineConfig
from qwenbatch.server.app import ServerSettings
from server_harness import RunningServer, free_port

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GREEDY = {"temperature": 0, "ignore_eos": True}
DEADLINE_S = 180  # generous: polls and subprocesses on a loaded two-core machine


# -- helpers ----------------------------------------------------------------------------------------


def openai_line(custom_id: str, url: str, body: dict, method: str = "POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def write_jsonl(path: Path, rows: list) -> Path:
    """One line per row: dicts as JSON, strings as they are (for broken lines)."""
    text = "".join((row if isinstance(row, str) else orjson.dumps(row).decode()) + "\n" for row in rows)
    path.write_text(text, encoding="utf-8")
    return path


def read_results(path: Path) -> list[dict]:
    """Every line of a results file; fails on a line that is not complete JSON."""
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "the results file ends with a torn line"
    return [orjson.loads(line) for line in data.splitlines()]


def by_id(results: list[dict]) -> dict[str, dict]:
    counts = Counter(r["custom_id"] for r in results)
    assert all(n == 1 for n in counts.values()), {k: n for k, n in counts.items() if n > 1}
    return {r["custom_id"]: r for r in results}


def answer(result: dict):
    """The generated part of a 200 result: the chat message, or the completion text."""
    assert result["error"] is None and result["response"]["status_code"] == 200, result
    choice = result["response"]["body"]["choices"][0]
    return choice["message"] if "message" in choice else choice["text"]


def answers(results: list[dict]) -> dict[str, object]:
    return {custom_id: answer(r) for custom_id, r in by_id(results).items()}


def usage(result: dict) -> dict:
    return result["response"]["body"]["usage"]


def complete_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(["run-batch", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def summary_line(err: str) -> str:
    lines = [line for line in err.splitlines() if " ok, " in line and " failed, " in line]
    assert lines, err
    return lines[-1]


def cli_command(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "qwenbatch.cli", "run-batch", *argv]


def server_completion(url: str, body: dict) -> dict:
    response = httpx.post(url + COMPLETIONS, json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def server_chat(url: str, body: dict) -> dict:
    response = httpx.post(url + CHAT, json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


class CannedBackend:
    """A backend that answers every request with a canned body and records what it was sent."""

    def __init__(self, body: dict | None = None, status: int = 200, capacity: int = 4, delay_s: float = 0.0):
        self.body, self.status, self.capacity, self.delay_s = body, status, capacity, delay_s
        self.sent: list[tuple[str, dict]] = []
        self.in_flight = self.max_in_flight = 0
        self.started = self.closed = False

    async def start(self) -> None:
        self.started = True

    async def send(self, url: str, body: dict) -> tuple[int, dict]:
        self.sent.append((url, body))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if self.body is not None:
            return self.status, orjson.loads(orjson.dumps(self.body))
        text = body.get("prompt") or body["messages"][-1]["content"]
        choice = {"index": 0, "text": f"echo {text}", "finish_reason": "stop"}
        return self.status, {"choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}

    async def close(self) -> None:
        self.closed = True


def run_canned(tmp_path: Path, rows: list, backend: CannedBackend, **options) -> tuple[list[dict], object]:
    inp = write_jsonl(tmp_path / "canned-in.jsonl", rows)
    out = tmp_path / "canned-out.jsonl"
    summary = asyncio.run(run_batch(inp, out, backend, BatchOptions(**options)))
    return read_results(out), summary


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_flags(tiny_qwen3) -> list[str]:
    return ["--model", str(tiny_qwen3), "--dtype", "float32", "--kv-cache-memory", "16MiB"]


KILL_LINES = 40


@pytest.fixture(scope="module")
def kill_batch(tmp_path_factory, engine_flags) -> tuple[Path, dict[str, str]]:
    """A 40-line OpenAI Batch file (completions, max_tokens 8, ignore_eos) and its uninterrupted answers."""
    folder = tmp_path_factory.mktemp("kill-batch")
    rows = [
        openai_line(
            f"req-{i:02d}", COMPLETIONS, {"prompt": f"Prompt {i}: the quick brown fox", "max_tokens": 8, **GREEDY}
        )
        for i in range(KILL_LINES)
    ]
    inp = write_jsonl(folder / "input.jsonl", rows)
    reference = folder / "reference.jsonl"
    assert main(["run-batch", "-i", str(inp), "-o", str(reference), *engine_flags]) == 0
    texts = answers(read_results(reference))
    assert len(texts) == KILL_LINES
    assert all(usage(r)["completion_tokens"] == 8 for r in read_results(reference))
    return inp, texts


# -- 1. input formats and endpoints -----------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_run(tmp_path_factory, engine_flags):
    """One in-process run of OpenAI Batch lines to both endpoints, with --max-tokens 3 as the default."""
    folder = tmp_path_factory.mktemp("openai-run")
    rows = [
        openai_line("chat-1", CHAT, {"messages": [{"role": "user", "content": "你好"}], "max_tokens": 5, **GREEDY}),
        openai_line("chat-default", CHAT, {"messages": [{"role": "user", "content": "Python is"}], **GREEDY}),
        openai_line(
            "comp-1", COMPLETIONS, {"model": "whatever-the-file-says", "prompt": "The quick brown fox", **GREEDY}
        ),
        openai_line("comp-own", COMPLETIONS, {"prompt": "Batch inference", "max_tokens": 6, **GREEDY}),
        openai_line(
            "chat-own", CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2, **GREEDY}
        ),
    ]
    inp = write_jsonl(folder / "input.jsonl", rows)
    out = folder / "output.jsonl"
    code = main(["run-batch", "-i", str(inp), "-o", str(out), "--max-tokens", "3", *engine_flags])
    assert code == 0
    return by_id(read_results(out)), rows


def test_openai_lines_get_openai_batch_output_lines(openai_run):
    results, rows = openai_run
    assert set(results) == {row["custom_id"] for row in rows}
    for row in rows:
        result = results[row["custom_id"]]
        assert set(result) == {"id", "custom_id", "response", "error"}
        assert result["id"].startswith("batch_req_")
        assert result["error"] is None
        response = result["response"]
        assert response["status_code"] == 200
        assert response["request_id"].startswith("req_")
        body = response["body"]
        assert body["object"] == ("chat.completion" if row["url"] == CHAT else "text_completion")
        assert len(body["choices"]) == 1
        assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert len({r["id"] for r in results.values()}) == len(rows)
    assert len({r["response"]["request_id"] for r in results.values()}) == len(rows)


def test_max_tokens_flag_is_the_default_and_a_lines_own_value_wins(openai_run):
    results, _ = openai_run
    assert usage(results["chat-default"])["completion_tokens"] == 3
    assert usage(results["comp-1"])["completion_tokens"] == 3
    assert usage(results["chat-1"])["completion_tokens"] == 5
    assert usage(results["comp-own"])["completion_tokens"] == 6
    assert usage(results["chat-own"])["completion_tokens"] == 2  # max_completion_tokens beats the default


def test_results_equal_the_servers_answers(openai_run, tiny_server):
    results, _ = openai_run
    expected = server_completion(tiny_server.url, {"prompt": "The quick brown fox", "max_tokens": 3, **GREEDY})
    assert answer(results["comp-1"]) == expected["choices"][0]["text"]
    assert usage(results["comp-1"]) == expected["usage"]
    chat = server_chat(tiny_server.url, {"messages": [{"role": "user", "content": "你好"}], "max_tokens": 5, **GREEDY})
    assert answer(results["chat-1"]) == chat["choices"][0]["message"]
    assert usage(results["chat-1"]) == chat["usage"]


PROMPTS = ["The quick brown fox", "用一句话介绍Python", "def add(a, b):"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_plain_text_prompts_to_either_endpoint(capsys, tmp_path, engine_flags, tiny_server, endpoint):
    inp = tmp_path / "prompts.txt"
    inp.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n   \n{PROMPTS[2]}\n", encoding="utf-8")  # blank lines skipped
    out = tmp_path / "out.jsonl"
    flags = ["--input-format", "prompts", "--endpoint", endpoint, "--max-tokens", "4", "--temperature", "0"]
    code, _, err = run_cli(capsys, ["-i", str(inp), "-o", str(out), *flags, *engine_flags])
    assert code == 0, err
    results = by_id(read_results(out))
    assert set(results) == {"line-1", "line-3", "line-5"}  # numbered by the line they are on
    for custom_id, prompt in zip(["line-1", "line-3", "line-5"], PROMPTS, strict=True):
        body = {"max_tokens": 4, "temperature": 0}
        if endpoint == "chat":
            expected = server_chat(tiny_server.url, {"messages": [{"role": "user", "content": prompt}], **body})
            assert results[custom_id]["response"]["body"]["object"] == "chat.completion"
            assert answer(results[custom_id]) == expected["choices"][0]["message"]
        else:
            expected = server_completion(tiny_server.url, {"prompt": prompt, **body})
            assert results[custom_id]["response"]["body"]["object"] == "text_completion"
            assert answer(results[custom_id]) == expected["choices"][0]["text"]
        assert usage(results[custom_id]) == expected["usage"]
    assert "3 ok, 0 failed" in summary_line(err)


def test_jsonl_of_prompts_and_messages_with_and_without_custom_id(capsys, tmp_path, engine_flags):
    rows = [
        {"custom_id": "p-named", "prompt": "The quick brown fox", **GREEDY},
        {"prompt": "Python is", **GREEDY},
        {"messages": [{"role": "user", "content": "你好"}], **GREEDY},
        {"custom_id": "m-named", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **GREEDY},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, ["-i", str(inp), "-o", str(out), "--max-tokens", "4", *engine_flags])
    assert code == 0, err
    results = by_id(read_results(out))
    assert set(results) == {"p-named", "line-2", "line-3", "m-named"}
    objects = {k: r["response"]["body"]["object"] for k, r in results.items()}
    assert objects == {
        "p-named": "text_completion",
        "line-2": "text_completion",
        "line-3": "chat.completion",
        "m-named": "chat.completion",
    }
    tokens = {k: usage(r)["completion_tokens"] for k, r in results.items()}
    assert tokens == {"p-named": 4, "line-2": 4, "line-3": 4, "m-named": 2}


def test_stdin_to_stdout(capsys, monkeypatch, tmp_path, engine_flags, openai_run):
    rows = [
        openai_line("comp-1", COMPLETIONS, {"prompt": "The quick brown fox", **GREEDY}),
        openai_line("comp-own", COMPLETIONS, {"prompt": "Batch inference", "max_tokens": 6, **GREEDY}),
    ]
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, ["-i", "-", "-o", "-", "--max-tokens", "3", *engine_flags])
    assert code == 0, err
    results = [orjson.loads(line) for line in out.splitlines()]
    assert answers(results) == {k: answer(openai_run[0][k]) for k in ("comp-1", "comp-own")}
    assert list(tmp_path.iterdir()) == []  # nothing written beside the streams
    assert "2 ok, 0 failed" in summary_line(err)


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
    # Editors on Windows save UTF-8 with a BOM; the first line is as valid as the others.
    rows = [{"custom_id": "first", "prompt": "a"}, {"custom_id": "second", "prompt": "b"}]
    inp = tmp_path / "canned-in.jsonl"
    inp.write_text("".join(orjson.dumps(r).decode() + "\n" for r in rows), encoding="utf-8-sig")
    out = tmp_path / "canned-out.jsonl"
    asyncio.run(run_batch(inp, out, CannedBackend(), BatchOptions()))
    results = read_results(out)
    assert [r["error"] for r in results] == [None, None]
    assert sorted(r["custom_id"] for r in results) == ["first", "second"]


def test_a_byte_order_mark_does_not_reach_the_first_prompt(tmp_path):
    inp = tmp_path / "prompts.txt"
    inp.write_text("hello\nworld\n", encoding="utf-8-sig")
    backend = CannedBackend()
    asyncio.run(run_batch(inp, tmp_path / "out.jsonl", backend, BatchOptions(input_format="prompts")))
    assert [body["messages"][0]["content"] for _, body in backend.sent] == ["hello", "world"]


# -- 2. error lines ---------------------------------------------------------------------------------


def test_bad_lines_get_error_lines_and_the_job_goes_on(capsys, tmp_path, engine_flags):
    ok_body = {"prompt": "The quick brown fox", "max_tokens": 4, **GREEDY}
    rows = [
        openai_line("a", COMPLETIONS, ok_body),
        openai_line("a", COMPLETIONS, {"prompt": "a second time", "max_tokens": 4}),
        openai_line("bad-url", "/v1/images/generations", ok_body),
        '{"custom_id": "broken", "url": ',  # line 4: not JSON
        openai_line("get", COMPLETIONS, ok_body, method="GET"),
        openai_line("top-p", COMPLETIONS, {**ok_body, "top_p": 5}),
        openai_line("b", CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **GREEDY}),
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, ["-i", str(inp), "-o", str(out), *engine_flags])
    assert code == 0, err
    results = read_results(out)
    assert len(results) == len(rows)
    errors = {(r["custom_id"], r["error"]["code"]) for r in results if r["error"] is not None}
    assert errors == {
        ("a", "duplicate_custom_id"),
        ("bad-url", "invalid_url"),
        ("line-4", "invalid_json"),
        ("get", "invalid_method"),
    }
    for r in results:
        if r["error"] is not None:
            assert r["response"] is None
            assert r["error"]["message"]
    answered = {r["custom_id"]: r for r in results if r["error"] is None}
    assert set(answered) == {"a", "top-p", "b"}
    assert usage(answered["a"])["completion_tokens"] == 4  # the first "a" is the one answered
    assert answered["b"]["response"]["status_code"] == 200
    rejected = answered["top-p"]["response"]
    assert rejected["status_code"] == 400
    assert rejected["body"]["error"]["type"] == "invalid_request_error"
    assert "top_p" in rejected["body"]["error"]["message"]
    assert "2 ok, 5 failed" in summary_line(err)


@pytest.mark.parametrize(
    "content",
    ["", "\n  \n", "not json\n{also not\n", '{"custom_id": "x", "url": "/v1/nope", "body": {}}\n[1, 2]\n'],
    ids=["empty", "blank", "not-json", "bad-url-and-array"],
)
def test_a_file_with_no_valid_line_fails_before_the_model_loads(capsys, tmp_path, content):
    inp = tmp_path / "bad.jsonl"
    inp.write_text(content, encoding="utf-8")
    out = tmp_path / "out.jsonl"
    code, stdout, err = run_cli(capsys, ["-i", str(inp), "-o", str(out), "--model", "/nonexistent"])
    assert code == 2
    assert stdout == ""
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("qwenbatch: error: ")]
    assert len(errors) == 1, err
    assert str(inp) in errors[0] and "no valid request line" in errors[0]
    assert "nonexistent" not in err
    assert not out.exists()


def test_missing_input_file_is_a_one_line_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, ["-i", str(tmp_path / "absent.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert code == 2
    assert [line for line in err.splitlines() if line.startswith("qwenbatch: error: ")] == [
        f"qwenbatch: error: {tmp_path / 'absent.jsonl'}: no such file"
    ]


# -- 2b. duplicates across resumes (fake backend: the runner's bookkeeping) --------------------------


def test_a_rerun_of_a_finished_job_sends_and_writes_nothing(tmp_path):
    rows = [openai_line(f"r{i}", COMPLETIONS, {"prompt": f"p{i}"}) for i in range(5)]
    rows += [openai_line("r0", COMPLETIONS, {"prompt": "dup"}), "not json"]
    first, summary = run_canned(tmp_path, rows, CannedBackend())
    assert (summary.ok, summary.failed, summary.skipped) == (5, 2, 0)
    backend = CannedBackend()
    again, summary = run_canned(tmp_path, rows, backend)
    assert again == first
    assert backend.sent == []
    assert (summary.ok, summary.failed, summary.skipped) == (0, 0, 7)


def test_an_invalid_repeat_of_an_id_is_written_once_across_resumes(tmp_path):
    rows = [
        openai_line("a", COMPLETIONS, {"prompt": "first"}),
        openai_line("a", "/v1/nope", {"prompt": "second, to a bad url"}),
    ]
    first, _ = run_canned(tmp_path, rows, CannedBackend())
    assert len(first) == 2
    again, summary = run_canned(tmp_path, rows, CannedBackend())
    assert len(again) == 2, [r["error"] for r in again]  # the rerun must not append another error line
    assert summary.skipped == 2


def test_resume_answers_an_id_whose_invalid_repeat_was_saved_first(tmp_path):
    # Killed after the second line's error was written but before the first line's answer came back.
    rows = [
        openai_line("a", COMPLETIONS, {"prompt": "first"}),
        openai_line("a", "/v1/nope", {"prompt": "second, to a bad url"}),
    ]
    out = tmp_path / "canned-out.jsonl"
    run_canned(tmp_path, rows, CannedBackend())
    saved = [r for r in read_results(out) if r["error"] is not None]
    write_jsonl(out, saved)
    results, _ = run_canned(tmp_path, rows, CannedBackend())
    assert [r for r in results if r["error"] is None], "the first 'a' was never answered"


def test_ordered_output_keeps_the_answer_of_an_id_with_an_invalid_repeat(tmp_path):
    rows = [
        openai_line("a", COMPLETIONS, {"prompt": "first"}),
        openai_line("a", "/v1/nope", {"prompt": "second, to a bad url"}),
        openai_line("b", COMPLETIONS, {"prompt": "third"}),
    ]
    results, _ = run_canned(tmp_path, rows, CannedBackend(), ordered=True)
    # The answer to the first "a", then an error line for the second, then "b".
    assert [(r["custom_id"], r["error"] is None) for r in results] == [("a", True), ("a", False), ("b", True)]


# -- 3. exactly once after SIGKILL ------------------------------------------------------------------

TORN = b'{"id":"batch_req_torn","custom_id":"req-39","response":{"status_co'


def start_and_kill(cmd: list[str], out: Path, at_lines: int, log: Path) -> int:
    """Start ``cmd``, SIGKILL it once ``out`` holds ``at_lines`` complete lines; the lines it held then."""
    with open(log, "ab") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if complete_lines(out) >= at_lines:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        proc.wait()
    tail = log.read_text(errors="replace")[-3000:]
    assert proc.returncode == -signal.SIGKILL, f"the job ended by itself (rc {proc.returncode}) before the kill\n{tail}"
    return complete_lines(out)


def kill_resume_and_finish(cmd: list[str], out: Path, tmp_path: Path) -> list[int]:
    """Kill the job at a few points (and once tear its last line), then rerun it until it exits 0."""
    log = tmp_path / "stderr.log"
    held = []
    for i, at_lines in enumerate([1, 12, 24]):
        held.append(start_and_kill(cmd, out, max(at_lines, complete_lines(out) + 1), log))
        if i == 1:  # as if the process died in the middle of writing a line
            with open(out, "ab") as f:
                f.write(TORN)
    for _ in range(3):
        result = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=DEADLINE_S)
        if result.returncode == 0:
            break
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-3000:]
    assert "already done" in result.stderr.decode()
    return held


def assert_exactly_once_and_equal(out: Path, reference: dict[str, str]) -> None:
    results = read_results(out)
    assert Counter(r["custom_id"] for r in results) == Counter(dict.fromkeys(reference, 1))
    assert all(r["response"]["status_code"] == 200 for r in results)
    assert answers(results) == reference
    assert all(usage(r)["completion_tokens"] == 8 for r in results)


def test_in_process_job_is_exactly_once_after_sigkill(tmp_path, kill_batch, engine_flags):
    inp, reference = kill_batch
    out = tmp_path / "out.jsonl"
    # One sequence at a time so results arrive one by one and the kills land mid-job.
    cmd = cli_command(["-i", str(inp), "-o", str(out), "--max-num-seqs", "1", *engine_flags])
    held = kill_resume_and_finish(cmd, out, tmp_path)
    assert held[-1] < KILL_LINES
    assert_exactly_once_and_equal(out, reference)


def test_server_job_is_exactly_once_after_sigkill(tmp_path, kill_batch, tiny_server):
    inp, reference = kill_batch
    out = tmp_path / "out.jsonl"
    cmd = cli_command(["-i", str(inp), "-o", str(out), "--server", tiny_server.url, "--max-concurrency", "1"])
    held = kill_resume_and_finish(cmd, out, tmp_path)
    assert held[-1] < KILL_LINES
    assert_exactly_once_and_equal(out, reference)


# -- 4. --ordered -----------------------------------------------------------------------------------


def ordered_rows() -> list:
    """Long prompts with many tokens first, short ones with one token last: they finish in reverse."""
    long = "Batch inference pushes thousands of prompts through one model as fast as possible. " * 6
    rows: list = [
        openai_line(f"long-{i}", COMPLETIONS, {"prompt": f"{i} {long}", "max_tokens": 8, **GREEDY}) for i in range(4)
    ]
    rows.append("this line is not json")  # line-5: an error line has its place too
    rows += [openai_line(f"short-{i}", COMPLETIONS, {"prompt": f"{i}", "max_tokens": 1, **GREEDY}) for i in range(4)]
    rows.append(openai_line("short-0", COMPLETIONS, {"prompt": "again", "max_tokens": 1}))  # a duplicate id
    return rows


ORDER = [
    ("long-0", None),
    ("long-1", None),
    ("long-2", None),
    ("long-3", None),
    ("line-5", "invalid_json"),
    ("short-0", None),
    ("short-1", None),
    ("short-2", None),
    ("short-3", None),
    ("short-0", "duplicate_custom_id"),
]


def order_of(results: list[dict]) -> list[tuple[str, str | None]]:
    return [(r["custom_id"], (r["error"] or {}).get("code")) for r in results]


def test_ordered_output_follows_the_input_also_after_a_resume(capsys, tmp_path, engine_flags):
    inp = write_jsonl(tmp_path / "in.jsonl", ordered_rows())
    unordered = tmp_path / "unordered.jsonl"
    code, _, err = run_cli(capsys, ["-i", str(inp), "-o", str(unordered), *engine_flags])
    assert code == 0, err
    finished_order = order_of(read_results(unordered))
    assert sorted(finished_order, key=str) == sorted(ORDER, key=str)
    assert finished_order != ORDER  # precondition: completion order differs from input order

    out = tmp_path / "ordered.jsonl"
    code, _, err = run_cli(capsys, ["-i", str(inp), "-o", str(out), "--ordered", *engine_flags])
    assert code == 0, err
    ordered = read_results(out)
    assert order_of(ordered) == ORDER
    assert answers([r for r in ordered if r["error"] is None]) == answers(
        [r for r in read_results(unordered) if r["error"] is None]
    )

    # Resume from a partial log in completion order (its last line torn): the kept lines stay as they
    # were, the rest are answered, and the whole file comes out in input order.
    kept = unordered.read_bytes().splitlines(keepends=True)[:4]
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_bytes(b"".join(kept) + TORN)
    code, _, err = run_cli(capsys, ["-i", str(inp), "-o", str(resumed), "--ordered", *engine_flags])
    assert code == 0, err
    results = read_results(resumed)
    assert order_of(results) == ORDER
    ids_of_kept = {orjson.loads(line)["id"] for line in kept}
    assert ids_of_kept <= {r["id"] for r in results}  # not rerun
    assert "4 already done" in summary_line(err)


# -- 5. servers: one dies midway, all unreachable ----------------------------------------------------


def test_a_server_that_dies_midway_leaves_its_share_to_the_other(capsys, tmp_path, tiny_qwen3):
    rows = [
        openai_line(f"r{i:02d}", COMPLETIONS, {"prompt": f"{i} the quick brown fox", "max_tokens": 8, **GREEDY})
        for i in range(30)
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24, max_num_seqs=1)
    with (
        RunningServer(ServerSettings(served_model_names=["server-a"]), config) as a,
        RunningServer(ServerSettings(served_model_names=["server-b"]), config) as b,
    ):
        argv = ["-i", str(inp), "-o", str(out), "--server", a.url, "--server", b.url, "--max-concurrency", "4"]
        codes: list[int] = []
        job = threading.Thread(target=lambda: codes.append(main(["run-batch", *argv])), daemon=True)
        job.start()
        deadline = time.monotonic() + DEADLINE_S
        while complete_lines(out) < 4 and job.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        lines_when_b_stopped = complete_lines(out)
        b.__exit__(None, None, None)  # stops accepting, finishes what it has, goes away
        assert not b.thread.is_alive()
        job.join(DEADLINE_S)
        assert not job.is_alive()
    capsys.readouterr()
    assert codes == [0]
    assert lines_when_b_stopped < len(rows)  # precondition: B went away mid-job
    results = read_results(out)
    assert sorted(r["custom_id"] for r in results) == [row["custom_id"] for row in rows]
    assert all(r["response"]["status_code"] == 200 for r in results)
    served_by = Counter(r["response"]["body"]["model"] for r in results)
    assert served_by["server-b"] > 0 and served_by["server-a"] > 0


def test_all_servers_unreachable_stops_the_job_and_records_nothing(capsys, monkeypatch, tmp_path, tiny_server):
    # The CLI's ServersBackend retries 12 times with backoff up to 30 s; fewer attempts keep this quick.
    fast = functools.partial(backends.ServersBackend, max_attempts=3, max_backoff_s=0.2)
    monkeypatch.setattr(backends, "ServersBackend", fast)
    rows = [openai_line(f"r{i}", COMPLETIONS, {"prompt": f"{i} fox", "max_tokens": 4, **GREEDY}) for i in range(5)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    dead = f"http://127.0.0.1:{free_port()}"
    code, _, err = run_cli(capsys, ["-i", str(inp), "-o", str(out), "--server", dead, "--max-concurrency", "2"])
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("qwenbatch: error: ")]
    assert len(errors) == 1, err
    assert "resume" in errors[0]
    assert "Traceback" not in err
    assert read_results(out) == []  # nothing recorded as failed

    code, _, err = run_cli(capsys, ["-i", str(inp), "-o", str(out), "--server", tiny_server.url])
    assert code == 0, err
    results = read_results(out)
    assert sorted(r["custom_id"] for r in results) == [row["custom_id"] for row in rows]
    assert all(r["response"]["status_code"] == 200 for r in results)


def test_servers_backend_gives_up_after_its_attempts_without_writing(tmp_path):
    rows = [openai_line(f"r{i}", COMPLETIONS, {"prompt": f"{i}"}) for i in range(6)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    backend = backends.ServersBackend(
        [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"], 2, max_attempts=4, max_backoff_s=0.1
    )
    with pytest.raises(backends.ServersUnavailableError):
        asyncio.run(run_batch(inp, out, backend, BatchOptions()))
    assert out.read_bytes() == b""


# -- 6. Ray -----------------------------------------------------------------------------------------


def test_ray_backend_with_two_replicas_equals_in_process(tmp_path, kill_batch, engine_flags):
    inp, reference = kill_batch
    rows = inp.read_text().splitlines()[:12]
    small = tmp_path / "in.jsonl"
    small.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.jsonl"
    cmd = cli_command(["-i", str(small), "-o", str(out), "--backend", "ray", "--num-replicas", "2", *engine_flags])
    result = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-3000:]
    texts = answers(read_results(out))
    assert texts == {k: reference[k] for k in texts}
    assert len(texts) == 12


# -- 7. text options through the runner and the CLI -------------------------------------------------

NOISY = "Hello\u200b\u200b      world\ufeff\u200b   \t\t  how\u2060\u2060 are\u200b      you\u200b\u200b today"
CLEAN = "Hello world how are you today"


def test_normalize_input_changes_what_the_model_sees(capsys, tmp_path, engine_flags):
    rows = [
        {"custom_id": "noisy", "prompt": NOISY, "max_tokens": 4, **GREEDY},
        {"custom_id": "clean", "prompt": CLEAN, "max_tokens": 4, **GREEDY},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    raw, normalized = tmp_path / "raw.jsonl", tmp_path / "normalized.jsonl"
    assert run_cli(capsys, ["-i", str(inp), "-o", str(raw), *engine_flags])[0] == 0
    assert run_cli(capsys, ["-i", str(inp), "-o", str(normalized), "--normalize-input", *engine_flags])[0] == 0
    raw_results, norm_results = by_id(read_results(raw)), by_id(read_results(normalized))
    assert usage(raw_results["noisy"])["prompt_tokens"] > usage(raw_results["clean"])["prompt_tokens"]
    assert usage(norm_results["noisy"])["prompt_tokens"] == usage(norm_results["clean"])["prompt_tokens"]
    assert answer(norm_results["noisy"]) == answer(norm_results["clean"]) == answer(raw_results["clean"])


def test_normalize_input_reaches_chat_messages_and_prompt_lists(tmp_path):
    rows = [
        {"custom_id": "chat", "messages": [{"role": "user", "content": NOISY}]},
        {"custom_id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": NOISY}]}]},
        {"custom_id": "list", "prompt": [NOISY, "ＡＢＣ"]},
    ]
    backend = CannedBackend(body={"choices": [], "usage": {}})
    run_canned(tmp_path, rows, backend, normalize_input=True, max_input_chars=11)
    bodies = [body for _, body in backend.sent]  # sent in input order (capacity 4 > 3 lines)
    assert bodies[0]["messages"][0]["content"] == CLEAN[:11]
    assert bodies[1]["messages"][0]["content"][0]["text"] == CLEAN[:11]
    assert bodies[2]["prompt"] == [CLEAN[:11], "ABC"]


def test_max_input_chars_needs_normalize_input(capsys, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    code, _, err = run_cli(capsys, ["-i", str(inp), "-o", str(tmp_path / "o"), "--max-input-chars", "5"])
    assert code == 2
    assert "--normalize-input" in err


CHAT_ANSWER = "好的，以下是Python的简介：\nPython是一种编程语言。"
COMPLETION_ANSWER = "Sure, here is the code:\nprint(1)"


def canned_answers_body() -> dict:
    return {
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": CHAT_ANSWER}, "finish_reason": "stop"},
            {"index": 1, "text": COMPLETION_ANSWER, "finish_reason": "stop"},
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }


@pytest.mark.parametrize("clean", [True, False])
def test_clean_output_strips_preambles_only_when_asked(tmp_path, clean):
    rows = [openai_line("x", CHAT, {"messages": [{"role": "user", "content": "介绍Python"}]})]
    results, summary = run_canned(tmp_path, rows, CannedBackend(body=canned_answers_body()), clean_output=clean)
    choices = results[0]["response"]["body"]["choices"]
    if clean:
        assert choices[0]["message"]["content"] == "Python是一种编程语言。"
        assert choices[1]["text"] == "print(1)"
    else:
        assert choices[0]["message"]["content"] == CHAT_ANSWER
        assert choices[1]["text"] == COMPLETION_ANSWER
    assert (summary.ok, summary.prompt_tokens, summary.output_tokens) == (1, 3, 5)


def test_clean_output_leaves_error_bodies_alone(tmp_path):
    error = {"error": {"message": "Sure, here is the problem: top_p", "type": "invalid_request_error"}}
    rows = [openai_line("x", COMPLETIONS, {"prompt": "p"})]
    results, summary = run_canned(tmp_path, rows, CannedBackend(body=error, status=400), clean_output=True)
    assert results[0]["response"]["status_code"] == 400
    assert results[0]["response"]["body"] == error
    assert summary.failed == 1


def test_clean_output_flag_reaches_the_runner(capsys, monkeypatch, tmp_path):
    backend = CannedBackend(body=canned_answers_body())
    monkeypatch.setattr("qwenbatch.commands.run_batch.make_backend", lambda name, args: backend)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, ["-i", str(inp), "-o", str(out), "--clean-output", "--max-tokens", "7"])
    assert code == 0, err
    [result] = read_results(out)
    assert result["response"]["body"]["choices"][0]["message"]["content"] == "Python是一种编程语言。"
    assert backend.sent == [(CHAT, {"max_tokens": 7, "messages": [{"role": "user", "content": "hi"}]})]
    assert backend.closed


# -- runner plumbing --------------------------------------------------------------------------------


def test_in_flight_requests_never_exceed_the_backends_capacity(tmp_path):
    rows = [openai_line(f"r{i}", COMPLETIONS, {"prompt": f"{i}"}) for i in range(40)]
    backend = CannedBackend(capacity=3, delay_s=0.005)
    results, summary = run_canned(tmp_path, rows, backend)
    assert len(by_id(results)) == 40
    assert backend.max_in_flight == 3
    assert summary.ok == 40


def test_no_resume_starts_the_output_afresh(capsys, monkeypatch, tmp_path):
    backend = CannedBackend()
    monkeypatch.setattr("qwenbatch.commands.run_batch.make_backend", lambda name, args: backend)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "out.jsonl"
    for flags in ([], [], ["--no-resume"]):
        assert run_cli(capsys, ["-i", str(inp), "-o", str(out), *flags])[0] == 0
    assert len(read_results(out)) == 2
    assert len(backend.sent) == 4  # first run, nothing on the resume, everything again without resume


def test_normalize_input_reaches_rerank_queries_and_documents(tmp_path):
    body = {"query": "what\u200b  is  ＡＢＣ?", "documents": ["a\u200bb  c", {"text": "ｄ  e"}]}
    rows = [{"custom_id": "r", "method": "POST", "url": "/v1/rerank", "body": body}]
    backend = CannedBackend(body={"results": [], "usage": {"total_tokens": 1}})
    run_canned(tmp_path, rows, backend, normalize_input=True)
    [(url, sent)] = backend.sent
    assert url == "/v1/rerank"
    assert sent["query"] == "what is ABC?"
    assert sent["documents"] == ["ab c", {"text": "d e"}]
