#!/bin/sh
# One run, one voice: `zinf train` started by a launcher, one process per rank, prints one banner,
# one progress line per reported step and one summary whose memory table has every rank's row
# filled (gathered through the communicator), and only rank 0 writes the JSON log, ending with
# every rank's memory row.
#
#   one_voice.sh MPIEXEC ZINF DIR openmpi|slurm|gloo
# slurm: the same mpirun launch with the variables srun sets instead of OpenMPI's (MPI itself
# still starts through mpirun's PMIx), so that the rank and world come from SLURM_*.
# gloo: no mpirun; two processes started with torchrun's variables (MPIEXEC is not used), which
# meet through rank 0's TCP store on a free loopback port and run on the Gloo backend.
set -u
mpiexec=$1 zinf=$2 dir=$3 mode=$4
rm -rf "$dir" && mkdir -p "$dir" || exit 1
backend=mpi
if [ "$mode" = slurm ]; then
  wrap='export SLURM_PROCID=$OMPI_COMM_WORLD_RANK SLURM_NTASKS=$OMPI_COMM_WORLD_SIZE SLURM_LOCALID=$OMPI_COMM_WORLD_LOCAL_RANK; unset OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_RANK; exec "$@"'
  source_name="Slurm variables"
elif [ "$mode" = gloo ]; then
  source_name="torchrun variables"
  backend=gloo
else
  wrap='exec "$@"'
  source_name="OpenMPI variables"
fi
args="train --model tiny --steps 20 --stage 3 --log-json $dir/log.json"
if [ "$mode" = gloo ]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for r in 0 1; do
    env -u ZINF_COMM RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
      MASTER_PORT="$port" "$zinf" $args > "$dir/out$r" 2>&1 &
    eval "pid$r=\$!"
  done
  wait "$pid0"; rc0=$?
  wait "$pid1"; rc1=$?
  rc=$((rc0 | rc1))
  cat "$dir/out0" "$dir/out1" > "$dir/out"
else
  "$mpiexec" --allow-run-as-root --oversubscribe -np 2 sh -c "$wrap" sh "$zinf" $args \
    > "$dir/out" 2>&1
  rc=$?
fi
cat "$dir/out"
fail() { echo "one_voice: $*"; exit 1; }
[ $rc -eq 0 ] || fail "exit $rc"
[ "$(grep -c '^zinf train:' "$dir/out")" -eq 1 ] || fail "not one banner"
grep -q "^zinf train: .*2 ranks ($source_name, $backend backend)" "$dir/out" ||
  fail "banner: world/source"
[ "$(grep -c '^settings ' "$dir/out")" -eq 1 ] || fail "not one settings block"
[ "$(grep -c '^step 20/20 ' "$dir/out")" -eq 1 ] || fail "not one last progress line"
[ "$(grep -c '^loss .* -> ' "$dir/out")" -eq 1 ] || fail "not one summary"
# The memory table: a row per rank, each with device bytes (no "0 B" device column).
for r in 0 1; do
  row=$(awk -v r="$r" '/^Memory per rank/ { t = 1; next } t && $1 == r { print; exit }' "$dir/out")
  [ -n "$row" ] || fail "no memory row for rank $r"
  # The device column: "708.00 KiB", never "0 B" (the row of a rank nobody reported).
  echo "$row" | awk '{ exit !($2 + 0 > 0) }' || fail "rank $r's memory row is empty: $row"
done
python3 - "$dir/log.json" <<'PY' || fail "log"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = [l for l in lines if "step" in l]
assert [s["step"] for s in steps] == list(range(1, 21)), "one line per step, from rank 0 only"
rows = lines[-1]["memory_per_rank"]
assert [r["rank"] for r in rows] == [0, 1], rows
assert all(r["peak_bytes_device"] > 0 for r in rows), rows
PY
echo "one voice"
