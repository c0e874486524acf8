#!/usr/bin/env bash
# The CPU figures of BENCHMARKS.md, one after the other (about 2 hours on 2 cores; the tune sweep is 1 h).
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
qb=.venv/bin/qwenbatch
$qb bench throughput --workload cpu-mixed --dtype float32 --baseline transformers --batch1 \
    --output $out/throughput-cpu-mixed-float32.json
$qb bench throughput --workload shared-prefix --dtype float32 --compare-prefix-caching \
    --output $out/throughput-shared-prefix-float32.json
$qb bench throughput --workload random --num-prompts 128 --input-len 32-64 --output-len 128 --dtype float32 \
    --output $out/throughput-decode-heavy-float32.json
$qb tune --workload cpu-mixed --num-samples 32 --compare-static --output $out/tune-cpu-mixed
.venv/bin/python benchmarks/batch_api.py --output $out/batch-api-float32.json
