#!/usr/bin/env bash
# `make bench`: every benchmark that exists, each printing its numbers (JSON where it can).
set -euo pipefail
BUILD=${1:-build}
export ZINF="$BUILD/cli/zinf"
mkdir -p .zinf/bench
echo "== I/O: zinf bench io vs fio (medians of alternating runs)"
bash bench/io_vs_fio.sh .zinf/bench "${RUNS:-3}"
echo "== Tiered store: NVMe -> pinned -> device vs bench io"
"$ZINF" bench store --path .zinf/bench --size 1G --runs 3
echo "== CPU Adam against the memory-bandwidth roofline"
for precision in fp32 bf16 fp16; do
  for threads in 1 2; do
    "$ZINF" bench adam --params 64M --threads $threads --precision $precision --json
  done
done
echo "== Collectives (local threads), algbw/busbw as nccl-tests defines them"
for op in all_gather reduce_scatter all_reduce; do
  "$ZINF" bench comm --ranks 2 --size 64M --op $op --json
done
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
