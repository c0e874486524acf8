"""The Batch API (/v1/files + /v1/batches) against run-batch in-process, and interactive latency beside it.

On the same model and the same N-line chat batch (batch_scaling.write_batch), times:
- `qwenbatch run-batch` in-process (wall time without model loading, from its summary line);
- the Batch API on `qwenbatch serve`: upload, create, poll until completed (client-side wall time);
- interactive chat requests (greedy, --probe-tokens each), one after another: on the idle server,
  and while a second copy of the batch runs through the Batch API (batch lines run at priority 1).

    .venv/bin/python benchmarks/batch_api.py --output benchmarks/results/batch-api-float32.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
from batch_scaling import run_batch, stop, write_batch
from serve_concurrency import start_server

from qwenbatch.bench.serving import free_port
from qwenbatch.bench.stats import percentile

PROBE_PROMPTS = ["Name a prime number.", "What is 2 + 2?", "Say hello in French.", "What colour is the sky?"]


def probe(client: httpx.Client, i: int, max_tokens: int) -> float:
    """One interactive chat request; its end-to-end seconds."""
    body = {
        "messages": [{"role": "user", "content": f"{PROBE_PROMPTS[i % len(PROBE_PROMPTS)]} (#{i})"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    started = time.perf_counter()
    client.post("/v1/chat/completions", json=body).raise_for_status()
    return time.perf_counter() - started


def run_batch_api(client: openai.OpenAI, batch_file: Path) -> float:
    """Upload, create, poll until completed; the seconds from the upload to completion."""
    started = time.perf_counter()
    upload = client.files.create(file=batch_file.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.5)
    if batch.status != "completed" or batch.request_counts.failed:
        raise RuntimeError(f"batch {batch.status}: {batch.request_counts}, {batch.errors}")
    return time.perf_counter() - started


def latency_summary(latencies: list[float]) -> dict:
    return {
        "requests": len(latencies),
        "p50_s": statistics.median(latencies),
        "p99_s": percentile(latencies, 99),
        "mean_s": statistics.fmean(latencies),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--probe-tokens", type=int, default=32)
    parser.add_argument("--idle-probes", type=int, default=12)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    result: dict = {"model": args.model, "dtype": args.dtype, "lines": args.lines, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        batch = Path(tmp) / "batch.jsonl"
        write_batch(batch, args.lines, args.max_tokens)
        engine = ["--model", args.model, "--dtype", args.dtype]
        result["run_batch"] = run_batch(["-i", str(batch), "-o", str(Path(tmp) / "out.jsonl"), "--no-resume", *engine])
        print("run-batch in-process", result["run_batch"], flush=True)

        port = free_port()
        server = start_server(args.model, args.dtype, port, extra=("--data-dir", str(Path(tmp) / "data")))
        url = f"http://127.0.0.1:{port}"
        try:
            sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
            with httpx.Client(base_url=url, timeout=None) as http:
                idle = [probe(http, i, args.probe_tokens) for i in range(args.idle_probes)]
                result["interactive_idle"] = latency_summary(idle)
                print("interactive, idle", result["interactive_idle"], flush=True)

                result["batch_api_wall_s"] = run_batch_api(sdk, batch)
                print("batch API wall s", result["batch_api_wall_s"], flush=True)

                busy: list[float] = []
                running = threading.Event()
                running.set()

                def probes() -> None:
                    i = 0
                    while running.is_set():
                        busy.append(probe(http, 1000 + i, args.probe_tokens))
                        i += 1

                thread = threading.Thread(target=probes)
                thread.start()
                try:
                    result["batch_api_wall_s_with_probes"] = run_batch_api(sdk, batch)
                finally:
                    running.clear()
                    thread.join()
                result["interactive_during_batch"] = latency_summary(busy)
                print("interactive, during the batch", result["interactive_during_batch"], flush=True)
        finally:
            stop(server)

    result["ratio_batch_api_over_run_batch_wall"] = result["batch_api_wall_s"] / result["run_batch"]["wall_s"]
    idle_p50, busy_p50 = result["interactive_idle"]["p50_s"], result["interactive_during_batch"]["p50_s"]
    result["ratio_interactive_p50_busy_over_idle"] = busy_p50 / idle_p50
    print(json.dumps({k: v for k, v in result.items() if k.startswith("ratio")}, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
