"""The OpenAI Batch API (/v1/batches) driven by the official openai SDK: results equal direct greedy
generation, validation errors in OpenAI's shape, cancel, per-key isolation, limits, listing, batch lines
below interactive requests in priority, and a SIGKILL mid-batch resumed exactly once on restart."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path

import openai
import pytest

from qwenbatch.batch_api.storage import BatchStore
from qwenbatch.config import EngineConfig
from qwenbatch.llm import LLM
from qwenbatch.sampling_params import SamplingParams
from qwenbatch.server.app import ServerSettings
from qwenbatch.server.guard import owner_id
from server_harness import RunningServer, record_priorities, serve_process, slow_steps, wait_for

MODEL = "tiny"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
KEY_A, KEY_B = "key-a", "key-b"
FINISHED = ("completed", "failed", "cancelled", "expired")


def chat_line(i: int, max_tokens: int = 8, url: str = CHAT) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {i}."}], "temperature": 0}
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": {**body, "max_tokens": max_tokens}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def run_to_end(client: openai.OpenAI, batch_id: str, timeout: float = 120):
    return wait_for(
        lambda: (b := client.batches.retrieve(batch_id)).status in FINISHED and b,
        f"batch {batch_id} to finish",
        timeout=timeout,
        interval=0.1,
    )


def submit(client: openai.OpenAI, lines: list[dict], endpoint: str = CHAT):
    upload = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")


def output_lines(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    """A server with two API keys, its files and batches in a fresh folder; max_num_seqs 4."""
    settings = ServerSettings(
        served_model_names=[MODEL],
        api_keys=[KEY_A, KEY_B],
        data_dir=tmp_path_factory.mktemp("batch-data"),
        max_batch_requests=64,
    )
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24, max_num_seqs=4)
    with RunningServer(settings, config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0)


@pytest.fixture(scope="module")
def other_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_B, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_qwen3) -> LLM:
    return LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24)


def test_a_chat_batch_runs_to_completion_with_the_greedy_answers(client, server, reference):
    lines = [chat_line(i) for i in range(10)]
    batch = submit(client, lines, CHAT)
    assert (batch.status, batch.endpoint, batch.completion_window) == ("validating", CHAT, "24h")
    assert batch.expires_at - batch.created_at == 24 * 3600
    done = run_to_end(client, batch.id)
    assert done.status == "completed", done.errors
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (10, 10, 0)
    assert done.error_file_id is None and done.in_progress_at and done.finalizing_at and done.completed_at
    results = output_lines(client, done.output_file_id)
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]  # input order
    expected = reference.chat(
        [line["body"]["messages"] for line in lines], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    for result, want in zip(results, expected, strict=True):
        assert result["error"] is None and result["response"]["status_code"] == 200
        body = result["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["content"] == want.outputs[0].text
        assert body["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)
    assert not (server.app.state.store.batches_dir / batch.id).exists()  # its working files are gone
    output_file = client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.bytes == len(
        client.files.content(output_file.id).content
    )


def test_completions_batch_and_per_line_errors_in_the_error_file(client, reference):
    lines = [
        {
            "custom_id": "ok",
            "method": "POST",
            "url": COMPLETIONS,
            "body": {"prompt": "def add(", "max_tokens": 6, "temperature": 0},
        },
        {"custom_id": "bad-model", "method": "POST", "url": COMPLETIONS, "body": {"model": "nope", "prompt": "x"}},
        {"custom_id": "bad-param", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "x", "top_p": 7}},
    ]
    done = run_to_end(client, submit(client, lines, COMPLETIONS).id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 2)
    [ok] = output_lines(client, done.output_file_id)
    want = reference.generate(["def add("], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert ok["custom_id"] == "ok" and ok["response"]["body"]["choices"][0]["text"] == want.outputs[0].text
    errors = {r["custom_id"]: r["response"] for r in output_lines(client, done.error_file_id)}
    assert errors["bad-model"]["status_code"] == 404 and errors["bad-param"]["status_code"] == 400
    assert errors["bad-param"]["body"]["error"]["param"] == "top_p"


@pytest.mark.parametrize(
    ("content", "code", "line", "param"),
    [
        (jsonl([chat_line(0)]) + b"{not json\n", "invalid_json", 2, None),
        (jsonl([chat_line(0), chat_line(1, url=COMPLETIONS)]), "invalid_url", 2, "url"),  # mixed endpoints
        (jsonl([chat_line(0, url="/v1/images/generations")]), "invalid_url", 1, "url"),  # an endpoint we do not serve
        (jsonl([chat_line(0), chat_line(0)]), "duplicate_custom_id", 2, "custom_id"),
        (b"\n\n", "empty_file", None, None),
    ],
)  # fmt: skip
def test_an_invalid_input_file_fails_validation_with_openai_shaped_errors(client, server, content, code, line, param):
    upload = client.files.create(file=("input.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    done = run_to_end(client, batch.id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert not (server.app.state.store.batches_dir / batch.id).exists()
    assert done.request_counts.completed == 0
    error = next(e for e in done.errors.data if e.code == code)
    assert (error.line, error.param) == (line, param) and error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"endpoint": "/v1/images/generations"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
def test_bad_batch_parameters_are_a_400_naming_them(client, fields, param):
    upload = client.files.create(file=("input.jsonl", jsonl([chat_line(0)])), purpose="batch")
    args = {"input_file_id": upload.id, "endpoint": CHAT, "completion_window": "24h", **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(**args)
    assert e.value.body["param"] == param


def test_a_batch_over_the_request_limit_is_refused_naming_the_limit(client):
    upload = client.files.create(file=("input.jsonl", jsonl([chat_line(i) for i in range(65)])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="limit per batch is 64"):
        client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-" + "0" * 24, endpoint=CHAT, completion_window="24h")


def test_metadata_comes_back_and_listing_pages_newest_first(client):
    ids = [
        client.batches.create(
            input_file_id=client.files.create(file=("in.jsonl", jsonl([chat_line(i, 1)])), purpose="batch").id,
            endpoint=CHAT,
            completion_window="24h",
            metadata={"job": f"j{i}"},
        ).id
        for i in range(3)
    ]
    for batch_id in ids:
        run_to_end(client, batch_id)
    assert client.batches.retrieve(ids[1]).metadata == {"job": "j1"}
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == ids[0]
    everything = [b.id for b in client.batches.list(limit=100).data]
    assert everything.index(ids[2]) < everything.index(ids[1]) < everything.index(ids[0])


def test_cancel_mid_run_stops_the_batch_and_keeps_what_is_done(client, server, monkeypatch):
    slow_steps(monkeypatch, server.engine, 0.01)  # 640+ steps: the cancel lands mid-run on any machine
    batch = submit(client, [chat_line(i, max_tokens=64) for i in range(40)])
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, "two lines done", 60)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = run_to_end(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert 2 <= done.request_counts.completed < 40
    results = output_lines(client, done.output_file_id)
    assert len(results) == done.request_counts.completed
    assert len({r["custom_id"] for r in results}) == len(results)
    wait_for(lambda: not server.engine.has_unfinished(), "the engine to drop the cancelled lines")
    finished = run_to_end(client, submit(client, [chat_line(0, 1)]).id)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(finished.id)


def test_each_api_key_sees_only_its_own_batches(client, other_client):
    batch = submit(client, [chat_line(0, 1)])
    with pytest.raises(openai.NotFoundError):
        other_client.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other_client.batches.cancel(batch.id)
    assert batch.id not in [b.id for b in other_client.batches.list(limit=100).data]
    done = run_to_end(client, batch.id)
    with pytest.raises(openai.NotFoundError):
        other_client.files.content(done.output_file_id)
    with pytest.raises(openai.NotFoundError):  # another key's file as the input of a batch
        other_client.batches.create(input_file_id=batch.input_file_id, endpoint=CHAT, completion_window="24h")


def test_batch_lines_run_below_interactive_requests(client, server, monkeypatch):
    seen = record_priorities(monkeypatch, server.engine.inputs)
    slow_steps(monkeypatch, server.engine, 0.01)  # the batch's 480+ steps take >= 4.8 s on any machine
    batch = submit(client, [chat_line(i, max_tokens=48) for i in range(40)])
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, "a line done", 60)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Now!"}], max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    # The interactive request was answered while most of the batch (4 seats, 40 lines) still waits.
    assert client.batches.retrieve(batch.id).request_counts.completed < 40
    assert 0 in seen and set(seen) - {0} == {1}  # batch lines at priority 1, the chat at 0
    client.batches.cancel(batch.id)
    run_to_end(client, batch.id)


def test_another_keys_small_batch_finishes_while_a_large_one_runs(client, other_client, server, monkeypatch):
    slow_steps(monkeypatch, server.engine, 0.01)  # the large batch's 512+ steps take >= 5 s on any machine
    large = submit(client, [chat_line(i, max_tokens=32) for i in range(64)])
    wait_for(lambda: client.batches.retrieve(large.id).request_counts.completed >= 1, "the large batch to run", 60)
    small = run_to_end(other_client, submit(other_client, [chat_line(i) for i in range(3)]).id)
    assert small.status == "completed" and small.request_counts.completed == 3
    # Side by side, not after it: the large batch (64 lines on 4 seats) is far from done.
    assert client.batches.retrieve(large.id).status == "in_progress"
    assert client.batches.retrieve(large.id).request_counts.completed < 60
    done = run_to_end(client, large.id)
    assert done.status == "completed" and done.request_counts.completed == 64
    assert server.app.state.batch_worker.fair_share.share() == server.app.state.batch_worker.capacity


# -- crash safety: a real `qwenbatch serve` killed with SIGKILL ------------------------------------


def _serve(tiny_qwen3: Path, data_dir: Path, log: Path):
    return serve_process(
        tiny_qwen3, log, "--data-dir", str(data_dir), "--api-key", KEY_A, "--max-num-seqs", "2",
        served_model_name=MODEL,
    )  # fmt: skip


def test_sigkill_mid_batch_then_restart_resumes_with_every_line_exactly_once(tiny_qwen3, tmp_path, reference):
    data_dir = tmp_path / "data"
    # Enough lines that the batch is still running at the kill, however fast the engine is: the kill follows the
    # third result line within a poll (request_counts are written once a second, by when the tiny model may be done).
    lines = [chat_line(i, max_tokens=24) for i in range(240)]
    with _serve(tiny_qwen3, data_dir, tmp_path / "first.log") as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0)
        batch = submit(client, lines)
        results_file = BatchStore(data_dir).batch_dir(batch.id) / "results.jsonl"
        wait_for(lambda: results_file.exists() and results_file.read_bytes().count(b"\n") >= 3, "three lines", 60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    store = BatchStore(data_dir)
    killed = store.get_batch(owner_id(KEY_A), batch.id)
    assert killed.status == "in_progress" and killed.request_counts.completed < len(lines)

    with _serve(tiny_qwen3, data_dir, tmp_path / "second.log") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0)
        done = run_to_end(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == len(lines)
        results = output_lines(client, done.output_file_id)
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]  # each exactly once
    expected = reference.chat(
        [line["body"]["messages"] for line in lines], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
    )
    for result, want in zip(results, expected, strict=True):
        assert result["response"]["body"]["choices"][0]["message"]["content"] == want.outputs[0].text


def test_a_cancel_taken_just_before_a_crash_is_honoured_after_the_restart(tiny_qwen3, tmp_path):
    num_lines = 300
    data_dir = tmp_path / "data"
    with _serve(tiny_qwen3, data_dir, tmp_path / "first.log") as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0)
        # Enough work that the batch is still running when the server is frozen, however fast the engine is.
        batch = submit(client, [chat_line(i, max_tokens=64) for i in range(num_lines)])
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, "two lines done", 60)
        # The server is frozen, takes a cancel (written to its store as its route would) and dies before
        # its worker sees it.
        proc.send_signal(signal.SIGSTOP)
        assert BatchStore(data_dir).request_cancel(owner_id(KEY_A), batch.id).status == "cancelling"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    with _serve(tiny_qwen3, data_dir, tmp_path / "second.log") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0)
        done = run_to_end(client, batch.id)
    assert done.status == "cancelled"
    assert 2 <= done.request_counts.completed < num_lines
    assert done.request_counts.completed + done.request_counts.failed <= num_lines


# -- the worker's backend: a busy server is waited for, never recorded as a failure --------------------


class _BusyServing:
    """A stand-in serving layer answering 503 ``busy_answers`` times, then 200, over an engine of the given health."""

    def __init__(self, busy_answers: int, healthy: bool) -> None:
        from types import SimpleNamespace

        self.engine = SimpleNamespace(is_healthy=healthy, state=SimpleNamespace(value="dead"))
        self.busy_answers = busy_answers
        self.priorities: list[int] = []

    async def call(self, url: str, body: dict, priority: int = 0) -> tuple[int, dict]:
        self.priorities.append(priority)
        if len(self.priorities) <= self.busy_answers:
            return 503, {"error": {"message": "queue full"}}
        return 200, {"ok": True}


def test_the_worker_retries_a_busy_answer_and_stops_when_the_engine_is_gone():
    import asyncio

    from qwenbatch.batch.backends import EngineUnavailable, ServingBackend
    from qwenbatch.engine.scheduler import BACKGROUND_PRIORITY

    def send(serving: _BusyServing, priority: int = 0) -> tuple[int, dict]:
        backend = ServingBackend(serving, capacity=1, priority_floor=BACKGROUND_PRIORITY)
        return asyncio.run(backend.send(CHAT, {"messages": [], "priority": priority}))

    serving = _BusyServing(busy_answers=2, healthy=True)
    assert send(serving) == (200, {"ok": True})
    assert serving.priorities == [BACKGROUND_PRIORITY] * 3  # batch lines never better than the floor
    serving = _BusyServing(busy_answers=0, healthy=True)
    send(serving, priority=BACKGROUND_PRIORITY + 3)
    assert serving.priorities == [BACKGROUND_PRIORITY + 3]  # a worse priority is kept
    serving = _BusyServing(busy_answers=5, healthy=False)
    with pytest.raises(EngineUnavailable, match="dead"):
        send(serving)
    assert len(serving.priorities) == 1


def test_the_worker_survives_a_locked_store_reports_it_and_then_finishes_the_batch(tiny_qwen3, tmp_path, monkeypatch):
    import sqlite3

    import httpx

    from qwenbatch.batch_api import worker as batch_worker

    locked = [True]
    unfinished = BatchStore.unfinished_batches

    def flaky(self, *args):
        if locked[0]:
            raise sqlite3.OperationalError("database is locked")
        return unfinished(self, *args)

    monkeypatch.setattr(BatchStore, "unfinished_batches", flaky)
    monkeypatch.setattr(batch_worker, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(batch_worker, "RETRY_MAX_S", 0.2)
    settings = ServerSettings(served_model_names=[MODEL], api_keys=[KEY_A], data_dir=tmp_path / "data")
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24, max_num_seqs=4)
    with RunningServer(settings, config) as srv:
        auth = {"Authorization": f"Bearer {KEY_A}"}
        health = wait_for(
            lambda: (h := httpx.get(srv.url + "/health", headers=auth).json()).get("batch_worker") and h,
            "the worker to report its error",
        )
        assert health["status"] == "healthy" and health["batch_worker"]["state"] == "retrying"
        assert "database is locked" in health["batch_worker"]["error"]
        assert "error" not in httpx.get(srv.url + "/health").json()["batch_worker"]  # not told to strangers
        assert 'batch_worker_up{model_name="tiny"} 0.0' in httpx.get(srv.url + "/metrics", headers=auth).text
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY_A, max_retries=0)
        batch = submit(client, [chat_line(i) for i in range(3)])
        locked[0] = False
        done = run_to_end(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 3
        assert "batch_worker" not in httpx.get(srv.url + "/health").json()


def test_the_engine_dying_mid_batch_loses_nothing_and_a_restart_finishes_it(tiny_qwen3, tmp_path, reference):
    import httpx

    settings = ServerSettings(served_model_names=[MODEL], api_keys=[KEY_A], data_dir=tmp_path / "data")
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24, max_num_seqs=4)
    lines = [chat_line(i, max_tokens=24) for i in range(30)]
    auth = {"Authorization": f"Bearer {KEY_A}"}
    with RunningServer(settings, config) as srv:
        # The engine breaks at its 100th step: by then the first lines are done (each needs ~25 steps)
        # and most are not (30 lines at 4 sequences a step need 180). Counting steps, not polling for
        # progress, keeps a slow machine from finishing the whole batch before the break.
        steps, real_step = [0], srv.engine.step

        def breaking_step():
            steps[0] += 1
            if steps[0] >= 100:
                raise RuntimeError("the engine broke")
            return real_step()

        srv.engine.step = breaking_step
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY_A, max_retries=0)
        batch = submit(client, lines)
        wait_for(lambda: srv.app.state.batch_worker.state == "stopped", "the worker to stop")
        health = httpx.get(srv.url + "/health", headers=auth)
        assert health.status_code == 503 and health.json() == {"status": "dead", "error": "the engine broke"}
        stopped = client.batches.retrieve(batch.id)
        assert stopped.status == "in_progress" and stopped.request_counts.failed == 0
        assert 0 < stopped.request_counts.completed < 30
    with RunningServer(settings, config) as srv:  # the same data dir: the batch resumes
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY_A, max_retries=0)
        done = run_to_end(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 30 and done.request_counts.failed == 0
        results = output_lines(client, done.output_file_id)
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]  # each once, in order
    expected = reference.chat(
        [line["body"]["messages"] for line in lines], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
    )
    for result, want in zip(results, expected, strict=True):
        assert result["response"]["body"]["choices"][0]["message"]["content"] == want.outputs[0].text


# -- finalizing survives crashes: a torn result log, a crash between a file and its id ---------------


def _result(i: int) -> dict:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"answer {i}"}}]}
    return {"id": f"r{i}", "custom_id": f"req-{i}", "response": {"status_code": 200, "body": body}, "error": None}


def _cancelling_batch_with_a_torn_log(store: BatchStore, lines: int = 4):
    """A cancelled-while-running batch as a crash leaves it: two answers logged, the third torn mid-write."""
    upload = store.create_file("o", "in.jsonl", "batch", io.BytesIO(jsonl([chat_line(i) for i in range(lines)])))
    batch = store.create_batch("o", CHAT, upload.id, "24h", None, None)
    folder = store.batch_dir(batch.id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "input.jsonl").write_bytes(jsonl([chat_line(i) for i in range(lines)]))
    log = b"".join(json.dumps(_result(i)).encode() + b"\n" for i in range(2))
    (folder / "results.jsonl").write_bytes(log + json.dumps(_result(2)).encode()[:25])
    store.update_batch(batch.id, status="cancelling")
    return store.get_batch("o", batch.id)


def test_a_torn_last_result_does_not_fail_a_cancelled_batch(tmp_path):
    from qwenbatch.batch_api.worker import BatchWorker

    store = BatchStore(tmp_path / "data")
    batch = _cancelling_batch_with_a_torn_log(store)
    BatchWorker(serving=None, store=store, capacity=1, max_line_bytes=2**20)._finalize(batch)
    done = store.get_batch("o", batch.id)
    assert done.status == "cancelled" and done.request_counts.completed == 2
    output = store.file_path("o", done.output_file_id).read_text().splitlines()
    assert [json.loads(line)["custom_id"] for line in output] == ["req-0", "req-1"]


def test_finalizing_again_after_a_crash_reuses_the_stored_output_file(tmp_path, monkeypatch):
    from qwenbatch.batch_api.worker import BatchWorker

    store = BatchStore(tmp_path / "data")
    batch = _cancelling_batch_with_a_torn_log(store)
    update = BatchStore.update_batch
    crashed = []

    def crash_before_naming_the_file(self, batch_id, **changes):
        if "output_file_id" in changes and not crashed:
            crashed.append(batch_id)
            raise OSError("the process died here")
        return update(self, batch_id, **changes)

    monkeypatch.setattr(BatchStore, "update_batch", crash_before_naming_the_file)
    worker = BatchWorker(serving=None, store=store, capacity=1, max_line_bytes=2**20)
    with pytest.raises(OSError):
        worker._finalize(batch)
    worker._finalize(store.get_batch("o", batch.id))
    done = store.get_batch("o", batch.id)
    assert done.status == "cancelled"
    outputs = store.list_files("o", purpose="batch_output")
    assert [f.id for f in outputs] == [done.output_file_id]  # one file, not a second copy


def test_a_full_disk_or_a_locked_database_is_openai_json_a_client_can_retry(server, client, monkeypatch):
    import errno
    import sqlite3

    import httpx

    kept = client.files.create(file=("kept.jsonl", jsonl([chat_line(0)])), purpose="batch")
    create = BatchStore.create_file
    failures = {"disk": OSError(errno.ENOSPC, "No space left on device"), "db": sqlite3.OperationalError("locked")}
    for kind, status in (("disk", 507), ("db", 503)):

        def failing(self, *args, _e=failures[kind], **kwargs):
            raise _e

        monkeypatch.setattr(BatchStore, "create_file", failing)
        response = httpx.post(
            server.url + "/v1/files",
            headers={"Authorization": f"Bearer {KEY_A}"},
            files={"file": ("x.jsonl", jsonl([chat_line(1)]))},
            data={"purpose": "batch"},
        )
        assert response.status_code == status, response.text
        assert response.headers["content-type"].startswith("application/json")
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert int(response.headers["retry-after"]) > 0
    monkeypatch.setattr(BatchStore, "create_file", create)
    assert kept.id in [f.id for f in client.files.list()]  # nothing stored was lost


def test_a_line_longer_than_the_body_limit_fails_validation_naming_it(tiny_qwen3, tmp_path):
    settings = ServerSettings(
        served_model_names=[MODEL], api_keys=[KEY_A], data_dir=tmp_path / "data", max_body_bytes=4096
    )
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24, max_num_seqs=4)
    with RunningServer(settings, config) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY_A, max_retries=0)
        huge = chat_line(1)
        huge["body"]["messages"][0]["content"] = "x" * 100_000
        done = run_to_end(client, submit(client, [chat_line(0), huge, chat_line(2)]).id)
    assert done.status == "failed"
    [error] = done.errors.data
    assert (error.code, error.line) == ("line_too_long", 2)


def test_bounded_lines_never_holds_more_than_the_bound_of_one_line():
    from qwenbatch.batch.jsonl import OverlongLine, bounded_lines

    sizes: list[int] = []

    class Recording(io.StringIO):
        def readline(self, size=-1):
            sizes.append(size)
            return super().readline(size)

    lines = list(bounded_lines(Recording("short\n" + "y" * 1000 + "\nlast"), max_chars=64))
    assert lines[0] == "short\n" and isinstance(lines[1], OverlongLine) and lines[2] == "last"
    assert sizes and all(0 < size <= 65 for size in sizes)
