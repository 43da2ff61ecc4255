#!/usr/bin/env bash
# The one prepared run for a machine with a GPU (docs/gpu.md). It:
#  1. builds zinf with CUDA for this GPU (only the targets it runs);
#  2. runs the `gpu` tests: every CudaDevice operation against the CPU device bit for bit, every
#     GPT layer and the whole GpuModel against the CPU model element by element, the NCCL
#     collective suite where NCCL is found; the measured error of each comparison goes to the
#     summary (ZINF_GPU_REPORT);
#  3. measures pinned host <-> device copies and the device copy (`zinf bench device`), PyTorch's
#     pinned copies as their yardstick, and the CUDA Adam step against the device copy (`zinf
#     bench adam --device cuda`);
#  4. trains the GPT on the GPU (`--device cuda`: the engine's state and operations and the
#     model's compute) at stage 3 with parameters and optimizer on NVMe, in fp32 and in bf16,
#     and in bf16 with everything in GPU memory (the compute rate without NVMe);
# and prints one JSON object. Each phase has a time limit of its own, so a hang in one still
# leaves the summary. Needs the project's packages (make deps, or bench/gpu_deps.sh's carried
# copies) and nvcc; meant to finish in under 8 minutes on one H200.
#
#   bash bench/gpu_check.sh [BUILD_DIR]
#   env: STEPS=6 MODEL=gpt2-124m SEQ=256 BATCH=8 CUDA_ARCH=native
#        SWAP=/tmp (the NVMe file system: the run swaps in a directory of its own under it)
#        LIMIT=540 (seconds for the whole run; each phase stops at its own limit or this one)
#        KEEP=DIR (also leave the logs there, as gpu_check_logs.tar.gz, and the summary)
set -uo pipefail
BUILD=${1:-build-gpu}
STEPS=${STEPS:-6}
MODEL=${MODEL:-gpt2-124m}
SEQ=${SEQ:-256}
BATCH=${BATCH:-8}
SWAP=${SWAP:-/tmp}
CUDA_ARCH=${CUDA_ARCH:-native}
KEEP=${KEEP:-}
LIMIT=${LIMIT:-540}  # seconds for the whole run: each phase gets at most what is left of it
START=$(date +%s)
cap() {  # cap SECONDS: SECONDS, or what is left of LIMIT when that is less (5 at least)
  local left=$((START + LIMIT - $(date +%s)))
  if ((left < $1)); then echo $((left > 5 ? left : 5)); else echo "$1"; fi
}
WORK=$(mktemp -d)
mkdir -p "$SWAP"
SWAP_DIR=$(mktemp -d "$SWAP/zinf-gpu-swap.XXXXXX")  # only this run's own directory is removed
keep_logs() {
  if [ -n "$KEEP" ]; then
    mkdir -p "$KEEP" && tar -czf "$KEEP/gpu_check_logs.tar.gz" -C "$WORK" . 2>/dev/null
    cp "$WORK/summary.json" "$KEEP/" 2>/dev/null
  fi
  rm -rf "$WORK" "$SWAP_DIR"
}
trap keep_logs EXIT
say() { echo "gpu_check $(date +%T): $*" >&2; }
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.max,pcie.link.width.max \
  --format=csv,noheader >"$WORK/gpu.txt" 2>&1 || echo "nvidia-smi failed" >>"$WORK/gpu.txt"
{ uname -a; cat /etc/os-release; g++ --version; nvcc --version; cmake --version; nproc; } \
  >"$WORK/machine.txt" 2>&1

# Packages carried from bench/gpu_deps.sh (a machine that cannot install them): unpacked into a
# prefix of this run's own, found through it; MPI and Gloo are left out.
EXTRA=()
if [ -d .gpudeps ] && ls .gpudeps/*.deb >/dev/null 2>&1; then
  DEPS=/tmp/zinf-gpudeps
  mkdir -p "$DEPS"
  for f in .gpudeps/*.deb; do
    if command -v dpkg >/dev/null; then
      dpkg -x "$f" "$DEPS"
    else  # a .deb is an ar archive holding data.tar.*
      (cd "$DEPS" && ar p "$OLDPWD/$f" "$(ar t "$OLDPWD/$f" | grep '^data.tar')" | tar -xaf - \
        2>/dev/null || ar p "$OLDPWD/$f" "$(ar t "$OLDPWD/$f" | grep '^data.tar')" |
        tar --zstd -xf - 2>/dev/null || ar p "$OLDPWD/$f" "$(ar t "$OLDPWD/$f" | grep '^data.tar')" | tar -xJf -)
    fi
  done
  ARCHLIB=$(ls -d "$DEPS"/usr/lib/*-linux-gnu | head -1)
  export PATH="$DEPS/usr/bin:$PATH"
  # openblas.pc sits under openblas-pthread/ (the alternatives link dpkg -x does not make).
  export PKG_CONFIG_PATH="$ARCHLIB/pkgconfig:$ARCHLIB/openblas-pthread/pkgconfig:$DEPS/usr/share/pkgconfig"
  export PKG_CONFIG_SYSROOT_DIR="$DEPS"
  export LD_LIBRARY_PATH="$ARCHLIB:$ARCHLIB/openblas-pthread:${LD_LIBRARY_PATH:-}"
  EXTRA=(-DCMAKE_PREFIX_PATH="$DEPS/usr" -DZINF_MPI=OFF -DZINF_GLOO=OFF -DZINF_BENCH=OFF
         -DCMAKE_CXX_FLAGS="-isystem $DEPS/usr/include"
         -DCMAKE_CUDA_FLAGS="-isystem $DEPS/usr/include")
fi

# The corpus: the fortunes files (those without an extension, as the trainer reads the directory),
# from the carried package where the machine has none.
DATA=()
if [ ! -d /usr/share/games/fortunes ] && [ -d /tmp/zinf-gpudeps/usr/share/games/fortunes ]; then
  find /tmp/zinf-gpudeps/usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.*' -print0 |
    sort -z | xargs -0 cat >"$WORK/corpus.txt"
  DATA=(--data "$WORK/corpus.txt")
fi

# NCCL: the CUDA toolkit's, the system's, or the one a Python wheel (nvidia-nccl) ships, whose
# library is only libnccl.so.2; without any, the build leaves the NCCL backend out.
TARGETS=(zinf gpu_smoke_test cuda_device_test gpt_layers_gpu_test)
NCCL_H=$(ls /usr/local/cuda/include/nccl.h /usr/include/nccl.h \
  /usr/local/lib/python3*/dist-packages/nvidia/nccl/include/nccl.h \
  /opt/*/.venv/lib/python3*/site-packages/nvidia/nccl/include/nccl.h \
  /usr/lib/python3*/site-packages/nvidia/nccl/include/nccl.h 2>/dev/null | head -1)
NCCL_SO=""
if [ -n "$NCCL_H" ]; then
  NCCL_SO=$(ls "$(dirname "$(dirname "$NCCL_H")")"/lib*/libnccl.so* /usr/local/cuda/lib64/libnccl.so* \
    /usr/lib/x86_64-linux-gnu/libnccl.so* 2>/dev/null | head -1)
fi
if [ -n "$NCCL_SO" ]; then
  EXTRA+=(-DZINF_NCCL_INCLUDE_DIR="$(dirname "$NCCL_H")" -DZINF_NCCL_LIBRARY="$NCCL_SO")
  export LD_LIBRARY_PATH="$(dirname "$NCCL_SO"):${LD_LIBRARY_PATH:-}"
  TARGETS+=(comm_nccl_test)
else
  EXTRA+=(-DZINF_NCCL=OFF)
fi
echo "nccl: ${NCCL_H:-none} ${NCCL_SO:-none}" >>"$WORK/machine.txt"

T0=$(date +%s)
say "building ${TARGETS[*]}"
{ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZINF_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" ${EXTRA[@]+"${EXTRA[@]}"} &&
  timeout "$(cap 420)" cmake --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]}"; } \
  >"$WORK/build.log" 2>&1
BUILD_RC=$?
T1=$(date +%s)
say "build rc=$BUILD_RC; gpu tests"
ZINF_GPU_REPORT="$WORK/kernels.jsonl" timeout "$(cap 240)" ctest --test-dir "$BUILD" -L gpu --output-on-failure \
  --timeout 120 >"$WORK/gpu_tests.log" 2>&1
GPU_TESTS_RC=$?
ZINF="$BUILD/cli/zinf"
say "gpu tests rc=$GPU_TESTS_RC; bench device"
timeout "$(cap 60)" "$ZINF" bench device --device cuda --size 1G --runs 7 --json >"$WORK/device.json" \
  2>"$WORK/device.err"
DEVICE_RC=$?
say "bench device rc=$DEVICE_RC; bench adam"
timeout "$(cap 60)" "$ZINF" bench adam --device cuda --params 256M --steps 9 --json >"$WORK/adam.json" \
  2>"$WORK/adam.err"
ADAM_RC=$?
# The yardstick for the copies, measured in the same run: PyTorch's pinned (cudaHostAlloc) copies
# of the same size, where the machine's python3 has torch.
say "pinned copies through PyTorch (yardstick)"
timeout "$(cap 60)" python3 - >"$WORK/torch_copy.json" 2>"$WORK/torch_copy.err" <<'PY'
import json, statistics, time, torch
n = 1 << 30
host = torch.ones(n, dtype=torch.uint8).pin_memory()
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
def timed(f):
    torch.cuda.synchronize(); t0 = time.perf_counter(); f(); torch.cuda.synchronize()
    return time.perf_counter() - t0
timed(lambda: dev.copy_(host, non_blocking=True)); timed(lambda: host.copy_(dev, non_blocking=True))
h2d, d2h = [], []
for _ in range(7):  # alternating, medians, as zinf bench device
    h2d.append(timed(lambda: dev.copy_(host, non_blocking=True)))
    d2h.append(timed(lambda: host.copy_(dev, non_blocking=True)))
print(json.dumps({"torch": torch.__version__, "bytes": n,
                  "host_to_device_bytes_per_s": n / statistics.median(h2d),
                  "device_to_host_bytes_per_s": n / statistics.median(d2h)}))
PY
train() {  # train NAME DTYPE ARGS...: the GPT on the GPU, stage 3
  local name=$1 dtype=$2
  shift 2
  say "train $name"
  rm -rf "${SWAP_DIR:?}"/*
  timeout "$(cap 120)" "$ZINF" train --device cuda --dtype "$dtype" --model "$MODEL" --seq "$SEQ" \
    --batch "$BATCH" --steps "$STEPS" --stage 3 ${DATA[@]+"${DATA[@]}"} "$@" \
    --log-json "$WORK/train_$name.jsonl" >"$WORK/train_$name.log" 2>&1
}
NVME=(--offload-param nvme --offload-optimizer nvme --nvme-path "$SWAP_DIR")
train fp32 fp32 "${NVME[@]}"
TRAIN_RC=$?
train bf16 bf16 "${NVME[@]}"
TRAIN_BF16_RC=$?
train bf16_gpu bf16  # everything in GPU memory: the compute rate without NVMe
TRAIN_GPU_RC=$?
say "train rc fp32=$TRAIN_RC bf16=$TRAIN_BF16_RC bf16_gpu=$TRAIN_GPU_RC"
T2=$(date +%s)

python3 - "$WORK" "$BUILD_RC" "$GPU_TESTS_RC" "$DEVICE_RC" "$ADAM_RC" "$TRAIN_RC" "$T0" "$T1" "$T2" \
  "$SEQ" "$TRAIN_BF16_RC" "$TRAIN_GPU_RC" <<'PY' | tee "$WORK/summary.json"
import json, os, re, statistics, sys
(out, build_rc, tests_rc, device_rc, adam_rc, train_rc, t0, t1, t2, seq, bf16_rc,
 gpu_rc) = sys.argv[1:]
seq = int(seq)
def read(name):
    p = os.path.join(out, name)
    return open(p).read() if os.path.exists(p) else ""
def json_or_error(name, err):
    text = read(name).strip()
    try:
        return json.loads(text)
    except ValueError:
        return {"error": read(err).strip() or text}
def json_lines(name):  # a line cut short by a crash is skipped, not fatal
    rows = []
    for line in read(name).splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows
kernels = json_lines("kernels.jsonl")
# Model FLOPs per trained token: 6 N (forward and backward of every weight) + 12 L T D (the
# attention's two products per layer, forward and backward), from the banner's shape.
def training(dtype, rc):
    steps = [j for j in json_lines(f"train_{dtype}.jsonl") if "step" in j and "loss" in j]
    log = read(f"train_{dtype}.log")
    banner = re.search(r"L=(\d+) D=(\d+) H=\d+ T=\d+ V=(\d+)", log)
    flops_per_token = None
    if banner:
        L, D, V = (int(x) for x in banner.groups())
        n = 12 * L * D * D + 13 * L * D + V * D + seq * D + 2 * D
        flops_per_token = 6 * n + 12 * L * seq * D
    timed = steps[1:] if len(steps) > 1 else steps  # the first step records the schedule
    step_s = statistics.median(s.get("seconds", 0) for s in timed) if timed else None
    tok_s = statistics.median(s.get("tokens_per_s", 0) for s in timed) if timed else None
    return {
        "rc": int(rc),
        "steps": len(steps),
        "losses": [s["loss"] for s in steps],
        "step_seconds_median": step_s,
        "tokens_per_s_median": tok_s,
        "model_tflops": tok_s * flops_per_token / 1e12 if tok_s and flops_per_token else None,
        "nvme_read_over_minimum": [s["nvme_read_bytes"] / s["nvme_read_minimum_bytes"]
                                   for s in steps if s.get("nvme_read_minimum_bytes")],
        "tail": log.strip().splitlines()[-6:],
    }
device = json_or_error("device.json", "device.err")
torch_copies = json_or_error("torch_copy.json", "torch_copy.err")
def over_torch(key):  # zinf's copy rate over PyTorch's, measured in this run
    ours, theirs = device.get(key), torch_copies.get(key)
    return ours / theirs if ours and theirs else None
# The link's peak from nvidia-smi's "name, memory, pcie gen max, pcie width max": PCIe 3-6 at
# 8/16/32/64 GT/s per lane, 128b/130b encoding (PCIe 6's FLIT encoding is close enough here).
link_peak = None
fields = [f.strip() for f in read("gpu.txt").splitlines()[0].split(",")] if read("gpu.txt") else []
if len(fields) >= 4 and fields[2].isdigit() and fields[3].isdigit():
    gts = {3: 8e9, 4: 16e9, 5: 32e9, 6: 64e9}.get(int(fields[2]))
    if gts:
        link_peak = gts * int(fields[3]) * 128 / 130 / 8
summary = {
    "gpu": read("gpu.txt").strip(),
    "machine": read("machine.txt").strip().splitlines()[:3],
    "build_rc": int(build_rc), "build_seconds": int(t1) - int(t0),
    "gpu_tests_rc": int(tests_rc),
    "gpu_tests_tail": read("gpu_tests.log").strip().splitlines()[-8:],
    "kernels_vs_cpu": kernels,
    "copies": {k: device.get(k) for k in ("host_to_device_bytes_per_s",
               "device_to_host_bytes_per_s", "device_copy_bytes_per_s")} if "error" not in device
              else device,
    "pcie_peak_bytes_per_s": link_peak,
    "host_to_device_over_peak": (device.get("host_to_device_bytes_per_s") or 0) / link_peak
                                if link_peak else None,
    "device_to_host_over_peak": (device.get("device_to_host_bytes_per_s") or 0) / link_peak
                                if link_peak else None,
    "torch_copies": torch_copies,
    "host_to_device_over_torch": over_torch("host_to_device_bytes_per_s"),
    "device_to_host_over_torch": over_torch("device_to_host_bytes_per_s"),
    "adam": json_or_error("adam.json", "adam.err"),
    "train_fp32": training("fp32", train_rc),
    "train_bf16": training("bf16", bf16_rc),
    "train_bf16_in_gpu_memory": training("bf16_gpu", gpu_rc),
    "total_seconds": int(t2) - int(t0),
}
if int(build_rc):
    summary["build_tail"] = read("build.log").strip().splitlines()[-20:]
print(json.dumps(summary, indent=2))
PY
