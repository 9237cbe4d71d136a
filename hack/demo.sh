#!/usr/bin/env bash
# The README's demo: containerd with NRI + the Rekindle plugin, a pod checkpointed and a new pod
# restored from it, with timings. Run hack/setup.sh once before.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
exec "${REKINDLE_VENV:-$root/.venv}/bin/python" "$root/hack/demo.py" "$@"
