#!/usr/bin/env bash
# The GPU benchmark (issue 14) in one call on a lent GPU machine, with only what that machine has:
# the code runs from src/ on its own torch (no pip install of the project, which pins torch 2.13).
#   benchmarks/gpu/run.sh            # on the GPU: parity (tokens, prompt logprobs, embeddings), 500 x 512 -> 128,
#                                    # nano-vllm's workload, transformers, graphs, kernel tests
#   benchmarks/gpu/run.sh --smoke    # here: the same path end to end on the CPU, tiny model, Triton interpreter
# Writes gpu-bench.json under $OUT (or --out DIR) and prints one table.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [[ " $* " == *" --smoke "* ]]; then
  export TRITON_INTERPRET=1
fi
exec "${PYTHON:-python3}" benchmarks/gpu/bench.py "$@"
