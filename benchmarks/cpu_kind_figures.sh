#!/usr/bin/env bash
# Issue 15's figures for the CPU kind this machine is, in one run (~50 min on 2 cores, plus ~9 min the first time
# to build llama.cpp): made for the first session on a kind no session has measured yet (the AMX kind), so that
# every target is measured side by side before anything changes. Run nothing else meanwhile. Never run by CI.
#
#   bash benchmarks/cpu_kind_figures.sh            # results under benchmarks/results/*-<kind>.json|txt
#
# <kind> is amx, avx512bf16 or avx2, from /proc/cpuinfo's flags; the log names the CPU model and family too.
set -euo pipefail
cd "$(dirname "$0")/.."
flags=$(grep -m1 '^flags' /proc/cpuinfo)
case " $flags " in
  *" amx_bf16 "*) kind=amx ;;
  *" avx512_bf16 "*) kind=avx512bf16 ;;
  *) kind=avx2 ;;
esac
out=benchmarks/results
py=.venv/bin/python
qb=.venv/bin/qwenbatch
log() { echo "[$(date +%H:%M:%S)] $*"; }
log "kind $kind: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2-), family $(grep -m1 '^cpu family' /proc/cpuinfo |
  cut -d: -f2 | tr -d ' '), model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | tr -d ' '), $(nproc) cores"
[ -d "$HOME/.cache/qwenbatch/llama.cpp" ] || bash benchmarks/build_llama_cpp.sh

# The kernels' choices first: they decide what the runs below measure.
log "int8 linears against dense bf16 matmuls by row count (layers/int8_large_m.py's crossover)"
$py benchmarks/int8_dense_rows.py | tee $out/int8-dense-rows-$kind.txt
log "prefill attention: ours against SDPA's flash kernel (layers/prefill_choice.py)"
attention_dtype=$([ $kind = avx2 ] && echo float32 || echo bfloat16)  # the kind's default engine dtype
$py benchmarks/prefill_attention_micro.py --dtype $attention_dtype --repeats 3 |
  tee $out/prefill-attention-micro-$kind.txt

log "beside llama.cpp: 1 / 16 / 64 sequences, batch-1 decode, prefill of 1,024 / 4,096 / 8,192 tokens"
$py benchmarks/llama_cpp_compare.py --quantization int8 --parallel 1,16,64 --prefill-lens 1024,4096,8192 \
  --batch1-pairs 5 --parallel-pairs 2 --output $out/llama-cpp-compare-int8-$kind.json >/dev/null

log "cpu-mixed beside transformers, both in the default dtype (bf16 where the CPU has it), 3 rounds; then ours in int8"
$qb bench throughput --workload cpu-mixed --baseline transformers --repeats 3 \
  --output $out/throughput-cpu-mixed-$kind.json | grep -v 'it/s\]'
$qb bench throughput --workload cpu-mixed --quantization int8 --output $out/throughput-cpu-mixed-int8-$kind.json |
  grep -v 'it/s\]'

log "reranking beside the model card's transformers code"
$py benchmarks/rerank_speed.py --dtype bfloat16 --repeats 3 --docs 64 --queries 4x16 --batch-sizes 1,2,4,8 \
  --output $out/rerank-bf16-$kind.json
$py benchmarks/rerank_speed.py --dtype bfloat16 --quantization int8 --docs 64 --queries 4x16 --batch-sizes 1,2,4,8 \
  --output $out/rerank-int8-$kind.json

log "the tune sweep in int8 (its pick moves when the kernels do)"
$qb tune --workload cpu-mixed --num-samples 32 --quantization int8 --output $out/tune-cpu-mixed-int8-$kind |
  grep -v 'it/s\]'
log done
