#!/usr/bin/env bash
# GPU end-to-end run on a bare GPU node, from the repository root, as root:
#   hack/gpu-e2e.sh [pytest args...]
# sets the node up from the bundle (hack/gpu-node-setup.sh), runs tests/gpu/test_gpu_e2e.py
# (-x -v), then copies the logs and timings to $OUT (default ./gpu-e2e-out): pytest.log,
# node.txt, setup.log, plugin.log, containerd.log, dmesg.txt, gpu-e2e-*.json, criu-logs.tar.xz (CRIU's
# logs and the pods' own).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-e2e-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The artifact store holds CRIU images as large as the GPU state: memory when /dev/shm has room
# for three times it, else local disk.
gib=${REKINDLE_GPU_TEST_GIB:-16}
shm_free=$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
if [ -z "${REKINDLE_GPU_E2E_DIR:-}" ]; then
  if [ "${shm_free:-0}" -ge $(( ${gib%.*} * 3 + 8 )) ]; then
    export REKINDLE_GPU_E2E_DIR=/dev/shm/rekindle-gpu-e2e
  else
    export REKINDLE_GPU_E2E_DIR=/var/tmp/rekindle-gpu-e2e
  fi
fi
echo "store: $REKINDLE_GPU_E2E_DIR (/dev/shm free ${shm_free:-?}G)"
export REKINDLE_GPU_E2E_OUT=$out
t0=$(date +%s)

{
  uname -a; nproc; free -g; df -h / /dev/shm
  nvidia-smi --query-gpu=index,name,uuid,memory.used,memory.total --format=csv
  cat /proc/driver/nvidia/version
  echo "python: $(command -v python3) -> $(readlink -f "$(command -v python3)")"
  python3 -c 'import sys, torch; print(sys.prefix, sys.base_prefix, torch.__version__)'
  echo "cgroup: $(stat -fc %T /sys/fs/cgroup) $(cat /proc/self/cgroup)"
  findmnt -rno TARGET,FSTYPE,OPTIONS | grep -E '^/usr|^/opt|^/etc' || true
  ls -la /usr/local/nvidia /usr/local/nvidia/lib64 2>&1 | head -30
  ls -la /dev/nvidia* /dev/nvidia-caps 2>&1
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; ldconfig -p | grep -E 'libcuda\.so|libnvidia-ml' || true
  cat /etc/ld.so.conf.d/*.conf 2>/dev/null
  for t in iptables ip nsenter unshare mknod tar xz; do printf '%s=%s ' "$t" "$(command -v $t)"; done; echo
} > "$out/node.txt" 2>&1

hack/gpu-node-setup.sh > "$out/setup.log" 2>&1
rc=$?
tail -5 "$out/setup.log"
echo "setup rc=$rc in $(( $(date +%s) - t0 ))s"
if [ $rc -ne 0 ]; then
  cat "$out/setup.log"
  exit $rc
fi
# shellcheck disable=SC1091
. "${REKINDLE_BUNDLE_DIR:-/opt/rekindle-bundle}/env.sh"

t1=$(date +%s)
timeout "${REKINDLE_GPU_E2E_TIMEOUT:-480}" python3 -m pytest tests/gpu/test_gpu_e2e.py -x -v -s -rs \
  -p no:cacheprovider "$@" > "$out/pytest.log" 2>&1
rc=$?
echo "pytest rc=$rc in $(( $(date +%s) - t1 ))s"
grep -E 'PASSED|FAILED|ERROR|SKIPPED|passed|failed|error' "$out/pytest.log" | tail -15

sb=${REKINDLE_SANDBOX:-/var/lib/rekindle-sandbox}
cp "$sb/containerd.log" "$out/" 2>/dev/null
dmesg 2>/dev/null | tail -200 > "$out/dmesg.txt"  # a workload's own crash (segfault, OOM kill) is told here
logs=$(find "$REKINDLE_GPU_E2E_DIR" /var/log/pods "$sb/pod-logs" -name '*.log' -size -20M 2>/dev/null | grep -v '/store/')
[ -n "$logs" ] && tar -cJf "$out/criu-logs.tar.xz" $logs 2>/dev/null
python3 -m devtools.sandbox down > /dev/null 2>&1
echo "total $(( $(date +%s) - t0 ))s"
exit $rc
