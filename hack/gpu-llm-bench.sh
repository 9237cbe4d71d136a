#!/usr/bin/env bash
# GPU benchmarks on a bare GPU node, as root, from the repository root, in one go:
#   OUT=dir hack/gpu-llm-bench.sh
# 1. node setup from the bundle (hack/gpu-node-setup.sh, which brings the sandbox up);
# 2. the synthetic same-GPU case of tests/gpu/test_gpu_e2e.py (REKINDLE_GPU_TEST_GIB, default 16;
#    timeout $E2E_TIMEOUT, default 170 s);
# 3. bench/llm_restore.py (the LLM server case) in the time left of $TOTAL_S (default 585 s).
# What lands in $OUT as it comes (few files, small): setup.log, e2e-pytest.log,
# gpu-e2e-gpu-holder.json, llm-restore.json, llm.log, then logs.tar.xz (plugin, containerd and
# worker logs).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
t0=$(date +%s)
out=${OUT:-$root/gpu-bench-out}
scratch=${REKINDLE_BENCH_SCRATCH:-/var/tmp/rekindle-bench-logs}
mkdir -p "$out" "$scratch/e2e" "$scratch/llm"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
total=${TOTAL_S:-585}
left() { echo $(( total - ($(date +%s) - t0) )); }

hack/gpu-node-setup.sh > "$out/setup.log" 2>&1 || { echo "setup failed"; tail -30 "$out/setup.log"; exit 1; }
# shellcheck disable=SC1091
. "${REKINDLE_BUNDLE_DIR:-/opt/rekindle-bundle}/env.sh"
echo "setup done at $(( $(date +%s) - t0 ))s; $(free -g | awk '/Mem/{print $2 "G mem"}'); $(df -h --output=avail /dev/shm /var/tmp | tr '\n' ' ')"

gib=${REKINDLE_GPU_TEST_GIB:-16}
shm_free=$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)
if [ "${shm_free:-0}" -ge $(( ${gib%.*} * 3 + 8 )) ]; then e2e_dir=/dev/shm/rekindle-gpu-e2e; else e2e_dir=/var/tmp/rekindle-gpu-e2e; fi
t1=$(date +%s)
REKINDLE_E2E_KEEP=1 REKINDLE_GPU_E2E_DIR=$e2e_dir REKINDLE_GPU_E2E_OUT=$scratch/e2e \
  timeout "${E2E_TIMEOUT:-170}" python3 -m pytest tests/gpu/test_gpu_e2e.py -x -v -s -rs -p no:cacheprovider \
  -k test_gpu_server_restored_into_another_pod > "$scratch/e2e-pytest.log" 2>&1
echo "e2e rc=$? in $(( $(date +%s) - t1 ))s (store $e2e_dir)"
tail -c 200000 "$scratch/e2e-pytest.log" > "$out/e2e-pytest.log"
cp "$scratch/e2e/gpu-e2e-gpu-holder.json" "$out/" 2>/dev/null
rm -rf "$e2e_dir/plugin/store"

t2=$(date +%s)
budget=$(( $(left) - 15 ))
echo "llm bench: ${budget}s"
timeout "$budget" python3 -m bench.llm_restore --out-dir "$scratch/llm" --json "$out/llm-restore.json" \
  --deadline-s $(( budget - 260 )) > "$out/llm.log" 2>&1
echo "llm rc=$? in $(( $(date +%s) - t2 ))s"
tail -12 "$out/llm.log"

cp "${REKINDLE_SANDBOX:-/var/lib/rekindle-sandbox}/containerd.log" "$scratch/" 2>/dev/null
cp "$e2e_dir/plugin/plugin.log" "$scratch/e2e/" 2>/dev/null
tar -C "$scratch" -cJf "$out/logs.tar.xz" . 2>/dev/null
echo "total $(( $(date +%s) - t0 ))s"
