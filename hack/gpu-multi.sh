#!/usr/bin/env bash
# Multi-process and multi-GPU cases on a bare node with two GPUs, as root, from the repository root:
#   OUT=dir hack/gpu-multi.sh [pytest args...]
# 1. node setup from the bundle (hack/gpu-node-setup.sh, which brings the sandbox up);
# 2. tests/gpu/test_multi_gpu.py (every case, one after the other; timeout $MULTI_TIMEOUT,
#    default 480 s; GiB per CUDA process $REKINDLE_MULTI_GPU_GIB, default 2);
# 3. the cases' records collected into one JSON array: $OUT/multi-gpu.json and
#    bench/results/h200x2/multi-gpu.json (case, outcome, reason, identical, restore_s,
#    cold_start_s, details).
# Also in $OUT: node.txt, setup.log, pytest.log, plugin-multi.log, containerd.log.
# NVLink multicast stays off in everything started here.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
t0=$(date +%s)
out=${OUT:-$root/gpu-multi-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

{
  uname -a; nproc; free -g; df -h / /dev/shm
  nvidia-smi --query-gpu=index,name,uuid,memory.used,memory.total --format=csv
  nvidia-smi topo -m
  cat /proc/driver/nvidia/version
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
} > "$out/node.txt" 2>&1

hack/gpu-node-setup.sh > "$out/setup.log" 2>&1 || { echo "setup failed"; tail -30 "$out/setup.log"; exit 1; }
# shellcheck disable=SC1091
. "${REKINDLE_BUNDLE_DIR:-/opt/rekindle-bundle}/env.sh"
echo "setup done in $(( $(date +%s) - t0 ))s"

# The store holds CRIU images as large as the GPU state: memory when /dev/shm has room.
gib=${REKINDLE_MULTI_GPU_GIB:-2}
shm_free=$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
if [ -z "${REKINDLE_GPU_E2E_DIR:-}" ]; then
  if [ "${shm_free:-0}" -ge $(( ${gib%.*} * 12 + 8 )) ]; then
    export REKINDLE_GPU_E2E_DIR=/dev/shm/rekindle-gpu-multi
  else
    export REKINDLE_GPU_E2E_DIR=/var/tmp/rekindle-gpu-multi
  fi
fi
rm -rf "$REKINDLE_GPU_E2E_DIR"
mkdir -p "$REKINDLE_GPU_E2E_DIR"
export REKINDLE_MULTI_GPU_RESULTS=$out/multi-gpu.jsonl
rm -f "$REKINDLE_MULTI_GPU_RESULTS"

t1=$(date +%s)
timeout "${MULTI_TIMEOUT:-480}" python3 -m pytest tests/gpu/test_multi_gpu.py -v -s -rs -p no:cacheprovider "$@" \
  > "$out/pytest.log" 2>&1
rc=$?
echo "pytest rc=$rc in $(( $(date +%s) - t1 ))s"
grep -E 'PASSED|FAILED|ERROR|SKIPPED|passed|failed|error' "$out/pytest.log" | tail -12

python3 - "$REKINDLE_MULTI_GPU_RESULTS" "$out/multi-gpu.json" bench/results/h200x2/multi-gpu.json <<'EOF'
import json, os, sys
src, *dests = sys.argv[1:]
cases = []
if os.path.exists(src):
    with open(src) as f:
        cases = [json.loads(line) for line in f if line.strip()]
for d in dests:
    os.makedirs(os.path.dirname(d), exist_ok=True)
    with open(d, "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")
for c in cases:
    print(f"{c['case']}: {c['outcome']} identical={c['identical']} restore_s={c['restore_s']} "
          f"cold_start_s={c['cold_start_s']} {c['reason'][:160]}")
EOF

sb=${REKINDLE_SANDBOX:-/var/lib/rekindle-sandbox}
tail -c 2000000 "$sb/containerd.log" > "$out/containerd.log" 2>/dev/null
rm -rf "$REKINDLE_GPU_E2E_DIR/plugin-multi/store"
python3 -m devtools.sandbox down > /dev/null 2>&1
echo "total $(( $(date +%s) - t0 ))s"
exit $rc
