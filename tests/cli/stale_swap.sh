#!/bin/sh
# zinf train removes, at start, the swap run directories of dead zinf processes made on this
# machine boot and pid namespace, and nothing else (cli/shutdown.h). The stale directories: one
# left by a real `zinf train` killed with SIGKILL, and one made here under the same host tag for
# a dead pid (with a file, a subdirectory and a symlink out, which must not be followed). Kept:
# the directories of live pids (this shell, pid 1), a dead pid's directory made elsewhere (another
# host tag: another node on a shared file system, a container) or with no host tag at all, a
# symlink named like a stale directory (not followed), and, as root, one owned by another user.
#
#   stale_swap.sh ZINF DIR
set -u
zinf=$1 dir=$2
rm -rf "$dir" && mkdir -p "$dir/swap" "$dir/target" || exit 1
echo keep > "$dir/target/f"
s=$dir/swap
"$zinf" train --model small --steps 100000 --stage 3 --offload-optimizer nvme --nvme-path "$s" \
  --quiet &
z=$!
i=0
while [ -z "$(ls -A "$s")" ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done
kill -9 $z
wait $z 2> /dev/null
killed=$(ls -A "$s")
tag=$(echo "$killed" | cut -d- -f3)
[ -n "$tag" ] || { echo "the killed run left no run directory"; exit 1; }
true &
dead=$!
wait $dead
mkdir -p "$s/zinf-$dead-$tag-x/sub" "$s/zinf-$$-$tag-live" "$s/zinf-1-$tag-init" \
  "$s/zinf-$dead-0badc0de-elsewhere" "$s/zinf-$dead-old"
head -c 10000 /dev/zero > "$s/zinf-$dead-$tag-x/swap-0.bin"
echo a > "$s/zinf-$dead-$tag-x/sub/f"
ln -s "$dir/target" "$s/zinf-$dead-$tag-x/escape"
ln -s "$dir/target" "$s/zinf-$dead-$tag-link"
touch "$s/zinf-$$-$tag-live/swap-0.bin" "$s/zinf-1-$tag-init/swap-0.bin"
if [ "$(id -u)" = 0 ]; then
  mkdir "$s/zinf-$dead-$tag-other" && chown 65534 "$s/zinf-$dead-$tag-other"
fi
"$zinf" train --model tiny --steps 1 --stage 3 --offload-optimizer nvme --nvme-path "$s" --quiet
echo "exit=$?"
test ! -e "$s/$killed" && test ! -e "$s/zinf-$dead-$tag-x" && echo "dead removed"
test -f "$s/zinf-$$-$tag-live/swap-0.bin" && test -f "$s/zinf-1-$tag-init/swap-0.bin" &&
  echo "live kept"
test -d "$s/zinf-$dead-0badc0de-elsewhere" && test -d "$s/zinf-$dead-old" && echo "foreign kept"
test -L "$s/zinf-$dead-$tag-link" && test -f "$dir/target/f" && echo "symlink kept"
if [ "$(id -u)" = 0 ]; then
  test -d "$s/zinf-$dead-$tag-other" && echo "other user kept"
else
  echo "other user not tested"
fi
