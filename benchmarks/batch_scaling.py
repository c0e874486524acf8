"""run-batch on a chat batch: in-process vs one request at a time to a server, and 1 vs 2 server replicas.

Builds an N-line OpenAI Batch file of chat requests (the 32 instructions of common.py, each line
made unique by its number so no whole prompt is a cache hit), then times:
- `qwenbatch run-batch` in-process (the engine batches everything it can);
- the same requests sent one by one to `qwenbatch serve` (what a naive client loop gets); with
  `--one-by-one-lines K` only the first K lines are sent and the wall time is scaled by output tokens;
- `run-batch --server` against one server using both cores, and against two servers with one core
  each (OMP_NUM_THREADS=1); on the one server, with and without length bucketing.

    .venv/bin/python benchmarks/batch_scaling.py --output benchmarks/results/batch-scaling-float32.json
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import serve_concurrency
from common import CHAT_INSTRUCTIONS

from qwenbatch.bench.serving import free_port

CLI = [sys.executable, "-m", "qwenbatch.cli"]
SUMMARY = re.compile(r"(\d+) ok, (\d+) failed.*?(\d+) prompt \+ (\d+) output tokens in ([0-9.]+) s")


def write_batch(path: Path, lines: int, max_tokens: int) -> None:
    with open(path, "wb") as f:
        for i in range(lines):
            content = f"{CHAT_INSTRUCTIONS[i % len(CHAT_INSTRUCTIONS)]} (#{i})"
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            f.write(orjson.dumps(line) + b"\n")


def run_batch(args: list[str], env: dict | None = None) -> dict:
    """Run `qwenbatch run-batch ...`; its summary line as numbers (wall excludes model loading)."""
    done = subprocess.run([*CLI, "run-batch", *args], capture_output=True, text=True, env=env, check=True)
    m = SUMMARY.search(done.stderr)
    if not m:
        raise RuntimeError(f"no summary in: {done.stderr[-1000:]}")
    ok, failed, prompt, output, wall = m.groups()
    return {"ok": int(ok), "failed": int(failed), "prompt_tokens": int(prompt), "output_tokens": int(output),
            "wall_s": float(wall), "output_tps": int(output) / float(wall)}  # fmt: skip


def start_server(model: str, dtype: str, threads: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    return serve_concurrency.start_server(model, dtype, port, threads), f"http://127.0.0.1:{port}"


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    server.wait(60)


def one_by_one(url: str, batch: Path, limit: int) -> dict:
    """Send the first ``limit`` lines sequentially, non-streaming; wall time and output tokens."""
    lines = batch.read_bytes().splitlines()[:limit]
    output = 0
    with httpx.Client(base_url=url, timeout=None) as client:
        started = time.perf_counter()
        for raw in lines:
            body = orjson.loads(raw)["body"]
            response = client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            output += response.json()["usage"]["completion_tokens"]
        wall = time.perf_counter() - started
    return {"lines": len(lines), "output_tokens": output, "wall_s": wall, "output_tps": output / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--one-by-one-lines", type=int, default=40)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    result: dict = {"model": args.model, "dtype": args.dtype, "lines": args.lines, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        batch = Path(tmp) / "batch.jsonl"
        write_batch(batch, args.lines, args.max_tokens)
        engine = ["--model", args.model, "--dtype", args.dtype]

        def out(name: str) -> list[str]:
            return ["-i", str(batch), "-o", str(Path(tmp) / f"{name}.jsonl"), "--no-resume"]

        result["in_process"] = run_batch([*out("local"), *engine])
        print("in-process", result["in_process"], flush=True)

        server, url = start_server(args.model, args.dtype, threads=None)
        try:
            result["one_by_one"] = one_by_one(url, batch, args.one_by_one_lines)
            print("one by one", result["one_by_one"], flush=True)
            for bucket in ("--bucket-by-length", "--no-bucket-by-length"):
                key = f"servers_1x2threads{'' if bucket == '--bucket-by-length' else '_no_bucketing'}"
                result[key] = run_batch([*out(key), "--server", url, "--max-concurrency", "256", bucket])
                print(key, result[key], flush=True)
        finally:
            stop(server)

        servers = [start_server(args.model, args.dtype, threads=1) for _ in range(2)]
        try:
            flags = [flag for _, u in servers for flag in ("--server", u)]
            result["servers_2x1thread"] = run_batch([*out("two"), *flags, "--max-concurrency", "128"])
            print("servers_2x1thread", result["servers_2x1thread"], flush=True)
        finally:
            for s, _ in servers:
                stop(s)

    obo = result["one_by_one"]
    total_output = result["in_process"]["output_tokens"]
    result["one_by_one_wall_s_scaled"] = obo["wall_s"] * total_output / obo["output_tokens"]
    result["ratio_one_by_one_over_in_process"] = result["one_by_one_wall_s_scaled"] / result["in_process"]["wall_s"]
    two, one = result["servers_2x1thread"], result["servers_1x2threads"]
    result["ratio_2_replicas_over_1"] = two["output_tps"] / one["output_tps"]
    result["ratio_bucketing_1_server"] = (
        result["servers_1x2threads"]["output_tps"] / result["servers_1x2threads_no_bucketing"]["output_tps"]
    )
    print(json.dumps({k: v for k, v in result.items() if k.startswith("ratio") or k.endswith("scaled")}, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
