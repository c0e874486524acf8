#!/usr/bin/env bash
# cpu-mixed before and after a restructuring, alternating, ours only (issue 17's check that it changed no speed).
# Usage: benchmarks/restructure_ab.sh BEFORE_COMMIT [RUNS]; the before side runs from a worktree on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?a commit to compare with}
runs=${2:-3}
tree=$(mktemp -d)/before
git worktree add --detach "$tree" "$before" >/dev/null
trap 'git worktree remove --force "$tree"' EXIT
for i in $(seq "$runs"); do
  for side in before after; do
    src=$PWD/src; [ "$side" = before ] && src=$tree/src
    PYTHONPATH=$src .venv/bin/python -m qwenbatch.cli bench throughput --workload cpu-mixed \
      --output "benchmarks/results/restructure-$side-$i.json" 2>/dev/null | grep '^qwenbatch ' | sed "s/^/$side $i: /"
  done
done
