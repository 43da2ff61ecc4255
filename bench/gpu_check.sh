#!/usr/bin/env bash
# One prepared run for a machine with a GPU (issue 13): builds with CUDA, runs the `gpu` tests
# (every CUDA kernel against the CPU device, bit for bit), measures the CUDA device through
# `zinf bench device` (pinned-free host <-> device copies, device copy, Adam against the device
# copy) and trains the GPT with the engine on the GPU (ZINF_DEVICE=cuda: engine operations and
# state on the GPU; the example model's own matrix products still run on the CPU), stage 3 with
# parameters and optimizer on NVMe. Prints one JSON object. Meant to finish in a few minutes.
#
#   bash bench/gpu_check.sh [BUILD_DIR]      (env: STEPS=20, MODEL=small, SWAP=/tmp/zinf-gpu-swap)
set -uo pipefail
BUILD=${1:-build}
STEPS=${STEPS:-20}
MODEL=${MODEL:-small}
SWAP=${SWAP:-/tmp/zinf-gpu-swap}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT" "$SWAP"' EXIT
nvidia-smi -L >"$OUT/gpu.txt" 2>&1 || echo "nvidia-smi failed" >>"$OUT/gpu.txt"

{ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZINF_CUDA=ON &&
  cmake --build "$BUILD" -j "$(nproc)"; } >"$OUT/build.log" 2>&1
BUILD_RC=$?
ctest --test-dir "$BUILD" -L gpu --output-on-failure >"$OUT/gpu_tests.log" 2>&1
GPU_TESTS_RC=$?
"$BUILD/cli/zinf" bench device --device cuda --size 1G --runs 7 --json >"$OUT/device.json" 2>"$OUT/device.err"
DEVICE_RC=$?
mkdir -p "$SWAP"
START=$(date +%s.%N)
ZINF_DEVICE=cuda "$BUILD/cli/zinf" train --model "$MODEL" --steps "$STEPS" --stage 3 \
  --offload-param nvme --offload-optimizer nvme --nvme-path "$SWAP" --log-json "$OUT/train.jsonl" \
  >"$OUT/train.log" 2>&1
TRAIN_RC=$?
END=$(date +%s.%N)

python3 - "$OUT" "$BUILD_RC" "$GPU_TESTS_RC" "$DEVICE_RC" "$TRAIN_RC" "$START" "$END" <<'PY'
import json, sys, os
out, build_rc, tests_rc, device_rc, train_rc, start, end = sys.argv[1:]
def read(name):
    p = os.path.join(out, name)
    return open(p).read() if os.path.exists(p) else ""
steps = []
for line in read("train.jsonl").splitlines():
    try:
        j = json.loads(line)
    except ValueError:
        continue
    if "step" in j:
        steps.append(j)
summary = {
    "gpu": read("gpu.txt").strip(),
    "build_rc": int(build_rc),
    "gpu_tests_rc": int(tests_rc),
    "gpu_tests_tail": read("gpu_tests.log").strip().splitlines()[-12:],
    "device_rc": int(device_rc),
    "device": json.loads(read("device.json")) if read("device.json").strip() else read("device.err").strip(),
    "train_rc": int(train_rc),
    "train_seconds": float(end) - float(start),
    "loss_first": steps[0]["loss"] if steps else None,
    "loss_last": steps[-1]["loss"] if steps else None,
    "tokens_per_s_last": steps[-1]["tokens_per_s"] if steps else None,
    "train_tail": read("train.log").strip().splitlines()[-8:],
}
if int(build_rc):
    summary["build_tail"] = read("build.log").strip().splitlines()[-20:]
print(json.dumps(summary, indent=2))
PY
