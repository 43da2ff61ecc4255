#!/usr/bin/env bash
# Overlap of NVMe traffic with compute (ZeRO-Infinity, stage 3, parameters and optimizer state on
# NVMe). Runs the same training steps (a) with all state in memory, (b) offloaded with the
# scheduler off (no prefetch, no reuse), (c) offloaded with the scheduler on (DeepSpeed's stage-3
# defaults), (d) as (c) with the optimizer updates overlapped with the backward pass, and prints
# the overlap efficiency of (c) and (d):
#     max(compute time, pure I/O time) / step time
# where compute time is the step time of (a) and pure I/O time is the NVMe bytes a step moves
# divided by `zinf bench io` throughput on the same path, measured in the same run.
#
#   bench/overlap.sh [NVME_DIR]      (env: ZINF=build/cli/zinf, STEPS=6)
set -euo pipefail
DIR=${1:-.zinf/overlap}
ZINF=${ZINF:-build/cli/zinf}
STEPS=${STEPS:-6}
MODEL=(--model small --layers 8 --dim 512 --heads 8 --seq 64 --batch 4 --ranks 1 --stage 3 --clip 0)
BUDGET=(--device-mem 256M --host-mem 256M)
[ -x "$ZINF" ] || { echo "$ZINF not found: build first (make build)" >&2; exit 1; }
mkdir -p "$DIR"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

bw() { "$ZINF" bench io --path "$DIR" --size 512M --block-size 1M --queue-depth 16 --rw "$1" --json |
       python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes_per_s"])'; }
read_bw=$(bw read)
write_bw=$(bw write)

"$ZINF" train "${MODEL[@]}" --steps "$STEPS" --quiet --log-json "$TMP/a.jsonl"
"$ZINF" train "${MODEL[@]}" "${BUDGET[@]}" --offload-param nvme --offload-optimizer nvme \
  --nvme-path "$DIR" --prefetch-bucket 0 --reuse-distance 0 --steps "$STEPS" --quiet \
  --log-json "$TMP/b.jsonl"
"$ZINF" train "${MODEL[@]}" "${BUDGET[@]}" --offload-param nvme --offload-optimizer nvme \
  --nvme-path "$DIR" --steps "$STEPS" --quiet --log-json "$TMP/c.jsonl"
"$ZINF" train "${MODEL[@]}" "${BUDGET[@]}" --offload-param nvme --offload-optimizer nvme \
  --nvme-path "$DIR" --overlap-optimizer --steps "$STEPS" --quiet --log-json "$TMP/d.jsonl"

python3 - "$TMP" "$read_bw" "$write_bw" <<'PY'
import json, statistics, sys
tmp, read_bw, write_bw = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
def steps(name):  # the first two steps record the trace and warm up: leave them out
    rows = [json.loads(l) for l in open(f"{tmp}/{name}.jsonl")]
    return rows[2:] if len(rows) > 3 else rows
a, b, c, d = steps("a"), steps("b"), steps("c"), steps("d")
compute = statistics.median(s["seconds"] for s in a)
t_b = statistics.median(s["seconds"] for s in b)
def io_time(rows):
    return statistics.median(s["nvme_read_bytes"] / read_bw + s["nvme_written_bytes"] / write_bw
                             for s in rows)
out = {"compute_s": compute, "scheduler_off_s": t_b,
       "read_bytes_per_s": read_bw, "write_bytes_per_s": write_bw}
print(f"(a) in memory:                 {compute:.3f} s/step")
print(f"(b) NVMe, scheduler off:       {t_b:.3f} s/step")
for name, rows, label in (("c", c, "scheduler on"), ("d", d, "+ overlapped Adam")):
    t = statistics.median(s["seconds"] for s in rows)
    io = io_time(rows)
    eff = max(compute, io) / t
    print(f"({name}) NVMe, {label + ':':22s} {t:.3f} s/step  pure I/O {io:.3f} s  "
          f"efficiency {eff:.2f}")
    out[f"{name}_s"] = t
    out[f"{name}_pure_io_s"] = io
    out[f"{name}_overlap_efficiency"] = eff
print(f"NVMe yardstick (zinf bench io): {read_bw / 1e9:.2f} GB/s read, {write_bw / 1e9:.2f} GB/s write")
print(json.dumps(out))
PY
