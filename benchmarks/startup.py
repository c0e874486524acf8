"""Cold and warm start of the default model: wall seconds to a ready LLM and peak RSS.

    python benchmarks/startup.py --dtype float32 --warm-runs 3
    python benchmarks/startup.py --dtype auto --quantization int8 --warm-runs 3

Cold: a fresh QWENBATCH_CACHE, so the six parts are assembled, verified and converted. Warm: the
same cache again (median of --warm-runs). Each start is a new process; the parent times it from
spawn to "ready" and the child reports its own peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from qwenbatch import LLM
llm = LLM(model="default", dtype=sys.argv[1], quantization=sys.argv[2], kv_cache_memory=2**28)
ready = time.perf_counter() - t0
print(json.dumps({"in_process_s": ready, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def start(dtype: str, quantization: str, cache: str) -> dict:
    env = {**os.environ, "QWENBATCH_CACHE": cache}
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, dtype, quantization], env=env, capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none", choices=["none", "int8"])
    ap.add_argument("--warm-runs", type=int, default=3)
    ap.add_argument("--output")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="qwenbatch-cache-") as cache:
        cold = start(args.dtype, args.quantization, cache)
        warm = [start(args.dtype, args.quantization, cache) for _ in range(args.warm_runs)]
    report = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "cold": cold,
        "warm_median_wall_s": statistics.median(w["wall_s"] for w in warm),
        "warm_median_peak_rss_mib": statistics.median(w["peak_rss_mib"] for w in warm),
        "warm_runs": warm,
    }
    print(f"cold start: {cold['wall_s']:.1f} s, peak RSS {cold['peak_rss_mib']:.0f} MiB")
    print(
        f"warm start: {report['warm_median_wall_s']:.1f} s (median of {len(warm)}), "
        f"peak RSS {report['warm_median_peak_rss_mib']:.0f} MiB"
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
