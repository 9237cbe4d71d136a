#!/usr/bin/env bash
# The engine-shaped worker's footprint on a bare GPU node, as root, from the repository root:
#   OUT=dir hack/gpu-footprint.sh
# 1. hack/gpu-e2e.sh with tests/gpu/test_engine.py only: the release path at
#    REKINDLE_ENGINE_FRACTIONS (default 0.4) and the transparent path at
#    REKINDLE_ENGINE_TRANSPARENT (default 0.25 of a GPU of more than 100 GiB, else 0.4: its dump
#    is as large as the reservation, and the store is in memory);
# 2. bench/compression.py on 2 GiB of the model's weights, on every core (zstandard from a wheel
#    in .carry/ where the node's Python lacks it).
# $OUT gets gpu-e2e.sh's files, engine-*.json, compression.json and compression.log.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-footprint-out}
mkdir -p "$out"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mib:-0}" -gt 102400 ]; then big=0.25; else big=0.4; fi
export REKINDLE_ENGINE_TRANSPARENT=${REKINDLE_ENGINE_TRANSPARENT:-$big}
echo "GPU ${mib} MiB; release at ${REKINDLE_ENGINE_FRACTIONS:-0.4}, transparent at $REKINDLE_ENGINE_TRANSPARENT"
OUT=$out REKINDLE_GPU_E2E_TIMEOUT=${REKINDLE_GPU_E2E_TIMEOUT:-480} \
  hack/gpu-e2e.sh tests/gpu/test_engine.py -k engine --maxfail=5
rc=$?

if ! python3 -c "import zstandard" 2>/dev/null; then
  wheel=$(ls .carry/zstandard-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] && python3 -m pip install -q --no-deps --target /tmp/rekindle-zstd "$wheel" \
    && export PYTHONPATH=/tmp/rekindle-zstd${PYTHONPATH:+:$PYTHONPATH}
fi
model=${REKINDLE_LLM_MODEL_DIR:-/var/tmp/rekindle-llm-model}
timeout "${COMPRESSION_TIMEOUT:-150}" python3 -m bench.compression --sample "$model"/*.safetensors --mib 2048 \
  --json "$out/compression.json" > "$out/compression.log" 2>&1
echo "compression rc=$?"; tail -6 "$out/compression.log"
exit $rc
