#!/usr/bin/env bash
# The pre-warm benchmark (bench/prewarming.py) on a bare GPU node, as root, from the repository
# root, in one call:
#   OUT=dir [CASE=llm-7b] [PAIRS=1] [TOTAL_S=420] hack/gpu-prewarm.sh
# 1. node set-up from the bundle (hack/gpu-node-setup.sh: containerd, runc, CRIU, CNI, wheels,
#    the sandbox up);
# 2. python -m bench.prewarming --case $CASE (default llm-7b) --pairs $PAIRS in what is left of
#    $TOTAL_S (default 420 s, the set-up included): its --deadline-s skips a step that would not
#    end 30 s before then, and timeout ends it there (SIGTERM: it still cleans up).
# What lands in $OUT: prewarm.json (written after every step), prewarm.log, and logs.tar.xz
# (node.txt, setup.log, the plugin's, the workers', CRIU's and containerd's logs).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
t0=$(date +%s)
out=${OUT:-$root/gpu-prewarm-out}
scratch=${REKINDLE_BENCH_SCRATCH:-/var/tmp/rekindle-prewarm-logs}
mkdir -p "$out" "$scratch"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
total=${TOTAL_S:-420}
left() { echo $(( total - ($(date +%s) - t0) )); }

{ uname -a; nproc; free -g; df -h / /dev/shm /var/tmp; nvidia-smi; cat /sys/block/*/queue/scheduler; } \
  > "$scratch/node.txt" 2>&1
hack/gpu-node-setup.sh > "$scratch/setup.log" 2>&1 || { echo "setup failed"; tail -40 "$scratch/setup.log"; exit 1; }
# shellcheck disable=SC1091
. "${REKINDLE_BUNDLE_DIR:-/opt/rekindle-bundle}/env.sh"
echo "setup done at $(( $(date +%s) - t0 ))s"

budget=$(( $(left) - 10 ))
if [ "$budget" -lt 120 ]; then
  echo "only ${budget}s left of TOTAL_S=$total: no bench run"
  exit 1
fi
timeout -k 20 "$budget" python3 -m bench.prewarming --case "${CASE:-llm-7b}" --pairs "${PAIRS:-1}" \
  --deadline-s $(( budget - 30 )) --out-dir "$scratch/prewarm" --json "$out/prewarm.json" \
  > "$scratch/prewarm.log" 2>&1
rc=$?
echo "prewarm rc=$rc at $(( $(date +%s) - t0 ))s"
grep -vE "^[0-9-]+ [0-9:,]+ " "$scratch/prewarm.log" | tail -60
tail -c 300000 "$scratch/prewarm.log" > "$out/prewarm.log"
find /var/lib/rekindle-sandbox/containerd.log "$scratch" \( -name '*.log' -o -name '*.txt' \) -size -20M 2>/dev/null \
  | tar -cJf "$out/logs.tar.xz" -T - 2>/dev/null
exit $rc
