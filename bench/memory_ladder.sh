#!/usr/bin/env bash
# The memory ladder: one process holding 4 local ranks of a 12-layer, width-768 GPT
# (gpt2-124m, 86 M parameters), 2 steps, each configuration given as a DeepSpeed config and no
# budget flags (the engine chooses budgets that fit the machine). Prints, per precision, the peak
# RSS of each configuration and its ratio to stage 0's, as JSON lines. One sequence of SEQ tokens
# (default 16) per rank and step: the ladder is about model state, and a short sequence keeps the
# activations (the same in every rung) from blurring it.
#
#   bash bench/memory_ladder.sh [build/cli/zinf] [swap dir]        (env: SEQ=16)
set -euo pipefail
ZINF=${1:-build/cli/zinf}
SWAP=${2:-.zinf/ladder-swap}
SEQ=${SEQ:-16}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK" "$SWAP"' EXIT
mkdir -p "$SWAP"

config() {  # stage, extra zero_optimization keys, precision block
  cat <<JSON
{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
 "zero_optimization": {"stage": $1 $2}, $3}
JSON
}
S3='"stage3_max_live_parameters": 2e7, "stage3_max_reuse_distance": 0'
NVME="\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \"$SWAP\", \"max_in_cpu\": 0},
      \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"$SWAP\"}"

for precision in fp32 bf16; do
  if [ "$precision" = bf16 ]; then P='"bf16": {"enabled": true}'; else P='"bf16": {"enabled": false}'; fi
  declare -A rss=()
  for rung in 0 1 2 3 3-nvme; do
    case $rung in
      3) extra=", $S3" ;;
      3-nvme) extra=", $S3, $NVME" ;;
      *) extra="" ;;
    esac
    config "${rung%%-*}" "$extra" "$P" > "$WORK/ds.json"
    /usr/bin/time -f "%M" -o "$WORK/rss" "$ZINF" train --model gpt2-124m --seq "$SEQ" --ranks 4 \
      --steps 2 --config "$WORK/ds.json" --quiet
    rss[$rung]=$(( $(cat "$WORK/rss") * 1024 ))
  done
  for rung in 0 1 2 3 3-nvme; do
    echo "{\"precision\": \"$precision\", \"config\": \"stage $rung\", \"peak_rss_bytes\": ${rss[$rung]}, \"vs_stage0\": $(awk -v a="${rss[$rung]}" -v b="${rss[0]}" 'BEGIN{printf "%.3f", a/b}')}"
  done
done
