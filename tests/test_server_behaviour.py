"""What users of the server rely on beyond the happy path: errors, health, /config, /metrics, disconnects, SIGTERM.

Every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` JSON with the right status; no
user input yields a 500; the server keeps serving after each error; /health says when the engine is
loading or dead; the Prometheus metrics move by exactly what known requests did; a client that goes
away frees its sequence; SIGTERM drains in-flight requests and exits 0.

Most tests use the session's ``tiny_server`` (a random tiny Qwen3, max_model_len 1024, names "tiny" and
"tiny-alias"); servers with other settings are built here, in-process with ``RunningServer`` or as a
``qwenbatch serve`` subprocess where a signal or a hang must stay out of the test process. The model's
text is gibberish, so requests use ``ignore_eos`` and a fixed ``max_tokens`` to know their token counts.
Waits poll with a generous deadline (the machine may be busy); nothing asserts how long anything takes.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import qwenbatch
from qwenbatch.config import EngineConfig
from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.server.app import ServerSettings
from server_harness import RunningServer, free_port, record_priorities, serve_process, wait_for

MODEL = "tiny"
MAX_MODEL_LEN = 1024  # the tiny checkpoint's context length
ERROR_KEYS = {"message", "type", "param", "code"}
USER_KEY, ADMIN_KEY = "user-key", "admin-key"
USER, ADMIN = {"Authorization": f"Bearer {USER_KEY}"}, {"Authorization": f"Bearer {ADMIN_KEY}"}
BODY_LIMIT = 4096
WAIT_S = 30.0  # deadline for polls: generous, never an assertion about speed


# -- helpers ----------------------------------------------------------------------------------------


def completion(**fields) -> dict:
    """A small /v1/completions body (3 token ids in, exactly 3 tokens out) with ``fields`` on top."""
    return {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True, **fields}


def chat(**fields) -> dict:
    """A small /v1/chat/completions body with ``fields`` on top."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "ignore_eos": True,
        **fields,
    }


def post(
    url: str, path: str, body=None, *, raw: bytes | None = None, headers: dict | None = None, timeout: float = 60.0
) -> httpx.Response:
    """One POST on a fresh connection (after a 500 the server drops the connection, so none is reused)."""
    if raw is not None:
        headers = {"content-type": "application/json", **(headers or {})}
        return httpx.post(url + path, content=raw, headers=headers, timeout=timeout)
    return httpx.post(url + path, json=body, headers=headers, timeout=timeout)


def assert_error(response: httpx.Response, status: int) -> dict:
    """``response`` is an OpenAI-style error with ``status``; returns its ``error`` object."""
    assert response.status_code == status, f"expected {status}, got {response.status_code}: {response.text}"
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


def assert_serving(url: str, headers: dict | None = None) -> None:
    """The server still answers a plain completion in full (called after every error case)."""
    response = post(url, "/v1/completions", completion(), headers=headers)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def scrape(url: str, headers: dict | None = None) -> dict[str, float]:
    """Every /metrics sample by name without the ``qwenbatch:`` prefix and the model_name label,
    e.g. ``generation_tokens_total`` or ``request_success_total{finished_reason="abort"}``."""
    response = httpx.get(url + "/metrics", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            name = sample.name.removeprefix("qwenbatch:")
            samples[f"{name}{{{labels}}}" if labels else name] = sample.value
    return samples


def idle(url: str) -> dict[str, float] | None:
    """The metrics once nothing runs or waits and the KV cache is empty, else None."""
    m = scrape(url)
    quiet = m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 and m["kv_cache_usage_perc"] == 0
    return m if quiet else None


def metrics_when(url: str, condition: Callable[[dict[str, float]], bool], what: str) -> dict[str, float]:
    """The first /metrics snapshot for which ``condition`` holds."""

    def check() -> dict[str, float] | None:
        m = scrape(url)
        return m if condition(m) else None

    return wait_for(check, what)


def wait_idle(url: str) -> dict[str, float]:
    return wait_for(lambda: idle(url), "no running or waiting sequences and an empty KV cache")


def data_events(response: httpx.Response) -> Iterator[str]:
    """The payloads of a server-sent event stream's ``data:`` lines."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def token_ids(n: int, seed: int, vocab: int = 400) -> list[int]:
    """``n`` prompt token ids, the same for the same seed (distinct seeds keep the prefix cache out of it)."""
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def engine_config(model: Path, **fields) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", kv_cache_memory=2**24, **fields)


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(tiny_server) -> str:
    return tiny_server.url


@pytest.fixture(scope="module")
def vocab_size(tiny_server) -> int:
    return tiny_server.engine.model_config.vocab_size


@pytest.fixture(scope="module")
def guarded(tiny_qwen3):
    """A server with an API key, an admin key and a 4096-byte body limit."""
    settings = ServerSettings(
        served_model_names=[MODEL], api_keys=[USER_KEY], admin_api_key=ADMIN_KEY, max_body_bytes=BODY_LIMIT
    )
    with RunningServer(settings, engine_config(tiny_qwen3)) as server:
        yield server


@pytest.fixture(scope="module")
def one_seat(tiny_qwen3):
    """A server that runs one sequence at a time and lets one more wait."""
    settings = ServerSettings(served_model_names=[MODEL], max_waiting_seqs=1)
    with RunningServer(settings, engine_config(tiny_qwen3, max_num_seqs=1)) as server:
        yield server


def failing_to_load() -> LLMEngine:
    raise RuntimeError("the weights are corrupt")


@pytest.fixture(scope="module")
def dead_on_arrival(tiny_qwen3):
    """A server whose engine failed to load."""
    settings = ServerSettings(served_model_names=[MODEL])
    with RunningServer(settings, engine_config(tiny_qwen3), engine_factory=failing_to_load, wait_healthy=False) as srv:
        wait_for(lambda: srv.app.state.serving.engine.error is not None, "the engine to fail loading")
        yield srv


@pytest.fixture
def fresh_server(tiny_qwen3):
    """A server of its own, for requests that might kill its engine."""
    with RunningServer(ServerSettings(served_model_names=[MODEL]), engine_config(tiny_qwen3)) as server:
        yield server


# -- 1. errors: shapes and statuses ------------------------------------------------------------------


INVALID_VALUES = [
    ("/v1/completions", completion(top_p=3), "top_p"),
    ("/v1/completions", completion(stop=[f"stop{i}" for i in range(300)]), "stop"),
    ("/v1/completions", completion(stop_token_ids=list(range(300))), "stop_token_ids"),
    ("/v1/completions", completion(repetition_penalty=1e300), "repetition_penalty"),
    ("/v1/completions", completion(temperature=-1), "temperature"),
    ("/v1/completions", completion(temperature="hot"), "temperature"),
    ("/v1/completions", completion(n=0), "n"),
    ("/v1/completions", completion(max_tokens=0), "max_tokens"),
    ("/v1/completions", completion(top_k=-5), "top_k"),
    ("/v1/completions", completion(presence_penalty=3), "presence_penalty"),
    ("/v1/completions", completion(logprobs=21), "logprobs"),
    ("/v1/completions", completion(stop=[""]), "stop"),
    ("/v1/completions", completion(min_tokens=5), "min_tokens"),
    ("/v1/completions", completion(prompt=[]), "prompt"),
    ("/v1/completions", completion(prompt={"text": "hi"}), "prompt"),
    ("/v1/completions", completion(seed=2**64), "seed"),
    ("/v1/chat/completions", chat(messages=[]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
    ("/v1/chat/completions", chat(temperature="hot"), "temperature"),
    ("/v1/chat/completions", chat(top_p=3), "top_p"),
    ("/v1/chat/completions", chat(max_tokens=0), "max_tokens"),
    ("/v1/chat/completions", chat(top_logprobs=21, logprobs=True), "top_logprobs"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), INVALID_VALUES, ids=[f"{p.split('/')[-1]}-{q}" for p, _, q in INVALID_VALUES]
)
def test_invalid_value_is_400_naming_the_field(url, path, body, param):
    error = assert_error(post(url, path, body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert_serving(url)


def test_malformed_json_is_400_without_a_field(url):
    error = assert_error(post(url, "/v1/completions", raw=b'{"model": "tiny", "prompt": '), 400)
    assert "JSON" in error["message"], error
    assert error["param"] is None, f"a JSON syntax error names no field, got param={error['param']!r}"
    assert_serving(url)


def test_prompt_longer_than_max_model_len_is_400_naming_the_numbers(url):
    error = assert_error(post(url, "/v1/completions", completion(prompt=[7] * 1100)), 400)
    assert error["param"] == "prompt"
    assert "1100" in error["message"] and str(MAX_MODEL_LEN) in error["message"], error
    assert_serving(url)


def test_prompt_plus_max_tokens_over_max_model_len_is_400(url):
    error = assert_error(post(url, "/v1/completions", completion(prompt=[7] * 1000, max_tokens=100)), 400)
    assert error["param"] == "prompt"
    for number in ("1000", "100", str(MAX_MODEL_LEN)):
        assert number in error["message"], error
    assert_serving(url)


@pytest.mark.parametrize("where", ["vocab", "negative"])
def test_token_id_out_of_vocab_is_400(url, vocab_size, where):
    bad = vocab_size if where == "vocab" else -1
    error = assert_error(post(url, "/v1/completions", completion(prompt=[5, bad, 6])), 400)
    assert error["param"] == "prompt"
    assert str(vocab_size) in error["message"], error
    assert_serving(url)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_ignored(url, path):
    body = (completion if path == "/v1/completions" else chat)(use_beam_search=False, best_of=1, nonsense={"a": [1]})
    response = post(url, path, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404_but_every_served_name_works(url, path):
    make = completion if path == "/v1/completions" else chat
    error = assert_error(post(url, path, make(model="gpt-17")), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert "gpt-17" in error["message"]
    for name in ("tiny", "tiny-alias"):
        assert post(url, path, make(model=name)).status_code == 200
    assert_serving(url)


def test_unknown_route_is_404_and_wrong_method_405(url):
    error = assert_error(httpx.get(url + "/v1/nothing-here"), 404)
    assert error["type"] == "not_found_error"
    assert_error(post(url, "/v1/nothing-here", {}), 404)
    assert_error(httpx.get(url + "/v1/completions"), 405)
    assert_serving(url)


ODD_BODIES = [
    b"",
    b"null",
    b"[]",
    b"[1, 2, 3]",
    b'"a string"',
    b"42",
    b"1e999",
    b"{}",
    b"\xff\xfe not utf-8",
    b"[" * 50_000 + b"]" * 50_000,
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": null, "prompt": null, "messages": null}',
    b'{"prompt": [[1, [2]], {"x": {"y": [null]}}], "messages": [[[]]]}',
    b'{"prompt": [1, 2.5], "messages": [{"role": "user", "content": [{"type": "image", "url": 1}]}]}',
    b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 400 + b"}",
    b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "temperature": 1' + b"0" * 400 + b"}",
    b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "n": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_p": NaN}',
    b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": Infinity}',
    b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream_options": [1]}',
    b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": {"a": 1}}',
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", ODD_BODIES, ids=range(len(ODD_BODIES)))
def test_odd_bodies_never_yield_a_server_error(url, path, raw):
    response = post(url, path, raw=raw)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    assert_serving(url)


SURROGATE = "\\ud800"  # a lone UTF-16 surrogate: valid JSON, but no Unicode text can hold it
SURROGATE_BODIES = [
    ("/v1/completions", '{"model": "tiny", "prompt": "a%sb", "max_tokens": 2}'),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "%s"], "max_tokens": 2}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "%s", "max_tokens": 2, "stream": true}'),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 2}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "a%s", "max_tokens": 2, "truncate_prompt_tokens": 4}'),
    ("/v1/rerank", '{"model": "tiny", "query": "q", "documents": ["d"], "instruction": "%s"}'),
    ("/v1/score", '{"model": "tiny", "text_1": "q", "text_2": ["%s"]}'),
]
SURROGATE_FIELDS = ["prompt", "prompt", "prompt", "messages", "prompt", "instruction", "text_2"]


@pytest.mark.parametrize(
    ("path", "template", "field"),
    [(*body, field) for body, field in zip(SURROGATE_BODIES, SURROGATE_FIELDS, strict=True)],
    ids=["text", "list", "stream", "chat", "truncated", "rerank-instruction", "score-text"],
)
def test_lone_surrogate_in_text_is_400_naming_its_field(url, path, template, field):
    response = post(url, path, raw=(template % SURROGATE).encode())
    error = assert_error(response, 400)
    assert error["param"] == field, error
    assert_serving(url)


# Values that pass validation, then fail on the engine thread (killing it for everyone) unless rejected or clamped.
ENGINE_KILLERS = {
    "top_k-beyond-int64": completion(top_k=2**64, temperature=1.0),
    "stop_token_id-beyond-vocab-with-min_tokens": completion(min_tokens=2, stop_token_ids=[99_999]),
}


@pytest.mark.parametrize("body", ENGINE_KILLERS.values(), ids=ENGINE_KILLERS.keys())
def test_a_request_cannot_kill_the_engine(fresh_server, body):
    url = fresh_server.url
    response = post(url, "/v1/completions", body)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert_error(response, 400)
    health = httpx.get(url + "/health")
    assert health.status_code == 200, f"the engine died on one request's sampling values: {health.text}"
    assert_serving(url)


def test_huge_n_is_rejected_at_once(tiny_qwen3, tmp_path):
    """n=1e30 must be a 400, not a loop on the event loop creating sequences until memory runs out."""
    with serve_process(tiny_qwen3, tmp_path / "serve.log") as (_, url):
        try:
            response = post(url, "/v1/completions", completion(n=10**30), timeout=5)
        except httpx.ReadTimeout:
            pytest.fail("the server hung on a request with n=10**30 (the event loop is creating sequences)")
        error = assert_error(response, 400)
        assert error["param"] == "n", error
        assert_serving(url)


# -- 1b. auth, body limit, queue bound ---------------------------------------------------------------


PROTECTED = [
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("GET", "/metrics"),
    ("GET", "/config"),
    ("GET", "/version"),
]
BAD_KEYS = {"none": {}, "wrong": {"Authorization": "Bearer nope"}, "not-bearer": {"Authorization": f"Basic {USER_KEY}"}}


@pytest.mark.parametrize(("method", "path"), PROTECTED, ids=[p for _, p in PROTECTED])
@pytest.mark.parametrize("headers", BAD_KEYS.values(), ids=BAD_KEYS.keys())
def test_missing_or_wrong_api_key_is_401(guarded, method, path, headers):
    response = httpx.request(method, guarded.url + path, json=chat() if method == "POST" else None, headers=headers)
    error = assert_error(response, 401)
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key", error
    assert response.headers["www-authenticate"] == "Bearer"
    assert_serving(guarded.url, USER)


@pytest.mark.parametrize("headers", [USER, ADMIN], ids=["user-key", "admin-key"])
def test_the_right_api_key_works_everywhere(guarded, headers):
    for method, path in PROTECTED:
        response = httpx.request(method, guarded.url + path, json=chat() if method == "POST" else None, headers=headers)
        assert response.status_code == 200, (path, response.text)
    assert_serving(guarded.url, headers)


def test_health_needs_no_api_key(guarded):
    response = httpx.get(guarded.url + "/health")
    assert response.status_code == 200
    assert response.json() == {"status": "healthy"}


def test_body_over_the_limit_with_content_length_is_413(guarded):
    body = json.dumps(completion(user="x" * BODY_LIMIT)).encode()
    response = httpx.post(
        guarded.url + "/v1/completions", content=body, headers={**USER, "content-type": "application/json"}
    )
    error = assert_error(response, 413)
    assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"], error
    assert_serving(guarded.url, USER)


def test_chunked_body_over_the_limit_is_413(guarded):
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    with httpx.Client(timeout=60) as client:
        request = client.build_request(
            "POST",
            guarded.url + "/v1/completions",
            content=chunks(),
            headers={**USER, "content-type": "application/json"},
        )
        assert "content-length" not in request.headers and request.headers["transfer-encoding"] == "chunked"
        error = assert_error(client.send(request), 413)
    assert error["code"] == "request_too_large", error
    assert_serving(guarded.url, USER)


def test_body_just_under_the_limit_is_served(guarded):
    body = completion(user="x" * (BODY_LIMIT - 200))
    assert len(json.dumps(body)) < BODY_LIMIT
    response = post(guarded.url, "/v1/completions", body, headers=USER)
    assert response.status_code == 200, response.text


def test_full_waiting_queue_is_503_with_retry_after(one_seat):
    url = one_seat.url
    waiting: dict[str, httpx.Response] = {}
    with httpx.stream(
        "POST", url + "/v1/completions", json=completion(max_tokens=1000, stream=True), timeout=60
    ) as running:
        assert running.status_code == 200
        events = data_events(running)  # kept: dropping a half-read iterator closes the connection
        next(events)  # it runs: its first token is out
        thread = threading.Thread(target=lambda: waiting.update(r=post(url, "/v1/completions", completion())))
        thread.start()
        wait_for(lambda: scrape(url)["num_requests_waiting"] == 1, "the second request to wait")
        for path, body in (("/v1/completions", completion()), ("/v1/chat/completions", chat())):
            response = post(url, path, body)
            error = assert_error(response, 503)
            assert response.headers["retry-after"].isdigit(), response.headers
            assert error["type"] == "service_unavailable" and error["code"] == "unavailable", error
        # Counting tokens queues nothing: it is answered while generation is turned away.
        assert post(url, "/tokenize", {"model": MODEL, "prompt": "hi"}).json()["count"] > 0
    # Closing the running stream aborts it; the waiting request runs and completes.
    thread.join(WAIT_S)
    assert waiting["r"].status_code == 200, waiting["r"].text
    assert_serving(url)


# -- 2. /health: loading, ready, dead ----------------------------------------------------------------


def test_version_names_the_package(url):
    assert httpx.get(url + "/version").json() == {"version": qwenbatch.__version__}


def test_health_is_200_healthy(url):
    response = httpx.get(url + "/health")
    assert response.status_code == 200
    assert response.json() == {"status": "healthy"}


def test_health_and_requests_are_503_while_loading_then_200(tiny_qwen3):
    release = threading.Event()
    config = engine_config(tiny_qwen3)

    def slow_load() -> LLMEngine:
        release.wait(120)
        return LLMEngine(config)

    settings = ServerSettings(served_model_names=[MODEL])
    with RunningServer(settings, config, engine_factory=slow_load, wait_healthy=False) as server:
        try:
            health = httpx.get(server.url + "/health")
            assert health.status_code == 503 and health.json() == {"status": "loading"}, health.text
            assert health.headers["retry-after"].isdigit()
            for path, body in (("/v1/completions", completion()), ("/v1/chat/completions", chat())):
                response = post(server.url, path, body)
                error = assert_error(response, 503)
                assert "loading" in error["message"] and response.headers["retry-after"].isdigit(), error
            assert_error(httpx.get(server.url + "/config"), 503)
        finally:
            release.set()
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, "/health to turn 200")
        assert httpx.get(server.url + "/health").json() == {"status": "healthy"}
        assert_serving(server.url)


def test_health_and_requests_are_503_when_the_engine_failed_to_load(dead_on_arrival):
    url = dead_on_arrival.url
    health = httpx.get(url + "/health")
    assert health.status_code == 503, health.text
    assert health.json()["status"] == "dead" and "corrupt" in health.json()["error"], health.text
    for path, body in (
        ("/v1/completions", completion()),
        ("/v1/completions", completion(stream=True)),
        ("/v1/chat/completions", chat()),
    ):
        response = post(url, path, body)
        error = assert_error(response, 503)
        assert response.headers["retry-after"].isdigit()
        assert "corrupt" in error["message"], error


def test_config_of_a_dead_engine_does_not_say_it_is_loading(dead_on_arrival):
    error = assert_error(httpx.get(dead_on_arrival.url + "/config"), 503)
    assert "loading" not in error["message"], f"the engine died, yet /config says: {error['message']!r}"


def test_engine_dying_mid_request_gives_503_not_500(tiny_qwen3):
    config = engine_config(tiny_qwen3)
    explode = threading.Event()

    def fragile() -> LLMEngine:
        engine = LLMEngine(config)
        real_step = engine.step

        def step():
            if explode.is_set():
                raise RuntimeError("simulated device failure")
            return real_step()

        engine.step = step
        return engine

    blocking: dict[str, httpx.Response] = {}
    with RunningServer(ServerSettings(served_model_names=[MODEL]), config, engine_factory=fragile) as server:
        url = server.url
        with httpx.stream(
            "POST", url + "/v1/completions", json=completion(max_tokens=1000, stream=True), timeout=60
        ) as r:
            events = data_events(r)
            next(events)
            body = completion(max_tokens=1000)
            thread = threading.Thread(target=lambda: blocking.update(r=post(url, "/v1/completions", body)))
            thread.start()
            wait_for(lambda: scrape(url)["num_requests_running"] == 2, "both requests to run")
            explode.set()
            rest = list(events)
        thread.join(WAIT_S)
        # The stream (its 200 already sent) ends with an error event, then [DONE].
        assert rest[-1] == "[DONE]", rest[-3:]
        error = json.loads(rest[-2])["error"]
        assert error["type"] == "service_unavailable" and "simulated device failure" in error["message"], error
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "dead", health.text
        assert_error(post(url, "/v1/completions", completion()), 503)
        assert_error(post(url, "/v1/chat/completions", chat()), 503)
        # The non-streaming request that was in flight.
        assert_error(blocking["r"], 503)


# -- 3. /config --------------------------------------------------------------------------------------


def test_get_config_reports_the_engine_settings(guarded, tiny_qwen3):
    response = httpx.get(guarded.url + "/config", headers=USER)
    assert response.status_code == 200, response.text
    config = response.json()
    bm = guarded.engine.block_manager
    expected = {
        "model": str(tiny_qwen3),
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": EngineConfig().resolved_max_num_seqs,  # this device's defaults: the fixture sets neither
        "max_num_batched_tokens": EngineConfig().resolved_max_num_batched_tokens,
        "block_size": 16,
        "num_kv_blocks": bm.num_blocks,
        "num_kv_tokens": bm.num_blocks * 16,
        "enable_prefix_caching": True,
        # What this machine chose at load, as the log says it.
        "linear_kernels": guarded.engine.runner.linear_kernels,
        "prefill_attention": guarded.engine.runner.prefill_attention,
        "decode_attention": guarded.engine.runner.decode_attention,
    }
    assert {k: config.get(k) for k in expected} == expected
    assert config["num_kv_blocks"] > 0
    assert config["linear_kernels"] and config["prefill_attention"] and config["decode_attention"]


LIMITS = ("max_num_seqs", "max_num_batched_tokens")


@contextmanager
def restored_limits(server: RunningServer) -> Iterator[None]:
    before = {k: httpx.get(server.url + "/config", headers=USER).json()[k] for k in LIMITS}
    try:
        yield
    finally:
        assert httpx.post(server.url + "/config", json=before, headers=ADMIN).status_code == 200


def test_post_config_changes_the_limits(guarded):
    with restored_limits(guarded):
        response = httpx.post(
            guarded.url + "/config", json={"max_num_seqs": 2, "max_num_batched_tokens": 64}, headers=ADMIN
        )
        assert response.status_code == 200, response.text
        assert (response.json()["max_num_seqs"], response.json()["max_num_batched_tokens"]) == (2, 64)
        shown = httpx.get(guarded.url + "/config", headers=USER).json()
        assert (shown["max_num_seqs"], shown["max_num_batched_tokens"]) == (2, 64)
        assert_serving(guarded.url, USER)
        assert guarded.engine.scheduler.max_num_seqs == 2
        assert guarded.engine.scheduler.max_num_batched_tokens == 64
        # Only one limit: the other stays.
        assert (
            httpx.post(guarded.url + "/config", json={"max_num_seqs": 3}, headers=ADMIN).json()[
                "max_num_batched_tokens"
            ]
            == 64
        )


@pytest.mark.parametrize(
    ("update", "param"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": -4}, "max_num_seqs"),
        ({"max_num_seqs": 1.5}, "max_num_seqs"),
        ({"max_num_batched_tokens": "many"}, "max_num_batched_tokens"),
        ({"block_size": 32}, "block_size"),
        ({"max_num_seqs": 2, "surprise": True}, "surprise"),
    ],
)
def test_post_config_rejects_invalid_updates(guarded, update, param):
    before = httpx.get(guarded.url + "/config", headers=USER).json()
    error = assert_error(httpx.post(guarded.url + "/config", json=update, headers=ADMIN), 400)
    assert error["param"] == param, error
    after = httpx.get(guarded.url + "/config", headers=USER).json()
    assert {k: after[k] for k in LIMITS} == {k: before[k] for k in LIMITS}
    assert_serving(guarded.url, USER)


def test_post_config_needs_the_admin_key(guarded):
    update = {"max_num_seqs": 7}
    with restored_limits(guarded):
        assert_error(httpx.post(guarded.url + "/config", json=update), 401)
        assert_error(httpx.post(guarded.url + "/config", json=update, headers={"Authorization": "Bearer nope"}), 401)
        error = assert_error(httpx.post(guarded.url + "/config", json=update, headers=USER), 403)
        assert error["type"] == "permission_error", error
        assert httpx.get(guarded.url + "/config", headers=USER).json()["max_num_seqs"] != 7
        response = httpx.post(guarded.url + "/config", json=update, headers=ADMIN)
        assert response.status_code == 200 and response.json()["max_num_seqs"] == 7, response.text


# -- 4. /metrics -------------------------------------------------------------------------------------

COUNTERS = [
    "prompt_tokens_total",
    "generation_tokens_total",
    "num_preemptions_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
]
GAUGES = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "avg_prompt_throughput_toks_per_s",
    "avg_generation_throughput_toks_per_s",
    "kv_cache_bytes",
    "process_resident_memory_bytes",
]
HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
]
REASONS = ("stop", "length", "abort", "error")


def test_metrics_parse_and_every_series_is_there(url):
    response = httpx.get(url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name.removeprefix("qwenbatch:"): f for f in text_string_to_metric_families(response.text)}
    for name in GAUGES:
        assert families[name].type == "gauge", name
    for name in COUNTERS:
        assert families[name.removesuffix("_total")].type == "counter", name
    assert families["request_success"].type == "counter"
    for name in HISTOGRAMS:
        assert families[name].type == "histogram", name
    for family in families.values():
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL, sample
    m = scrape(url)
    for name in [*COUNTERS, *GAUGES, *(f"{h}_{part}" for h in HISTOGRAMS for part in ("count", "sum"))]:
        assert name in m, name
    for reason in REASONS:
        assert f'request_success_total{{finished_reason="{reason}"}}' in m
    assert m["process_resident_memory_bytes"] > 2**20 and m["kv_cache_bytes"] > 0  # known from the start


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after[name] - before[name]


def test_metrics_count_exactly_what_known_requests_did(url):
    before = wait_idle(url)
    lengths = [3, 7, 11]  # under one 16-token block each, so the prefix cache cannot skip any prompt token
    for i, n in enumerate(lengths):
        response = post(url, "/v1/completions", completion(prompt=token_ids(n, seed=100 + i), max_tokens=5))
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
    # The response can overtake the stats of the step that made it; wait for the last thing recorded.
    after = wait_for(
        lambda: (
            (m := scrape(url))["request_generation_tokens_count"] - before["request_generation_tokens_count"] >= 3 and m
        ),
        "the three requests' stats",
    )
    assert delta(before, after, "generation_tokens_total") == 15
    assert delta(before, after, "prompt_tokens_total") == sum(lengths)
    assert delta(before, after, 'request_success_total{finished_reason="length"}') == 3
    for reason in ("stop", "abort", "error"):
        assert delta(before, after, f'request_success_total{{finished_reason="{reason}"}}') == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(before, after, f"{name}_count") == 3, name
        assert delta(before, after, f"{name}_sum") >= 0, name
    assert delta(before, after, "request_prompt_tokens_count") == 3
    assert delta(before, after, "request_prompt_tokens_sum") == sum(lengths)
    assert delta(before, after, "request_generation_tokens_sum") == 15
    assert delta(before, after, "inter_token_latency_seconds_count") == 3 * (5 - 1)
    # Computed tokens: each prompt once, then the 4 tokens after each request's first.
    assert delta(before, after, "iteration_tokens_total_sum") == sum(lengths) + 3 * 4
    assert delta(before, after, "num_preemptions_total") == 0
    assert after["avg_generation_throughput_toks_per_s"] > 0
    assert after["avg_prompt_throughput_toks_per_s"] > 0
    final = wait_idle(url)
    assert final["num_requests_running"] == 0 and final["num_requests_waiting"] == 0
    assert final["kv_cache_usage_perc"] == 0


def test_metrics_count_prefix_cache_hits(url):
    prompt = token_ids(64, seed=7)  # four full blocks
    before = wait_idle(url)
    for _ in range(2):
        assert post(url, "/v1/completions", completion(prompt=prompt, max_tokens=2)).status_code == 200
    count = "request_generation_tokens_count"
    after = metrics_when(url, lambda m: m[count] - before[count] >= 2, "both requests' stats")
    hits = delta(before, after, "prefix_cache_hits_total")
    queries = delta(before, after, "prefix_cache_queries_total")
    assert 3 * 16 <= hits <= 64, (hits, queries)  # the second request reuses at least three blocks
    assert queries >= 2 * 64
    assert delta(before, after, "prompt_tokens_total") == 2 * 64  # cached or not, they are prompt tokens
    wait_idle(url)


# -- 5. client disconnects abort -------------------------------------------------------------------


ABORTS = 'request_success_total{finished_reason="abort"}'


def aborted_since(url: str, before: dict[str, float]) -> dict[str, float] | None:
    """The metrics once one more request was aborted and nothing runs any more, else None."""
    m = idle(url)
    return m if m is not None and m[ABORTS] > before[ABORTS] else None


def test_closing_a_stream_aborts_its_request(url):
    before = wait_idle(url)
    with httpx.stream(
        "POST", url + "/v1/completions", json=completion(max_tokens=500, stream=True), timeout=60
    ) as response:
        assert response.status_code == 200
        events = data_events(response)
        for _ in range(2):
            assert json.loads(next(events))["choices"]
    after = wait_for(lambda: aborted_since(url, before), "the abort to be recorded and the KV cache freed")
    assert delta(before, after, ABORTS) == 1
    assert delta(before, after, 'request_success_total{finished_reason="length"}') == 0
    assert delta(before, after, "generation_tokens_total") < 250, "the request went on after the client left"
    assert_serving(url)


def test_a_client_timing_out_aborts_its_request(url):
    before = wait_idle(url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=completion(max_tokens=MAX_MODEL_LEN - 3), timeout=0.5)
    after = wait_for(lambda: aborted_since(url, before), "the abort to be recorded and the KV cache freed")
    assert delta(before, after, ABORTS) == 1
    # Stopped before its end (how far it got in the 0.5 s depends on the machine: 562 of 1,021 tokens here).
    assert delta(before, after, "generation_tokens_total") < MAX_MODEL_LEN - 3
    assert_serving(url)


# -- 6. qwenbatch serve: SIGTERM drains; a bad model fails in one line -------------------------------

DRAIN_TOKENS = 300


def test_sigterm_lets_the_in_flight_stream_finish_then_exits_0(tiny_qwen3, tmp_path):
    log = tmp_path / "serve.log"
    with serve_process(tiny_qwen3, log, "--shutdown-timeout", "120") as (proc, url):
        started = threading.Event()
        seen: dict = {"finish": None, "usage": None, "done": False}

        def stream() -> None:
            body = completion(max_tokens=DRAIN_TOKENS, stream=True, stream_options={"include_usage": True})
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for data in data_events(response):
                    started.set()
                    if data == "[DONE]":
                        seen["done"] = True
                        continue
                    chunk = json.loads(data)
                    seen["usage"] = chunk.get("usage") or seen["usage"]
                    for choice in chunk["choices"]:
                        seen["finish"] = choice.get("finish_reason") or seen["finish"]

        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(60), "no first chunk"
        proc.send_signal(signal.SIGTERM)
        assert not seen["done"]  # the signal came with the stream in flight (299 tokens to go)

        def refused() -> bool:
            try:
                httpx.get(url + "/health", timeout=5)
            except httpx.ConnectError:
                return True
            except httpx.TransportError:
                pass
            return False

        wait_for(refused, "new connections to be refused after SIGTERM")
        thread.join(180)
        assert not thread.is_alive()
        assert seen["done"], "the stream was cut before [DONE]"
        assert seen["finish"] == "length"
        assert seen["usage"]["completion_tokens"] == DRAIN_TOKENS
        assert proc.wait(60) == 0, log.read_text()


def test_serve_with_a_missing_model_fails_with_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    port = str(free_port())
    cmd = [sys.executable, "-m", "qwenbatch.cli", "serve", "--model", str(missing), "--port", port]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode != 0, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("qwenbatch: error: ")]
    assert len(errors) == 1 and str(missing) in errors[0], result.stderr
    assert "Traceback" not in result.stderr, f"a missing model should not print a traceback:\n{result.stderr}"


# -- hardening: keys, priority, /config bounds, /health -------------------------------------------


def test_a_better_than_default_priority_is_the_admins_alone(guarded, monkeypatch):
    seen = record_priorities(monkeypatch, guarded.engine.inputs)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True, "priority": -(2**31)}
    for headers in (USER, ADMIN):
        response = httpx.post(guarded.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
    assert seen == [0, -(2**31)]  # the user's jump is clamped to the default; the admin's stands


def test_duplicate_authorization_headers_are_400(guarded):
    # httpx would join repeated headers; a raw request sends two lines, as a proxy might.
    import socket

    host, port = guarded.url.removeprefix("http://").split(":")
    raw = (
        f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {USER_KEY}\r\n"
        f"Authorization: Bearer {ADMIN_KEY}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(raw)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"duplicate_authorization" in reply


def test_a_server_with_only_an_admin_key_requires_it_everywhere(tiny_qwen3):
    settings = ServerSettings(served_model_names=[MODEL], admin_api_key=ADMIN_KEY)
    with RunningServer(settings, engine_config(tiny_qwen3)) as server:
        assert_error(httpx.get(server.url + "/v1/models"), 401)
        assert_error(httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}), 401)
        assert httpx.get(server.url + "/v1/models", headers=ADMIN).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("value", [2**64, 10**7])
def test_post_config_refuses_limits_no_engine_could_use(guarded, value):
    with restored_limits(guarded):
        error = assert_error(httpx.post(guarded.url + "/config", json={"max_num_seqs": value}, headers=ADMIN), 400)
        assert error["param"] == "max_num_seqs", error
        response = httpx.get(guarded.url + "/config", headers=USER)
        assert response.status_code == 200 and response.json()["max_num_seqs"] < value


def test_health_tells_the_engines_error_to_authenticated_callers_only(tiny_qwen3):
    settings = ServerSettings(served_model_names=[MODEL], api_keys=[USER_KEY])
    with RunningServer(settings, engine_config(tiny_qwen3), engine_factory=failing_to_load, wait_healthy=False) as srv:
        wait_for(lambda: srv.app.state.serving.engine.error is not None, "the engine to fail loading")
        anonymous = httpx.get(srv.url + "/health")
        assert anonymous.status_code == 503 and anonymous.json() == {"status": "dead"}, anonymous.text
        known = httpx.get(srv.url + "/health", headers=USER)
        assert known.status_code == 503 and "corrupt" in known.json()["error"], known.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_text_too_long_for_any_tokenization_is_refused_before_tokenizing(tiny_server, monkeypatch, path):
    tokenizer = tiny_server.engine.tokenizer
    calls = []
    for name in ("encode", "apply_chat_template"):
        original = getattr(tokenizer, name)
        monkeypatch.setattr(tokenizer, name, lambda *a, _o=original, **k: calls.append(1) or _o(*a, **k))
    text = "x" * (tiny_server.engine.max_model_len * 16 + 1)
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": text}]} if "chat" in path else {"prompt": text})
    error = assert_error(httpx.post(tiny_server.url + path, json=body, timeout=60), 400)
    assert error["param"] == ("messages" if "chat" in path else "prompt") and "bytes" in error["message"], error
    assert calls == []
    assert_serving(tiny_server.url)


def test_a_request_is_admitted_by_all_its_sequences_not_one(tiny_qwen3):
    settings = ServerSettings(served_model_names=[MODEL], max_waiting_seqs=8)
    with RunningServer(settings, engine_config(tiny_qwen3)) as server:
        prompts = [[5, 6, 7]] * 3
        body = {"model": MODEL, "prompt": prompts, "n": 3, "max_tokens": 2, "ignore_eos": True}  # 9 sequences
        error = assert_error(httpx.post(server.url + "/v1/completions", json=body, timeout=60), 400)
        assert error["param"] == "prompt" and "9 sequences" in error["message"], error
        assert server.engine.num_unfinished_requests == 0  # nothing of it was queued
        response = httpx.post(server.url + "/v1/completions", json={**body, "n": 2}, timeout=60)  # 6 fit
        assert response.status_code == 200 and len(response.json()["choices"]) == 6, response.text


def test_concurrent_requests_cannot_together_pass_the_waiting_bound(tiny_qwen3, monkeypatch):
    settings = ServerSettings(served_model_names=[MODEL], max_waiting_seqs=8)
    with RunningServer(settings, engine_config(tiny_qwen3, max_num_seqs=1)) as server:
        # Two requests of 6 sequences each fit the empty queue alone; both are held mid-tokenizing until
        # both passed the first check, so only the step that queues them can see they do not fit together.
        both_tokenizing = threading.Barrier(2, timeout=30)
        make_request = server.engine.inputs.make_request

        def held(request_id, *args, **kwargs):
            if request_id.endswith("-0"):
                both_tokenizing.wait()
            return make_request(request_id, *args, **kwargs)

        monkeypatch.setattr(server.engine.inputs, "make_request", held)
        body = {"model": MODEL, "prompt": [[5, 6, 7]] * 6, "max_tokens": 32, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            posts = [pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60) for _ in "ab"]
            responses = [p.result() for p in posts]
        assert sorted(r.status_code for r in responses) == [200, 503], [r.text for r in responses]
        refused = next(r for r in responses if r.status_code == 503)
        assert refused.headers["retry-after"] and "retry later" in refused.json()["error"]["message"]
        assert len(next(r for r in responses if r.status_code == 200).json()["choices"]) == 6
        monkeypatch.undo()
        assert_serving(server.url)


def _raw_exchange(url: str, head: bytes, body: bytes, read_timeout: float = 10.0) -> tuple[bytes, float]:
    """Send ``head`` and then ``body`` over a raw connection, and stall; the reply and seconds until its
    first byte came."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as s:
        start, first = time.monotonic(), None
        s.sendall(head + body)
        reply = b""
        with suppress(TimeoutError):
            while chunk := s.recv(65536):
                first = first or time.monotonic()
                reply += chunk
        return reply, (first or time.monotonic()) - start


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/files"])
def test_a_trickling_body_is_408_after_the_request_timeout(tiny_qwen3, tmp_path, path):
    settings = ServerSettings(served_model_names=[MODEL], request_timeout_s=0.5, data_dir=tmp_path / "data")
    with RunningServer(settings, engine_config(tiny_qwen3)) as server:
        upload = path == "/v1/files"
        kind = "multipart/form-data; boundary=b0undary" if upload else "application/json"
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {kind}\r\nContent-Length: 100000\r\n\r\n"
        start = b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{"a'
        reply, waited = _raw_exchange(server.url, head.encode(), start if upload else b'{"model": "tin')
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"request_timeout" in reply and waited < 5
        assert_serving(server.url)


def _trickle_headers(url: str, pieces: list[bytes], gap_s: float) -> tuple[bytes, float]:
    """Send ``pieces`` ``gap_s`` apart over a raw connection (stopping if the server closes it); the reply
    and the seconds until the connection ended."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        start = time.monotonic()
        with suppress(OSError):
            for piece in pieces:
                s.sendall(piece)
                time.sleep(gap_s)
        reply = b""
        with suppress(OSError):
            while chunk := s.recv(65536):
                reply += chunk
        return reply, time.monotonic() - start


def test_headers_trickled_or_never_sent_are_408_after_the_request_timeout(tiny_qwen3, tmp_path):
    settings = ServerSettings(served_model_names=[MODEL], request_timeout_s=0.5, data_dir=tmp_path / "data")
    with RunningServer(settings, engine_config(tiny_qwen3)) as server:
        # One header line every 0.2 s, forever: without a deadline this holds its connection for 40 s.
        pieces = [b"GET /health HTTP/1.1\r\nHost: x\r\n"] + [b"X-Slow-%d: 1\r\n" % i for i in range(200)]
        reply, took = _trickle_headers(server.url, pieces, gap_s=0.2)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        assert took < 5
        reply, took = _trickle_headers(server.url, [], gap_s=0)  # connects and says nothing
        assert reply.startswith(b"HTTP/1.1 408") and took < 5
        assert_serving(server.url)


def test_the_header_deadline_spares_idle_keep_alive_connections_and_slow_answers(tiny_qwen3, tmp_path):
    settings = ServerSettings(served_model_names=[MODEL], request_timeout_s=0.3, data_dir=tmp_path / "data")
    with RunningServer(settings, engine_config(tiny_qwen3)) as server, httpx.Client(base_url=server.url) as client:
        import socket

        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:  # one connection, two requests
            for _ in range(2):
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 200"), "the kept-alive connection was not served"
                time.sleep(1.0)  # idle past the deadline, within uvicorn's 5 s keep-alive
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 64, "temperature": 0, "stream": True}
        start = time.monotonic()
        with client.stream("POST", "/v1/completions", json=body) as response:
            chunks = []
            for line in response.iter_lines():
                chunks.append(line)
                time.sleep(0.02)  # a slow reader: the answer takes longer than the deadline
        assert response.status_code == 200 and "data: [DONE]" in chunks
        assert time.monotonic() - start > 0.3
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize("client", ["httpx", "urllib"])
def test_a_body_far_over_the_limit_still_gets_its_413_read(guarded, client):
    import urllib.error
    import urllib.request

    body = json.dumps(completion(user="x" * (8 * 2**20))).encode()  # 8 MiB against a 4 KiB limit
    headers = {**USER, "content-type": "application/json"}
    if client == "httpx":
        response = httpx.post(guarded.url + "/v1/completions", content=body, headers=headers, timeout=60)
        status, payload = response.status_code, response.json()
    else:
        request = urllib.request.Request(guarded.url + "/v1/completions", data=body, headers=headers)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        status, payload = caught.value.code, json.loads(caught.value.read())
    assert status == 413 and payload["error"]["code"] == "request_too_large", payload
    assert_serving(guarded.url, USER)
