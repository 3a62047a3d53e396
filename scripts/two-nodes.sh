#!/usr/bin/env bash
# Two nodes on one machine: two network namespaces joined by a veth pair, one `ddplab run` in each,
# talking gloo over the veth link exactly as two hosts on a network would. Needs root and iproute2.
#
#   sudo scripts/two-nodes.sh [options] TARGET [settings and flags for `ddplab run` ...]
#
#   -n N            worker processes per node (default 1)
#   --first 0|1     which node starts first (default 0)
#   --delay S       seconds between starting the first and the second node (default 0)
#   --port P        rendezvous port on node 0 (default 29500)
#   --nnodes SPEC   --nnodes of both nodes: 2 (default), or MIN:MAX for an elastic job
#   --kill-after W  SIGKILL node 1 (its agent and workers) W after both nodes started: W is a number
#                   of seconds, or a file's path (once that file exists)
#   --rejoin-after W  start node 1 again W after that kill (its log goes on in node1.log)
#   --rate R        shape the link to R each way with tc's tbf qdisc (e.g. 1gbit; default: unshaped)
#   --torchrun      start `python -m torch.distributed.run ... SCRIPT ARGS` on each node instead of
#                   `ddplab run` (to run another framework's script over the same link)
#
# Environment: PYTHON (default python3), NETNS (name prefix, default ddplab<pid>), LOG_DIR (where
# node0.log and node1.log go, default a temporary folder). Node 0 is 10.200.0.1, node 1 10.200.0.2:
# addresses that exist only inside these two namespaces. The namespaces are removed on exit,
# whatever happened. Exit code: 0 when both nodes succeeded, else the first failing node's code.
set -euo pipefail

nproc=1 first=0 delay=0 port=29500 rate="" torchrun=0 nnodes=2 kill_after="" rejoin_after=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n) nproc=$2; shift 2 ;;
    --first) first=$2; shift 2 ;;
    --delay) delay=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --nnodes) nnodes=$2; shift 2 ;;
    --kill-after) kill_after=$2; shift 2 ;;
    --rejoin-after) rejoin_after=$2; shift 2 ;;
    --torchrun) torchrun=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "two-nodes.sh: give a TARGET for ddplab run (see --help)" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "two-nodes.sh: needs root to create network namespaces; run it with sudo" >&2; exit 2; }
command -v ip >/dev/null || { echo "two-nodes.sh: needs iproute2 (apt-get install iproute2)" >&2; exit 2; }

python=${PYTHON:-python3}
prefix=${NETNS:-ddplab$$}
logs=${LOG_DIR:-$(mktemp -d)}
mkdir -p "$logs"
ns=("${prefix}n0" "${prefix}n1")
veth=("${prefix:0:11}v0" "${prefix:0:11}v1")
addr=(10.200.0.1 10.200.0.2)
pids=()

cleanup() {
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
}
trap cleanup EXIT

for i in 0 1; do ip netns add "${ns[$i]}"; done
ip link add "${veth[0]}" type veth peer name "${veth[1]}"
for i in 0 1; do
  ip link set "${veth[$i]}" netns "${ns[$i]}"
  ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "${veth[$i]}"
  ip -n "${ns[$i]}" link set "${veth[$i]}" up
  ip -n "${ns[$i]}" link set lo up
  if [[ -n $rate ]]; then
    # a token bucket on each end's egress: the link carries at most $rate each way
    ip netns exec "${ns[$i]}" tc qdisc replace dev "${veth[$i]}" root tbf rate "$rate" burst 256kb latency 50ms
  fi
done

pause() {  # a number of seconds, or until a file exists
  if [[ $1 =~ ^[0-9.]+$ ]]; then sleep "$1"; else while [[ ! -e $1 ]]; do sleep 0.2; done; fi
}

start_node() {  # each node in its own process group, so cleanup can end its workers too
  local i=$1; shift
  if [[ $torchrun -eq 1 ]]; then
    setsid ip netns exec "${ns[$i]}" env GLOO_SOCKET_IFNAME="${veth[$i]}" "$python" -m torch.distributed.run \
      --nnodes 2 --nproc-per-node "$nproc" --node-rank "$i" --master-addr "${addr[0]}" --master-port "$port" \
      "$@" >"$logs/node$i.log" 2>&1 &
  else
    setsid ip netns exec "${ns[$i]}" "$python" -m ddplab run "$@" --nnodes "$nnodes" --nproc-per-node "$nproc" \
      --node-rank "$i" --rdzv-endpoint "${addr[0]}:$port" >>"$logs/node$i.log" 2>&1 &
  fi
  pids[$i]=$!
}

second=$((1 - first))
: >"$logs/node0.log"
: >"$logs/node1.log"
start_node "$first" "$@"
sleep "$delay"
start_node "$second" "$@"
if [[ -n $kill_after ]]; then
  # node 1 dies as a machine does: its agent and workers at once, with no word to anyone
  pause "$kill_after"
  kill -KILL -- "-${pids[1]}" 2>/dev/null || true
  wait "${pids[1]}" 2>/dev/null || true
  if [[ -n $rejoin_after ]]; then
    pause "$rejoin_after"
    echo "===== node 1 joins again =====" >>"$logs/node1.log"
    start_node 1 "$@"
  else
    pids[1]=""
  fi
fi

status=0
for i in "$first" "$second"; do
  [[ -n ${pids[$i]} ]] || continue
  code=0
  wait "${pids[$i]}" || code=$?
  [[ $status -eq 0 && $code -ne 0 ]] && status=$code
done
for i in 0 1; do
  echo "===== node $i (${addr[$i]}) ====="
  cat "$logs/node$i.log"
done
exit "$status"
