#!/usr/bin/env bash
# The ZeRO-Infinity promise on this machine: train a model whose fp32 training state (parameters,
# gradients, Adam m and v: 16 bytes per parameter) is larger than the machine's RAM, for STEPS
# steps (3), with the budgets the engine chooses (none given: docs/engine.md, Budgets) or BUDGET for
# both. Prints the state size, the budgets, the peak resident memory of the process, the NVMe
# traffic per step against its documented minimum (docs/offload.md, "The traffic minimum"; also
# against that minimum plus the gradients that must wait on NVMe for the norm because the host
# budget cannot hold them), and the step time against the time those bytes take at `zinf bench
# io`'s read and write throughput on the same directory, measured right after the run (1 MiB
# requests, queue depth 8: the engine's I/O settings). The summary (JSON) is of the second step:
# with the update behind step() a step's bytes and time run from the end of the previous step's
# update to the end of its own, and parameters updated by one step's walk are written back while
# the next pass holds them, so a step carries the previous step's parameter writes; the last one
# also carries its own, which the run's end flushes. Exits 1 when the memory target (peak RSS
# <= 25% of the state) is missed.
#
# With SAVE=1 the run also saves a checkpoint after its last step (under NVME_DIR/ckpt), then
# `zinf checkpoint export` writes it as safetensors; each process's peak RSS (/usr/bin/time) is
# printed against the budgets and the state, with the save and export rates.
#
# EXTRA adds flags to the training run (for example EXTRA="--clip 0 --overlap-optimizer": updates
# fused into backward, whose minimum is lower: docs/offload.md).
#
#   bench/beyond_ram.sh [NVME_DIR] [PRESET]
#     (env: ZINF=build/cli/zinf, BUDGET=, SEQ=32, STEPS=3, SAVE=, EXTRA=)
set -euo pipefail
DIR=${1:-.zinf/beyond}
PRESET=${2:-2b}
ZINF=${ZINF:-build/cli/zinf}
BUDGET=${BUDGET:-}
BUDGET_FLAGS=()
[ -n "$BUDGET" ] && BUDGET_FLAGS=(--device-mem "$BUDGET" --host-mem "$BUDGET")
SEQ=${SEQ:-32}
STEPS=${STEPS:-3}
SAVE=${SAVE:-}
read -r -a EXTRA_FLAGS <<< "${EXTRA:-}"
[ -x "$ZINF" ] || { echo "$ZINF not found: build first (make build)" >&2; exit 1; }
mkdir -p "$DIR"
LOG=$(mktemp)
OUT=$(mktemp)
TIMES=$(mktemp)
trap 'rm -f "$LOG" "$OUT" "$TIMES"' EXIT
SAVE_FLAGS=()
[ -n "$SAVE" ] && SAVE_FLAGS=(--save-dir "$DIR/ckpt" --save-every "$STEPS" --keep 1)

ram=$(($(awk '/MemTotal/ { print $2 }' /proc/meminfo) * 1024))
state=$("$ZINF" train --model "$PRESET" --describe | python3 -c 'import json,sys; print(json.load(sys.stdin)["training_state_bytes_fp32"])')
params=$((state / 16))
echo "model $PRESET: $params parameters, fp32 training state $((state >> 20)) MiB, RAM $((ram >> 20)) MiB"
if [ "$state" -le "$ram" ]; then
  echo "note: the training state of $PRESET fits in RAM here; pick a larger preset" >&2
fi

/usr/bin/time -f "train %M %e" -a -o "$TIMES" \
  "$ZINF" train --model "$PRESET" --ranks 1 --stage 3 --offload-param nvme --offload-optimizer nvme \
  --nvme-path "$DIR" "${BUDGET_FLAGS[@]}" --batch 1 --seq "$SEQ" \
  --steps "$STEPS" --lr 1e-5 --log-json "$LOG" "${SAVE_FLAGS[@]}" "${EXTRA_FLAGS[@]}" | tee "$OUT"
if [ -n "$SAVE" ]; then
  /usr/bin/time -f "export %M %e" -a -o "$TIMES" \
    "$ZINF" checkpoint export "$DIR/ckpt" --out "$DIR/export.safetensors"
  echo "checkpoint $(du -sb "$DIR/ckpt" | cut -f1) bytes, export $(stat -c %s "$DIR/export.safetensors") bytes"
fi

# The yardstick: the disk's throughput now, with the engine's request size and depth.
bw() { "$ZINF" bench io --path "$DIR" --size 2G --block-size 1M --queue-depth 8 --rw "$1" --json |
       python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes_per_s"])'; }
READ_BW=$(bw read)
WRITE_BW=$(bw write)

rc=0
python3 - "$LOG" "$state" "$params" "$TIMES" "$OUT" "$DIR" "$SAVE" "$READ_BW" "$WRITE_BW" <<'PY' || rc=$?
import json, os, re, sys
log, state, params = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
times, out, nvme_dir, save = sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7]
read_bw, write_bw = float(sys.argv[8]), float(sys.argv[9])
lines = list(map(json.loads, open(log)))  # {"settings": ...}, {"budgets": ...}, then the steps
steps = [s for s in lines if "step" in s]
budgets = next((s["budgets"] for s in lines if "budgets" in s), {})
rss = max(s["peak_rss_bytes"] for s in steps)
# The least this placement must move per step (Engine::nvme_traffic_minimum, written to the log).
# Plus, each way, the gradients that wait for the norm beyond the host budget's room.
for s in steps:
    rmin, wmin = s["nvme_read_minimum_bytes"], s["nvme_written_minimum_bytes"]
    spill = s["nvme_gradient_spill_minimum_bytes"]
    io_s = s["nvme_read_bytes"] / read_bw + s["nvme_written_bytes"] / write_bw
    print(f"step {s['step']}: loss {s['loss']:.4f}, {s['seconds']:.1f} s "
          f"({s['seconds'] / io_s:.2f}x the {io_s:.1f} s its bytes take at the disk's speed), "
          f"NVMe read {s['nvme_read_bytes'] / 2**30:.2f} GiB ({s['nvme_read_bytes'] / rmin:.2f}x "
          f"the minimum {rmin / 2**30:.2f}), written {s['nvme_written_bytes'] / 2**30:.2f} GiB "
          f"({s['nvme_written_bytes'] / wmin:.2f}x the minimum {wmin / 2**30:.2f}); at this host "
          f"budget, where {spill / 2**30:.2f} GiB of gradients wait on NVMe for the norm, "
          f"{s['nvme_read_bytes'] / (rmin + spill):.2f}x and "
          f"{s['nvme_written_bytes'] / (wmin + spill):.2f}x the least")
# The second step (the only one after the first in a run of two): see the header.
last = steps[1] if len(steps) > 1 else steps[0]
spill = last["nvme_gradient_spill_minimum_bytes"]
io_s = last["nvme_read_bytes"] / read_bw + last["nvme_written_bytes"] / write_bw
print(json.dumps({"parameters": params, "training_state_bytes": state, "peak_rss_bytes": rss,
                  "device_budget_bytes": budgets.get("device_bytes"),
                  "host_budget_bytes": budgets.get("host_bytes"),
                  "rss_fraction_of_state": rss / state,
                  "nvme_read_bytes_per_step": last["nvme_read_bytes"],
                  "nvme_written_bytes_per_step": last["nvme_written_bytes"],
                  "minimum_read_bytes": last["nvme_read_minimum_bytes"],
                  "minimum_written_bytes": last["nvme_written_minimum_bytes"],
                  "read_over_minimum": last["nvme_read_bytes"] / last["nvme_read_minimum_bytes"],
                  "written_over_minimum":
                      last["nvme_written_bytes"] / last["nvme_written_minimum_bytes"],
                  "gradient_spill_minimum_bytes": spill,
                  "read_over_minimum_at_budget":
                      last["nvme_read_bytes"] / (last["nvme_read_minimum_bytes"] + spill),
                  "written_over_minimum_at_budget":
                      last["nvme_written_bytes"] / (last["nvme_written_minimum_bytes"] + spill),
                  "bench_read_bytes_per_s": read_bw, "bench_write_bytes_per_s": write_bw,
                  "step_seconds": last["seconds"], "io_seconds_at_bench_speed": io_s,
                  "step_over_io_time": last["seconds"] / io_s}))
met = rss <= state / 4
print("peak RSS is {:.1%} of the training state: {}".format(
    rss / state, "target met (<= 25%)" if met else "target missed (> 25%)"))
if save:
    # Peak RSS of each whole process (/usr/bin/time, KiB), the save as the trainer reports it.
    procs = {w[0]: (int(w[1]) * 1024, float(w[2])) for w in map(str.split, open(times))}
    m = re.search(r"\((\d+) saved: .* in ([0-9.]+) s", open(out).read())
    save_s = float(m.group(2)) if m else None
    ckpt = sum(os.path.getsize(os.path.join(d, f))
               for d, _, fs in os.walk(os.path.join(nvme_dir, "ckpt")) for f in fs)
    export = os.path.getsize(os.path.join(nvme_dir, "export.safetensors"))
    budget = (budgets.get("device_bytes") or 0) + (budgets.get("host_bytes") or 0)
    result = {"checkpoint_bytes": ckpt, "save_seconds": save_s,
              "save_bytes_per_second": ckpt / save_s if save_s else None,
              "train_and_save_peak_rss_bytes": procs["train"][0],
              "export_bytes": export, "export_seconds": procs["export"][1],
              "export_bytes_per_second": export / procs["export"][1],
              "export_peak_rss_bytes": procs["export"][0], "budget_bytes": budget}
    print(json.dumps(result))
    for what in ("train_and_save", "export"):
        r = result[what + "_peak_rss_bytes"]
        print(f"{what}: peak RSS {r / 2**30:.2f} GiB = {r / state:.1%} of the state "
              f"({r / budget:.2f}x the device + host budgets)" if budget else "")
sys.exit(0 if met else 1)
PY
rm -rf "$DIR"/zinf-*
if [ -n "$SAVE" ]; then rm -rf "$DIR/ckpt" "$DIR/export.safetensors"; fi
exit "$rc"
