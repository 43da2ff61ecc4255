#!/usr/bin/env bash
# The small-budget case: a 101 M-parameter GPT (--layers 8 --dim 1024 --heads 16 --seq 64
# --batch 1; 48 MiB units), stage 3, one rank, parameters and optimizer state on NVMe, 512 MiB
# device and host budgets, no gradient clipping (--clip 0), with the defaults otherwise. Each of
# ROUNDS rounds runs it for STEPS steps, measures the disk right after (`zinf bench io`, 1 MiB
# requests, queue depth 8: the engine's I/O settings), then runs the same model in memory, and
# prints for steps 2..STEPS-1 (the first has no recorded order; the last one's update ends with
# the run) the median step time against max(in-memory step time, the time its NVMe bytes take at
# the measured speed), and each step's bytes against the documented minimum (docs/offload.md,
# "The traffic minimum"). The disk is shared and noisy: compare rounds, not single steps.
# EXTRA adds flags to the offloaded run: EXTRA=--overlap-optimizer fuses the updates into the
# backward pass, which --clip 0 allows (the fastest setting for this case: docs/offload.md).
#
#   bench/small_budget.sh [NVME_DIR]      (env: ZINF=build/cli/zinf, STEPS=6, ROUNDS=3, EXTRA=)
set -euo pipefail
DIR=${1:-.zinf/small_budget}
ZINF=${ZINF:-build/cli/zinf}
STEPS=${STEPS:-6}
ROUNDS=${ROUNDS:-3}
read -r -a EXTRA_FLAGS <<< "${EXTRA:-}"
MODEL=(--model small --layers 8 --dim 1024 --heads 16 --seq 64 --batch 1 --ranks 1 --stage 3
       --clip 0 --lr 1e-5 --steps "$STEPS" --quiet)
[ -x "$ZINF" ] || { echo "$ZINF not found: build first (make build)" >&2; exit 1; }
[ "$STEPS" -ge 3 ] || { echo "STEPS must be at least 3" >&2; exit 2; }
mkdir -p "$DIR"
TMP=$(mktemp -d)
# The runs' swap lives in a directory of this script's own: other runs sharing DIR keep theirs.
SWAP=$(mktemp -d "$DIR/small_budget.XXXXXX")
trap 'rm -rf "$TMP" "$SWAP"' EXIT

bw() { "$ZINF" bench io --path "$SWAP" --size 1G --block-size 1M --queue-depth 8 --rw "$1" --json |
       python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes_per_s"])'; }

for r in $(seq "$ROUNDS"); do
  rm -rf "${SWAP:?}"/*
  "$ZINF" train "${MODEL[@]}" --offload-param nvme --offload-optimizer nvme --nvme-path "$SWAP" \
    --device-mem 512M --host-mem 512M --log-json "$TMP/offloaded.json" \
    ${EXTRA_FLAGS[@]+"${EXTRA_FLAGS[@]}"}
  read_bw=$(bw read)
  write_bw=$(bw write)
  "$ZINF" train "${MODEL[@]}" --log-json "$TMP/memory.json"
  python3 - "$TMP/offloaded.json" "$TMP/memory.json" "$read_bw" "$write_bw" "$r" <<'PY'
import json, statistics, sys
off, mem, read_bw, write_bw, rnd = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
steps = lambda f: [l for l in map(json.loads, open(f)) if "step" in l]
s = steps(off)[1:-1]
mem_s = statistics.median(x["seconds"] for x in steps(mem)[1:-1])  # the same steps as `s`
io = [x["nvme_read_bytes"] / read_bw + x["nvme_written_bytes"] / write_bw for x in s]
step = statistics.median(x["seconds"] for x in s)
io_s = statistics.median(io)
print(json.dumps({
    "round": int(rnd), "bench_read_bytes_per_s": read_bw, "bench_write_bytes_per_s": write_bw,
    "memory_step_seconds": mem_s, "step_seconds": step, "io_seconds": io_s,
    "step_over_max_memory_io": step / max(mem_s, io_s),
    "read_over_minimum": [round(x["nvme_read_bytes"] / x["nvme_read_minimum_bytes"], 3) for x in s],
    "written_over_minimum":
        [round(x["nvme_written_bytes"] / x["nvme_written_minimum_bytes"], 3) for x in s]}))
PY
done
