"""Continuous batching across HTTP requests: N chat requests sent at once vs one after another.

Starts `qwenbatch serve` on a free port, sends the same greedy chat requests (streamed) first
sequentially, then all at once, for several rounds, and reports the ratio of wall times
(sequential / concurrent, median over rounds) and time to first token p50/p99 while all run.

    .venv/bin/python benchmarks/serve_concurrency.py --output benchmarks/results/serve-concurrency-float32.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from common import CHAT_INSTRUCTIONS  # benchmarks/ is on sys.path when this script runs

from qwenbatch.bench.serving import free_port, run_chat_batch, summarize, wait_healthy


def start_server(
    model: str, dtype: str, port: int, threads: int | None = None, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    """`qwenbatch serve` on ``port`` (``threads``: OMP_NUM_THREADS; ``extra`` flags), once /health says healthy."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    cmd = [sys.executable, "-m", "qwenbatch.cli", "serve", "--model", model, "--dtype", dtype, "--port", str(port)]
    cmd += extra
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}", timeout_s=900)
    except Exception:
        server.kill()
        raise
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    prompts = [CHAT_INSTRUCTIONS[i % len(CHAT_INSTRUCTIONS)] for i in range(args.requests)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args.model, args.dtype, port)
    try:
        asyncio.run(run_chat_batch(url, args.model, prompts[:2], args.max_tokens, concurrent=True))  # warm-up
        rounds = []
        for r in range(args.rounds):
            seq_wall, seq = asyncio.run(run_chat_batch(url, args.model, prompts, args.max_tokens, concurrent=False))
            conc_wall, conc = asyncio.run(run_chat_batch(url, args.model, prompts, args.max_tokens, concurrent=True))
            rounds.append(
                {
                    "sequential": summarize(seq_wall, seq),
                    "concurrent": summarize(conc_wall, conc),
                    "ratio_wall": seq_wall / conc_wall,
                    "same_text": [t.text for t in seq] == [t.text for t in conc],
                }
            )
            c = rounds[-1]["concurrent"]
            print(
                f"round {r + 1}: sequential {seq_wall:.1f} s, concurrent {conc_wall:.1f} s, "
                f"ratio {rounds[-1]['ratio_wall']:.2f}x, TTFT p50 {c['ttft_p50_s']:.2f} s p99 {c['ttft_p99_s']:.2f} s, "
                f"same text: {rounds[-1]['same_text']}",
                flush=True,
            )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)

    def median(path: tuple[str, ...]) -> float:
        values = []
        for entry in rounds:
            for key in path:
                entry = entry[key]
            values.append(entry)
        return statistics.median(values)

    result = {
        "model": args.model,
        "dtype": args.dtype,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "cpus": os.cpu_count(),
        "rounds": rounds,
        "median_ratio_wall": median(("ratio_wall",)),
        "median_concurrent_ttft_p50_s": median(("concurrent", "ttft_p50_s")),
        "median_concurrent_ttft_p99_s": median(("concurrent", "ttft_p99_s")),
        "median_sequential_ttft_p50_s": median(("sequential", "ttft_p50_s")),
        "median_concurrent_output_tps": median(("concurrent", "output_tps")),
        "median_sequential_output_tps": median(("sequential", "output_tps")),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
