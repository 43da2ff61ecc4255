#!/usr/bin/env bash
# Runs `zinf tune` and then re-measures, with `zinf bench io` in the same run, the setting it chose
# against the best settings it tried (its finalists: the best single trials), alternating them
# RUNS times because the disk is noisy. Each setting's score weights reads 2:1 against writes, as
# zinf tune scores them. Prints one JSON object: the tuning's time against its budget, each
# setting's median read/write/score, and chosen / best re-measured score.
#
#   bench/tune_check.sh DIR [BUDGET] [RUNS]
#     env: ZINF=path/to/zinf, SIZE=256M, PLOT=file.svg (the tuning's chart),
#          TUNE_JSON=file (keep the tuning's own JSON: every trial, the Adam rows, the fragment)
set -euo pipefail
DIR=${1:?usage: bench/tune_check.sh DIR [BUDGET] [RUNS]}
BUDGET=${2:-120}
RUNS=${3:-5}
ZINF=${ZINF:-build/cli/zinf}
SIZE=${SIZE:-256M}
[ -x "$ZINF" ] || { echo "$ZINF not found: build first (make build)" >&2; exit 1; }
mkdir -p "$DIR"
OUT=${TUNE_JSON:-$(mktemp)}
[ -n "${TUNE_JSON:-}" ] || trap 'rm -f "$OUT"' EXIT

"$ZINF" tune --nvme-path "$DIR" --budget "$BUDGET" --size "$SIZE" --json ${PLOT:+--plot "$PLOT"} >"$OUT"

# The finalists: distinct settings of the tuning's best single trials (chosen among them).
mapfile -t SETTINGS < <(python3 - "$OUT" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))["targets"][-1]
key = lambda s: (s["block_size"], s["queue_depth"], s["rings"], s["fixed_buffers"])
best = {}
for x in t["trials"]:
    k = key(x)
    best[k] = max(best.get(k, 0), x["score_bytes_per_s"])
top = sorted(best, key=lambda k: -best[k])[:3]
chosen = key(t["chosen"])
if chosen not in top:
    top.append(chosen)
for bs, qd, rings, fixed in top:
    print(f"{bs} {qd} {rings} {int(fixed)} {int((bs, qd, rings, fixed) == chosen)}")
PY
)

measure() {  # rw bs qd rings fixed -> bytes/s
  local flags=()
  [ "$5" = 1 ] || flags+=(--no-fixed-buffers)
  "$ZINF" bench io --path "$DIR" --size "$SIZE" --rw "$1" --block-size "$2" --queue-depth "$3" \
    --threads "$4" "${flags[@]}" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes_per_s"])'
}

RESULTS=$(mktemp)
if [ -n "${TUNE_JSON:-}" ]; then trap 'rm -f "$RESULTS"' EXIT; else trap 'rm -f "$OUT" "$RESULTS"' EXIT; fi
for ((i = 0; i < RUNS; i++)); do
  for s in "${SETTINGS[@]}"; do
    read -r bs qd rings fixed chosen <<<"$s"
    echo "$bs $qd $rings $fixed $chosen $(measure read "$bs" "$qd" "$rings" "$fixed") $(measure write "$bs" "$qd" "$rings" "$fixed")" >>"$RESULTS"
  done
done

python3 - "$OUT" "$RESULTS" "$RUNS" <<'PY'
import json, statistics, sys
tune = json.load(open(sys.argv[1]))
rows = {}
for line in open(sys.argv[2]):
    bs, qd, rings, fixed, chosen, r, w = line.split()
    rows.setdefault((int(bs), int(qd), int(rings), fixed == "1", chosen == "1"), []).append((float(r), float(w)))
out = []
for (bs, qd, rings, fixed, chosen), v in rows.items():
    r = statistics.median(x[0] for x in v)
    w = statistics.median(x[1] for x in v)
    score = statistics.median(3 / (2 / x[0] + 1 / x[1]) for x in v)
    out.append({"block_size": bs, "queue_depth": qd, "rings": rings, "fixed_buffers": fixed,
                "chosen": chosen, "read_bytes_per_s": r, "write_bytes_per_s": w,
                "score_bytes_per_s": score})
best = max(x["score_bytes_per_s"] for x in out)
mine = next(x["score_bytes_per_s"] for x in out if x["chosen"])
print(json.dumps({"tune_seconds": tune["seconds"], "budget_seconds": tune["budget_seconds"],
                  "within_budget": tune["seconds"] <= tune["budget_seconds"],
                  "runs": int(sys.argv[3]), "remeasured": out,
                  "chosen_over_best": mine / best}, indent=2))
PY
