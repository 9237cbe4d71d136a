#!/usr/bin/env bash
# Local single-node sandbox: a private containerd with CRI, NRI and a CNI bridge.
#
#   hack/sandbox.sh up [--runtime 1.7|2.1|2.2|2.4] start it (state under ${REKINDLE_SANDBOX:-/var/lib/rekindle-sandbox})
#   hack/sandbox.sh down [--purge]           remove pods, stop containerd, clean up
#   hack/sandbox.sh status                   JSON status (exit 3 when not running)
#   eval "$(hack/sandbox.sh env)"            export CONTAINERD_ADDRESS, REKINDLE_NRI_SOCKET, ...
#
# The logic lives in devtools/sandbox.py; this only finds the Python. Needs root.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
cd "$root"
exec "$py" -m devtools.sandbox "$@"
