"""A real uvicorn server on a loopback port, in a background thread, for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import httpx
import uvicorn

from qwenbatch.config import EngineConfig
from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.server.app import ServerSettings, build_app


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
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.wait_healthy = wait_healthy

    @property
    def engine(self) -> LLMEngine:
        return self.app.state.ctx.engine.engine

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
