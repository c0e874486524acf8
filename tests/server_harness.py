"""Servers for the tests: a real uvicorn server in a background thread, or `qwenbatch serve` in a subprocess."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from qwenbatch.config import EngineConfig
from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.server.app import ServerSettings, build_app
from qwenbatch.server.http_server import server_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """``with RunningServer(settings, config) as srv:`` -> ``srv.url`` ("http://127.0.0.1:PORT")."""

    def __init__(
        self,
        settings: ServerSettings,
        config: EngineConfig,
        engine_factory: Callable[[], LLMEngine] | None = None,
        wait_healthy: bool = True,
    ) -> None:
        self.app = build_app(settings, config, engine_factory)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            server_config(self.app, settings, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.wait_healthy = wait_healthy

    @property
    def engine(self) -> LLMEngine:
        return self.app.state.serving.engine.engine  # the engine thread's: tests only read or spy

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.server.started:
                if not self.wait_healthy:
                    return self
                try:
                    if httpx.get(self.url + "/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
            if not self.thread.is_alive():
                raise RuntimeError("the server thread died while starting")
            time.sleep(0.05)
        raise TimeoutError("the server did not become healthy in 120 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def wait_for(condition: Callable[[], object], what: str, timeout: float = 30.0, interval: float = 0.05):
    """Poll ``condition`` until it returns something truthy (returned); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@contextmanager
def serve_process(
    model: Path, log: Path, *flags: str, served_model_name: str = "tiny"
) -> Iterator[tuple[subprocess.Popen, str]]:
    """``qwenbatch serve`` in a subprocess, healthy; killed on the way out if it is still running."""
    port = free_port()
    cmd = [sys.executable, "-m", "qwenbatch.cli", "serve", "--model", str(model), "--dtype", "float32"]
    cmd += ["--kv-cache-memory", "16MiB", "--served-model-name", served_model_name, "--port", str(port), *flags]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as stderr:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
        try:

            def healthy() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"qwenbatch serve exited with {proc.returncode}:\n{log.read_text()}")
                try:
                    return httpx.get(url + "/health", timeout=5).status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(healthy, "qwenbatch serve to become healthy", timeout=120, interval=0.1)
            yield proc, url
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def record_priorities(monkeypatch, inputs) -> list[int]:
    """The priority of every request ``inputs`` (an engine's InputProcessor) makes from now on, in order."""
    seen: list[int] = []
    make_request = inputs.make_request

    def spy(*args, **kwargs):
        request = make_request(*args, **kwargs)
        seen.append(request.priority)
        return request

    monkeypatch.setattr(inputs, "make_request", spy)
    return seen


def slow_steps(monkeypatch, engine: LLMEngine, seconds: float) -> None:
    """Every step of ``engine`` takes at least ``seconds`` more from now on: a test that needs a batch to be still
    running at some point gets that from its number of steps, not from how fast this machine runs the tiny model
    (on a fast CPU, 40 lines of 48 tokens on 4 seats had finished before the check)."""
    step = engine.step

    def slowed():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slowed)
