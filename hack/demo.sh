#!/usr/bin/env bash
# The README's demo command, as root: set the node up (hack/setup.sh: installs what is missing,
# else only re-checks), then run hack/demo.py: containerd with NRI + the Rekindle plugin, a pod
# checkpointed and a new pod restored from it, with timings.
#
#   hack/demo.sh [--warmup-mib MIB] [--passes N] [--keep]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" -eq 0 ] || { echo "demo.sh: run as root (it starts containerd)" >&2; exit 1; }
"$root/hack/setup.sh"
exec "${REKINDLE_VENV:-$root/.venv}/bin/python" "$root/hack/demo.py" "$@"
