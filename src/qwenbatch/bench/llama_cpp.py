"""llama.cpp as a baseline: its ``llama-server`` on the same GGUF, given the same token-id requests.

The binaries come from ``benchmarks/build_llama_cpp.sh`` (built once into the cache, never by CI); set
``QWENBATCH_LLAMA_CPP`` to another bin folder to use that one. The server runs on loopback with
continuous batching and one slot per sequence in flight, and every request goes to its native
``/completion`` endpoint with the prompt as token ids, greedy, ``n_predict`` tokens, eos ignored, so
both systems compute exactly the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import psutil
import torch

from qwenbatch.bench.workloads import BenchRequest
from qwenbatch.loader.default_model import cache_root, default_gguf_path

BUILD_HINT = "build it once with: bash benchmarks/build_llama_cpp.sh"


def bin_dir() -> Path:
    """The llama.cpp bin folder: ``$QWENBATCH_LLAMA_CPP``, else the newest build in the cache."""
    if os.environ.get("QWENBATCH_LLAMA_CPP"):
        folder = Path(os.environ["QWENBATCH_LLAMA_CPP"])
        if not (folder / "llama-server").is_file():
            raise FileNotFoundError(f"QWENBATCH_LLAMA_CPP={folder}: no llama-server there")
        return folder
    builds = sorted((cache_root() / "llama.cpp").glob("*/bin/llama-server"), key=lambda p: p.stat().st_mtime)
    if not builds:
        raise FileNotFoundError(f"no llama.cpp build under {cache_root() / 'llama.cpp'}; {BUILD_HINT}")
    return builds[-1].parent


def build_info(folder: Path) -> dict:
    """What build-info.json beside the bin folder says (version, commit, cmake flags, CPU flags)."""
    path = folder.parent / "build-info.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def gguf_for(model: str) -> Path:
    """The GGUF file llama.cpp runs for ``--model``: the default model's, or the .gguf given."""
    if model == "default":
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise ValueError(f"--baseline llama.cpp needs a GGUF model (--model default or a .gguf file), got {model!r}")


class LlamaServer:
    """A llama-server child process on loopback, for a ``with`` block; ``peak_rss_mib`` after."""

    def __init__(self, gguf: Path, parallel: int, ctx_per_slot: int, threads: int) -> None:
        from qwenbatch.bench.serving import free_port  # the server extra's httpx, only when run

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            str(bin_dir() / "llama-server"),
            *("-m", str(gguf), "-t", str(threads), "-np", str(parallel)),
            *("-c", str(parallel * ctx_per_slot), "-b", "2048", "-ub", "512"),
            *("--host", "127.0.0.1", "--port", str(self.port), "--no-webui"),
        ]
        self.peak_rss_bytes = 0
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        from qwenbatch.bench.serving import wait_healthy

        self._proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_healthy(self._proc, self.url, timeout_s=120)
        except Exception:
            self.__exit__()
            raise
        return self

    def sample_rss(self) -> None:
        self.peak_rss_bytes = max(self.peak_rss_bytes, psutil.Process(self._proc.pid).memory_info().rss)

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


async def _complete_all(server: LlamaServer, requests: list[BenchRequest], parallel: int) -> list[int]:
    import httpx

    limit = asyncio.Semaphore(parallel)

    async def one(client: httpx.AsyncClient, r: BenchRequest) -> int:
        body = {
            "prompt": r.prompt_token_ids,
            "n_predict": r.output_len,
            "ignore_eos": r.ignore_eos,
            # The request's sampling and nothing else of llama.cpp's defaults (top-k 40, min-p 0.05).
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": 1 if r.temperature == 0 else 0,
            "min_p": 0.0,
            "cache_prompt": True,  # llama-server's own prompt reuse, as ours reuses cached prefixes
        }
        async with limit:
            resp = await client.post(server.url + "/completion", json=body)
        resp.raise_for_status()
        server.sample_rss()
        return int(resp.json()["tokens_predicted"])

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=parallel)) as c:
        return await asyncio.gather(*(one(c, r) for r in requests))


def run_llama_cpp(model: str, requests: list[BenchRequest], parallel: int):
    """The workload on llama-server with ``parallel`` slots (our max_num_seqs), all requests queued at once."""
    from qwenbatch.bench.throughput import SystemResult

    parallel = max(1, min(parallel, len(requests)))
    ctx = max(len(r.prompt_token_ids) + r.output_len for r in requests) + 16
    threads = torch.get_num_threads()
    folder = bin_dir()
    with LlamaServer(gguf_for(model), parallel, ctx, threads) as server:
        start = time.perf_counter()
        produced = asyncio.run(_complete_all(server, requests, parallel))
        wall = time.perf_counter() - start
    info = build_info(folder)
    extra = {
        "parallel_slots": parallel,
        "threads": threads,
        "llama_cpp_commit": info.get("llama_cpp_commit"),
        "llama_cpp_python_version": info.get("llama_cpp_python_version"),
        "cmake_flags": info.get("cmake_flags"),
        "gguf": str(gguf_for(model)),
    }
    return SystemResult(
        "llama.cpp (llama-server)",
        len(requests),
        sum(len(r.prompt_token_ids) for r in requests),
        sum(produced),
        wall,
        server.peak_rss_bytes / 2**20,
        extra,
    )
