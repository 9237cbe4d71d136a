#!/usr/bin/env bash
# The README's test command, as root: set the node up (hack/setup.sh: installs what is missing,
# else only re-checks), then run the whole test suite with the project's pytest.
#
#   hack/test.sh [PYTEST ARGS...]      e.g. hack/test.sh tests/unit -q, hack/test.sh -k restore
#
# CI runs it through .ci/run. The exit status is pytest's: any failure, and 5 (no tests
# collected), fail the run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" -eq 0 ] || { echo "test.sh: run as root (the end-to-end tests start containerd)" >&2; exit 1; }
"$root/hack/setup.sh"
cd "$root"
echo "==> tests (pytest $*)"
exec "${REKINDLE_VENV:-$root/.venv}/bin/pytest" "$@"
