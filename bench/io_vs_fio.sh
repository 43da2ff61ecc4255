#!/usr/bin/env bash
# Compares `zinf bench io` with fio (io_uring engine, direct=1) on the same path, same block
# size and queue depth, alternating the two several times because the disk is noisy, and prints
# the medians and the median of the per-pair ratios zinf/fio for each case.
#
# zinf's buffers are on transparent huge pages (docs/io.md); fio's are malloc'd, in 4 KiB pages
# unless THP is "always". With FIO_HUGE=1 (root) the script sets THP to "always" for its run
# (restoring the mode on exit) and aligns fio's buffers to 2 MiB (--iomem_align), so that both
# tools' buffers are on huge pages and the ratio compares the I/O engines alone.
#
#   bench/io_vs_fio.sh DIR [RUNS]   (env: ZINF=path/to/zinf, SIZE=1G, CASES="1M:8 1M:32 128K:32", FIO_HUGE=)
set -euo pipefail
DIR=${1:?usage: bench/io_vs_fio.sh DIR [RUNS]}
RUNS=${2:-5}
ZINF=${ZINF:-build/cli/zinf}
SIZE=${SIZE:-1G}
CASES=${CASES:-"1M:8 1M:32 128K:32"}
command -v fio >/dev/null || { echo "fio is not installed (make deps installs it)" >&2; exit 1; }
[ -x "$ZINF" ] || { echo "$ZINF not found: build first (make build)" >&2; exit 1; }
mkdir -p "$DIR"
FIOFILE="$DIR/fio-yardstick.dat"
THP=/sys/kernel/mm/transparent_hugepage/enabled
THP_WAS=$(sed -n 's/.*\[\(.*\)\].*/\1/p' "$THP" 2>/dev/null || true)
trap 'rm -f "$FIOFILE"; if [ -n "${FIO_HUGE:-}" ] && [ -n "$THP_WAS" ]; then echo "$THP_WAS" > "$THP"; fi' EXIT
FIO_MEM=()
if [ -n "${FIO_HUGE:-}" ]; then
  echo always 2>/dev/null > "$THP" || { echo "FIO_HUGE=1 needs to write $THP (root)" >&2; exit 1; }
  FIO_MEM=(--iomem_align=2M)
fi
THP_NOW=$(sed -n 's/.*\[\(.*\)\].*/\1/p' "$THP" 2>/dev/null || echo unknown)
if [ "$THP_NOW" = always ] && [ ${#FIO_MEM[@]} -gt 0 ]; then
  echo "fio's buffers: 2 MiB-aligned, transparent huge pages (THP always)"
else
  echo "fio's buffers: malloc, 4 KiB pages unless by chance (THP $THP_NOW); FIO_HUGE=1 puts them on huge pages"
fi

# Both tools start from a fresh file each run (zinf creates and removes its own; fio's is
# removed before each run), so neither is favoured by data the host still caches from earlier
# runs: reads go over a file laid out just before, writes into a freshly allocated file. Both
# lay the read file out the same way: direct writes of the case's block size and queue depth,
# then fsync (`zinf bench io` does; fio's own layout writes through the page cache, and on a
# virtual disk a file written that way reads back up to 1.5x faster, which would compare
# layouts, not I/O engines).
fio_bw() {  # rw bs qd -> bytes/s
  rm -f "$FIOFILE"
  if [ "$1" = read ]; then
    fio --name=layout --filename="$FIOFILE" --size="$SIZE" --rw=write --bs="$2" --iodepth="$3" \
        --ioengine=io_uring --direct=1 --end_fsync=1 --numjobs=1 >/dev/null 2>&1
  fi
  fio --name=yardstick --filename="$FIOFILE" --size="$SIZE" --rw="$1" --bs="$2" --iodepth="$3" \
      --ioengine=io_uring --direct=1 --numjobs=1 "${FIO_MEM[@]}" --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(j["read"]["bw_bytes"]+j["write"]["bw_bytes"])'
}
zinf_bw() {
  "$ZINF" bench io --path "$DIR" --size "$SIZE" --rw "$1" --block-size "$2" --queue-depth "$3" --json |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes_per_s"])'
}

printf "%-6s %-6s %-4s %14s %14s %12s   (medians of %d alternating runs, %s)\n" \
  rw bs qd "zinf GB/s" "fio GB/s" "zinf/fio" "$RUNS" "$SIZE"
for case in $CASES; do
  bs=${case%%:*}; qd=${case##*:}
  for rw in read write; do
    z=(); f=()
    # Which tool goes first alternates from run to run, so that a disk that is faster (or
    # slower) right after the other tool's run favours neither.
    for ((i = 0; i < RUNS; i++)); do
      if ((i % 2 == 0)); then
        f+=("$(fio_bw $rw $bs $qd)")
        z+=("$(zinf_bw $rw $bs $qd)")
      else
        z+=("$(zinf_bw $rw $bs $qd)")
        f+=("$(fio_bw $rw $bs $qd)")
      fi
    done
    python3 - "$rw" "$bs" "$qd" "${z[*]}" "${f[*]}" <<'PY'
import json, statistics, sys
rw, bs, qd = sys.argv[1:4]
z = [float(x) for x in sys.argv[4].split()]
f = [float(x) for x in sys.argv[5].split()]
ratios = [a / b for a, b in zip(z, f) if b > 0]
mz, mf, mr = statistics.median(z), statistics.median(f), statistics.median(ratios)
print(f"{rw:<6} {bs:<6} {qd:<4} {mz/1e9:14.3f} {mf/1e9:14.3f} {mr:12.3f}")
print(json.dumps({"rw": rw, "block_size": bs, "queue_depth": int(qd), "zinf_bytes_per_s": z,
                  "fio_bytes_per_s": f, "median_ratio": mr}), file=sys.stderr)
PY
  done
done
