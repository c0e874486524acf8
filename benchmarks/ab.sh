#!/usr/bin/env bash
# One `qwenbatch bench throughput` workload on an older commit and on the working tree, alternating, ours only:
# the machine drifts by ~10% between processes, so a change is judged by the ratio of side-by-side runs. Odd runs
# take the before side first, even runs the after side: on a host whose second run of a pair tends to be slower,
# a fixed order would read as a change.
# Usage: benchmarks/ab.sh BEFORE_COMMIT RUNS NAME [bench throughput options...]
#   e.g. benchmarks/ab.sh 677e200 5 decode64 --workload random --num-prompts 64 --input-len 256 --output-len 64 \
#        --quantization int8
# The before side runs from a worktree on PYTHONPATH (its CPU kernels build once into their own cache entry);
# results land in benchmarks/results/ab-NAME-{before,after}-I.json, and each run's summary line is printed (a failed
# run stops the script and names its log).
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?a commit to compare with}
runs=${2:?how many runs of each side}
name=${3:?a name for the result files}
shift 3
work=$(mktemp -d)
tree=$work/before
git worktree add --detach "$tree" "$before" >/dev/null
trap 'git worktree remove --force "$tree"' EXIT
for i in $(seq "$runs"); do
  order="before after"; [ $((i % 2)) = 0 ] && order="after before"
  for side in $order; do
    src=$PWD/src; [ "$side" = before ] && src=$tree/src
    log=$work/$side-$i.log
    PYTHONPATH=$src .venv/bin/python -m qwenbatch.cli bench throughput "$@" \
      --output "benchmarks/results/ab-$name-$side-$i.json" >"$log" 2>&1 || { echo "$side $i failed: $log"; exit 1; }
    grep '^qwenbatch ' "$log" | sed "s/^/$side $i: /"
  done
done
