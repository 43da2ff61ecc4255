#!/bin/sh
# A run across two "hosts": two network namespaces joined by a veth pair (10.213.R.1 and
# 10.213.R.2), made here and removed on exit. A ZeRO-3 run with parameters and optimizer on NVMe,
# 2 processes (one per host) and 4 (two per host), must give the same exported weights, byte for
# byte, as the same run with local ranks, and the link must have carried at least the run's ZeRO
# volume. Two launches:
#   mpi   mpirun starts inside the first namespace; its launch agent (in place of ssh) enters the
#         second with `ip netns exec`. MPI may only use TCP over that link (no shared memory), so
#         every collective crosses it.
#   gloo  no MPI: each rank is started by hand in its namespace with torchrun's variables
#         (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR = the first host's address),
#         meets the others through rank 0's TCP store (with a token, as it listens beyond
#         loopback), and Gloo connects the ranks over the link.
#
#   two_hosts.sh mpi|gloo MPIEXEC ZINF DIR     (MPIEXEC is not used for gloo)
# Exits 77 (skipped) where network namespaces cannot be made (no root, no `ip`, no netns support).
set -u
mode=$1 mpiexec=$2 zinf=$3 dir=$4
command -v ip > /dev/null 2>&1 || { echo "skipped: no ip command"; exit 77; }
tag=$$
ns1=zinf-h1-$tag ns2=zinf-h2-$tag
v1=zv1-$tag v2=zv2-$tag
net=10.213.$((tag % 250 + 1))
a1=$net.1 a2=$net.2
cleanup() {
  ip netns del "$ns1" 2> /dev/null
  ip netns del "$ns2" 2> /dev/null
}
trap cleanup EXIT
trap 'exit 1' INT TERM
if ! ip netns add "$ns1" 2> /dev/null; then
  echo "skipped: cannot create a network namespace here"
  exit 77
fi
if ! ip link add "$v1" type veth peer name "$v2" 2> /dev/null; then
  echo "skipped: cannot create a veth pair here"
  exit 77
fi
set -e
ip netns add "$ns2"
ip link set "$v1" netns "$ns1"
ip link set "$v2" netns "$ns2"
ip -n "$ns1" addr add "$a1/24" dev "$v1"
ip -n "$ns2" addr add "$a2/24" dev "$v2"
for ns in "$ns1" "$ns2"; do ip -n "$ns" link set lo up; done
ip -n "$ns1" link set "$v1" up
ip -n "$ns2" link set "$v2" up
set +e

rm -rf "$dir" && mkdir -p "$dir/swap" "$dir/swap-local" || exit 1
# The launch agent: called as `agent HOST COMMAND...` like ssh; runs COMMAND in HOST's namespace.
cat > "$dir/agent" << EOF
#!/bin/sh
host=\$1; shift
case "\$host" in
  $a1) ns=$ns1 ;;
  $a2) ns=$ns2 ;;
  *) echo "agent: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" sh -c "\$*"
EOF
chmod +x "$dir/agent"

link_bytes() {
  ip netns exec "$ns1" cat "/sys/class/net/$v1/statistics/tx_bytes" \
    "/sys/class/net/$v1/statistics/rx_bytes" | awk '{ s += $1 } END { print s }'
}

train="train --model small --steps 6 --stage 3 --dtype bf16 --offload-param nvme --offload-optimizer nvme --quiet"
status=0
for np in 2 4; do
  per_host=$((np / 2))
  "$zinf" $train --ranks "$np" --nvme-path "$dir/swap-local" --export "$dir/local-$np.safetensors" ||
    { echo "local run of $np ranks failed"; exit 1; }
  before=$(link_bytes)
  if [ "$mode" = mpi ]; then
    ip netns exec "$ns1" env ZINF_COMM_TIMEOUT=120 "$mpiexec" --allow-run-as-root --oversubscribe \
      -np "$np" --host "$a1:$per_host,$a2:$per_host" \
      --mca plm_rsh_agent "$dir/agent" --mca plm_rsh_no_tree_spawn 1 \
      --mca btl tcp,self --mca btl_tcp_if_include "$net.0/24" --mca oob_tcp_if_include "$net.0/24" \
      -x ZINF_COMM_TIMEOUT \
      "$zinf" $train --nvme-path "$dir/swap" --export "$dir/hosts-$np.safetensors"
  else
    token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    pids=
    r=0
    while [ $r -lt "$np" ]; do
      if [ $r -lt $per_host ]; then ns=$ns1; else ns=$ns2; fi
      ip netns exec "$ns" env -u ZINF_COMM RANK=$r WORLD_SIZE="$np" LOCAL_RANK=$((r % per_host)) \
        LOCAL_WORLD_SIZE=$per_host MASTER_ADDR="$a1" MASTER_PORT=29500 ZINF_STORE_TOKEN="$token" \
        ZINF_COMM_TIMEOUT=120 \
        "$zinf" $train --nvme-path "$dir/swap" --export "$dir/hosts-$np.safetensors" &
      pids="$pids $!"
      r=$((r + 1))
    done
    failed=0
    for p in $pids; do wait "$p" || failed=1; done
    [ $failed -eq 0 ]
  fi
  rc=$?
  carried=$(($(link_bytes) - before))
  # The run's ZeRO volume at stage 3, bf16: 3 x P x 2 bytes per step, over 6 steps; of it a rank
  # sends and receives (n-1)/n. Half the ranks are across the link, so at least a quarter of it.
  params=$("$zinf" train --model small --describe | python3 -c 'import json,sys; print(json.load(sys.stdin)["parameters"])')
  least=$((3 * params * 2 * 6 / 4))
  if [ $rc -ne 0 ]; then
    echo "$np processes on 2 hosts: exit $rc"
    status=1
  elif ! cmp "$dir/local-$np.safetensors" "$dir/hosts-$np.safetensors"; then
    echo "$np processes on 2 hosts: exported weights differ from $np local ranks"
    status=1
  elif [ "$carried" -lt "$least" ]; then
    echo "$np processes on 2 hosts: the link carried $carried bytes, less than $least"
    status=1
  else
    echo "$np processes on 2 hosts ($per_host per host): identical to $np local ranks; the link carried $carried bytes (at least $least)"
  fi
  [ -z "$(ls -A "$dir/swap")" ] || { echo "swap left behind: $(ls "$dir/swap")"; status=1; }
done
[ $status -eq 0 ] && echo "two hosts ($mode): identical"
exit $status
