#!/usr/bin/env bash
# The restore-speed benchmark (bench/restore_speed.py), and optionally the GPU tests, on a bare GPU
# node, as root, from the repository root, in one call:
#   CASES="synthetic-16gib llm-7b" TESTS=1 OUT=dir hack/gpu-speed.sh
# 1. node set-up from the bundle (hack/gpu-node-setup.sh: containerd, runc, CRIU, CNI, wheels,
#    the sandbox up);
# 2. with TESTS=1, tests/gpu (CUDA checkpoint API and the containerd end-to-end cases);
# 3. with DISK_QUEUE=1, bench/disk_queue.py (how the restore's read shapes share the disk);
# 4. each case of $CASES (default synthetic-16gib; "" none) with $RUNS (bench/restore_speed.py --runs),
#    and with RECHECKPOINT=always,keep the running source checkpointed once more in each THP mode;
# 5. labs outside containerd: with DUMP_BYPASS=GIB, bench/dump_bypass.py on a CUDA-checkpointed
#    process of GIB GiB (CRIU's whole dump against N threads reading beside an incremental one);
#    with CUDA_PARALLEL=N, bench/cuda_restore_parallel.py (N driver restores at once against one);
# 6. with SCALE=N, bench/scale_out.py: N pods restored at once from one artifact, case $SCALE_CASE
#    (default llm-7b), rounds $SCALE_ROUNDS (its --rounds), within $SCALE_TIMEOUT (default 500) s;
#    REKINDLE_STREAM_THREADS and REKINDLE_STREAM_WARM_REST, when set, are handed on to its plugin.
# What lands in $OUT (few files: a call brings back eight at most): restore-speed-<case>.json,
# disk-queue.json, dump-bypass.json, cuda-parallel.json, scale-out.json, and logs.tar.xz (node.txt,
# setup.log, gpu-tests.log, speed-<case>.log, the labs' logs, scale-out.log, and the plugin, worker
# and CRIU logs).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-speed-out}
scratch=/var/tmp/rekindle-speed-logs
mkdir -p "$out" "$scratch"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s)
{ uname -a; nproc; free -g; df -h / /dev/shm /var/tmp; nvidia-smi; cat /sys/kernel/mm/transparent_hugepage/enabled;
  grep -i soft_dirty "/boot/config-$(uname -r)"; } \
  > "$scratch/node.txt" 2>&1
hack/gpu-node-setup.sh > "$scratch/setup.log" 2>&1 || { echo "setup failed"; tail -40 "$scratch/setup.log"; exit 1; }
# shellcheck disable=SC1091
. "${REKINDLE_BUNDLE_DIR:-/opt/rekindle-bundle}/env.sh"
echo "setup done at $(( $(date +%s) - t0 ))s"
rc=0
if [ "${TESTS:-0}" = 1 ]; then
  REKINDLE_E2E_KEEP=1 REKINDLE_GPU_E2E_OUT=$scratch timeout "${TESTS_TIMEOUT:-300}" \
    python3 -m pytest tests/gpu -x -v -rs -p no:cacheprovider > "$scratch/gpu-tests.log" 2>&1 || rc=1
  grep -E "passed|failed|skipped|error" "$scratch/gpu-tests.log" | tail -5
  echo "gpu tests done at $(( $(date +%s) - t0 ))s (rc=$rc)"
fi
if [ "${DISK_QUEUE:-0}" = 1 ]; then
  python3 -m bench.disk_queue --file /var/tmp/rekindle-disk-queue.bin --json "$out/disk-queue.json" \
    > "$scratch/disk-queue.log" 2>&1 || rc=1
  tail -9 "$scratch/disk-queue.log"
  rm -rf /var/tmp/rekindle-disk-queue.bin*
  echo "disk queue done at $(( $(date +%s) - t0 ))s"
fi
for case in ${CASES-synthetic-16gib}; do  # CASES="" runs none
  timeout "${CASE_TIMEOUT:-540}" python3 -m bench.restore_speed --case "$case" \
    ${RUNS:+--runs "$RUNS"} ${RECHECKPOINT:+--recheckpoint "$RECHECKPOINT"} --out-dir "$scratch/$case" --json "$out/restore-speed-$case.json" \
    > "$scratch/speed-$case.log" 2>&1 || rc=1
  grep -vE "^[0-9-]+ [0-9:,]+ " "$scratch/speed-$case.log" | tail -40
  echo "$case done at $(( $(date +%s) - t0 ))s"
done
if [ -n "${DUMP_BYPASS:-}" ]; then
  timeout "${LAB_TIMEOUT:-300}" python3 -m bench.dump_bypass --gpu-gib "$DUMP_BYPASS" \
    ${DUMP_ROUNDS:+--rounds "$DUMP_ROUNDS"} ${DUMP_THREADS:+--threads "$DUMP_THREADS"} ${DUMP_DIR:+--dir "$DUMP_DIR"} \
    --json "$out/dump-bypass.json" > "$scratch/dump-bypass.log" 2>&1 || rc=1
  tail -12 "$scratch/dump-bypass.log"
  echo "dump bypass done at $(( $(date +%s) - t0 ))s"
fi
if [ -n "${CUDA_PARALLEL:-}" ]; then
  timeout "${LAB_TIMEOUT:-300}" python3 -m bench.cuda_restore_parallel --procs "$CUDA_PARALLEL" \
    ${CUDA_PARALLEL_GIB:+--gib "$CUDA_PARALLEL_GIB"} ${CUDA_PARALLEL_ROUNDS:+--rounds "$CUDA_PARALLEL_ROUNDS"} \
    --json "$out/cuda-parallel.json" > "$scratch/cuda-parallel.log" 2>&1 || rc=1
  tail -12 "$scratch/cuda-parallel.log"
  echo "cuda parallel done at $(( $(date +%s) - t0 ))s"
fi
if [ -n "${SCALE:-}" ]; then
  timeout "${SCALE_TIMEOUT:-500}" python3 -m bench.scale_out --case "${SCALE_CASE:-llm-7b}" --pods "$SCALE" \
    ${SCALE_ROUNDS:+--rounds "$SCALE_ROUNDS"} --out-dir "$scratch/scale-out" --json "$out/scale-out.json" \
    > "$scratch/scale-out.log" 2>&1 || rc=1
  grep -vE "^[0-9-]+ [0-9:,]+ " "$scratch/scale-out.log" | tail -40
  echo "scale-out done at $(( $(date +%s) - t0 ))s"
fi
find /var/lib/rekindle-sandbox/containerd.log "$scratch" \( -name '*.log' -o -name '*.txt' \) -size -20M 2>/dev/null \
  | tar -cJf "$out/logs.tar.xz" -T - 2>/dev/null
exit $rc
