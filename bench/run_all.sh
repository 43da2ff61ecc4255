#!/usr/bin/env bash
# `make bench`: every benchmark that exists, each printing its numbers (JSON where it can).
set -euo pipefail
BUILD=${1:-build}
export ZINF="$BUILD/cli/zinf"
mkdir -p .zinf/bench
echo "== I/O: zinf bench io vs fio (medians of alternating runs)"
bash bench/io_vs_fio.sh .zinf/bench "${RUNS:-3}"
for suite in "$BUILD"/bench/*/*_bench; do
  [ -x "$suite" ] || continue
  echo "== $(basename "$suite")"
  "$suite" --benchmark_min_time=0.2
done
for script in bench/*/run.sh; do
  [ -f "$script" ] || continue
  echo "== $script"
  bash "$script" "$BUILD"
done
