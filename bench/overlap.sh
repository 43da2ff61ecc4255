#!/usr/bin/env bash
# Overlap of NVMe traffic with compute (ZeRO-Infinity, stage 3, parameters and optimizer state on
# NVMe). Runs the same training steps (a) with all state in memory, (b) offloaded with the
# scheduler off (no prefetch, no reuse), (c) offloaded with the scheduler on (DeepSpeed's stage-3
# defaults), (d) as (c) with the optimizer updates overlapped with the backward pass, and prints
# the overlap efficiency of (c) and (d):
#     max(compute time, pure I/O time) / step time
# where compute time is the step time of (a) and pure I/O time is the NVMe bytes a step moves
# divided by `zinf bench io` read and write throughput on the same path. The disk is shared and
# noisy: each of ROUNDS rounds measures the yardstick and runs (b), (c), (d) back to back; the
# efficiencies are computed per round and the medians printed.
#
#   bench/overlap.sh [NVME_DIR]      (env: ZINF=build/cli/zinf, STEPS=6, ROUNDS=3)
set -euo pipefail
DIR=${1:-.zinf/overlap}
ZINF=${ZINF:-build/cli/zinf}
STEPS=${STEPS:-6}
ROUNDS=${ROUNDS:-3}
MODEL=(--model small --layers 8 --dim 512 --heads 8 --seq 64 --batch 4 --ranks 1 --stage 3
       --steps "$STEPS" --quiet)
OFFLOAD=(--device-mem 256M --host-mem 256M --offload-param nvme --offload-optimizer nvme
         --nvme-path "$DIR")
[ -x "$ZINF" ] || { echo "$ZINF not found: build first (make build)" >&2; exit 1; }
mkdir -p "$DIR"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

bw() { "$ZINF" bench io --path "$DIR" --size 512M --block-size 1M --queue-depth 16 --rw "$1" --json |
       python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes_per_s"])'; }

"$ZINF" train "${MODEL[@]}" --log-json "$TMP/a.jsonl"
for r in $(seq "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  bw read > "$TMP/read-$r"
  bw write > "$TMP/write-$r"
  "$ZINF" train "${MODEL[@]}" "${OFFLOAD[@]}" --prefetch-bucket 0 --reuse-distance 0 \
    --log-json "$TMP/b-$r.jsonl"
  "$ZINF" train "${MODEL[@]}" "${OFFLOAD[@]}" --log-json "$TMP/c-$r.jsonl"
  "$ZINF" train "${MODEL[@]}" "${OFFLOAD[@]}" --clip 0 --overlap-optimizer \
    --log-json "$TMP/d-$r.jsonl"
done

python3 - "$TMP" "$ROUNDS" <<'PY'
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
med = statistics.median
def steps(name):  # the first two steps record the trace and warm up: leave them out
    rows = [r for r in map(json.loads, open(f"{tmp}/{name}.jsonl")) if "step" in r]
    return rows[2:] if len(rows) > 3 else rows
compute = med(s["seconds"] for s in steps("a"))
per = {k: [] for k in ("b_s", "c_s", "d_s", "c_io_s", "d_io_s", "c_eff", "d_eff", "read", "write")}
for r in range(1, rounds + 1):
    read_bw = float(open(f"{tmp}/read-{r}").read())
    write_bw = float(open(f"{tmp}/write-{r}").read())
    per["read"].append(read_bw)
    per["write"].append(write_bw)
    per["b_s"].append(med(s["seconds"] for s in steps(f"b-{r}")))
    for x in ("c", "d"):
        rows = steps(f"{x}-{r}")
        t = med(s["seconds"] for s in rows)
        io = med(s["nvme_read_bytes"] / read_bw + s["nvme_written_bytes"] / write_bw for s in rows)
        per[f"{x}_s"].append(t)
        per[f"{x}_io_s"].append(io)
        per[f"{x}_eff"].append(max(compute, io) / t)
m = {k: med(v) for k, v in per.items()}
print(f"(a) in memory:               {compute:.3f} s/step")
print(f"(b) NVMe, scheduler off:     {m['b_s']:.3f} s/step")
print(f"(c) NVMe, defaults:          {m['c_s']:.3f} s/step  pure I/O {m['c_io_s']:.3f} s  "
      f"efficiency {m['c_eff']:.2f} (rounds: {', '.join(f'{e:.2f}' for e in per['c_eff'])})")
print(f"(d) no clipping, fused Adam: {m['d_s']:.3f} s/step  pure I/O {m['d_io_s']:.3f} s  "
      f"efficiency {m['d_eff']:.2f} (rounds: {', '.join(f'{e:.2f}' for e in per['d_eff'])})")
print(f"yardstick (zinf bench io, median of {rounds}): {m['read'] / 1e9:.2f} GB/s read, "
      f"{m['write'] / 1e9:.2f} GB/s write")
print(json.dumps({"compute_s": compute, "scheduler_off_s": m["b_s"], "c_s": m["c_s"],
                  "c_pure_io_s": m["c_io_s"], "c_overlap_efficiency": m["c_eff"],
                  "d_s": m["d_s"], "d_pure_io_s": m["d_io_s"], "d_overlap_efficiency": m["d_eff"],
                  "c_efficiency_rounds": per["c_eff"], "d_efficiency_rounds": per["d_eff"],
                  "read_bytes_per_s": m["read"], "write_bytes_per_s": m["write"]}))
PY
