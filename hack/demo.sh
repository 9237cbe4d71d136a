#!/usr/bin/env bash
# The README's demo command, as root: set the node up (hack/setup.sh: installs what is missing,
# else only re-checks), then run devtools/demo.py: containerd with NRI + the Rekindle plugin, a pod
# checkpointed and a new pod restored from it, with timings.
#
#   hack/demo.sh [--warmup-mib MIB] [--passes N] [--restore-path bulk|stock|stream] [--keep]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" -eq 0 ] || { echo "demo.sh: run as root (it starts containerd)" >&2; exit 1; }
"$root/hack/setup.sh"
# The demo runs in the sandbox the end-to-end tests use: take their lock (tests/e2e/conftest.py),
# held by flock itself (-o), so that containerd started by the demo does not keep it.
lock=/run/lock/rekindle-e2e.lock
mkdir -p "$(dirname "$lock")"
flock -n "$lock" true || echo "demo.sh: waiting for the test session that uses the sandbox ($lock)"
cd "$root"
exec flock -o "$lock" "${REKINDLE_VENV:-$root/.venv}/bin/python" -m devtools.demo "$@"
