"""Soak a real `qwenbatch serve`: N streaming and non-streaming requests at bounded concurrency, 20% of the
clients hanging up at random points, 10% malformed; afterwards no 5xx, nothing left in the engine, every
KV block free, and the server's RSS grown by no more than its KV pool (touched page by page as blocks are
first used) and a slack (`qwenbatch.bench.soak`). Never run by CI (a short
variant is in tests/test_soak.py).

    .venv/bin/python benchmarks/soak.py --requests 2000 --output benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from qwenbatch.bench.serving import free_port, wait_healthy
from qwenbatch.bench.soak import SoakConfig, run_soak

API_KEY = "soak-key"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-slack-mib", type=float, default=256.0, help="RSS growth allowed beyond the KV pool")
    parser.add_argument("--output", type=Path)
    parser.add_argument("serve_args", nargs="*", help="more `qwenbatch serve` flags, after --")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "qwenbatch.cli", "serve", "--model", args.model, "--port", str(port)]
    with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryDirectory() as data_dir:
        cmd += ["--api-key", API_KEY, "--data-dir", data_dir, *args.serve_args]
        server = subprocess.Popen(cmd, stdout=log, stderr=log, text=True)
        try:
            wait_healthy(server, url, timeout_s=900)
            config = SoakConfig(
                requests=args.requests,
                concurrency=args.concurrency,
                max_tokens=args.max_tokens,
                api_key=API_KEY,
                seed=args.seed,
            )
            report = asyncio.run(run_soak(url, config))
        finally:
            server.terminate()
            server.wait(60)
    growth_mib = (report.rss_end_bytes - report.rss_start_bytes) / 2**20
    limit_mib = report.kv_cache_bytes / 2**20 + args.rss_slack_mib
    result = {
        "command": " ".join(sys.argv),
        "config": asdict(config),
        "report": report.to_json(),
        "rss_growth_mib": round(growth_mib, 1),
        "rss_growth_limit_mib": round(limit_mib, 1),
        "server_exit_code": server.returncode,
    }
    print(json.dumps(result, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if report.clean and growth_mib <= limit_mib else 1


if __name__ == "__main__":
    sys.exit(main())
