#!/usr/bin/env bash
# The README's test command, as root: set the node up (hack/setup.sh: installs what is missing,
# else only re-checks), then run the test suite with the project's pytest, once per containerd
# the project supports:
#
#   hack/test.sh [PYTEST ARGS...]      e.g. hack/test.sh tests/unit -q, hack/test.sh -k restore
#
# Pass 1 runs pytest with the arguments as given (the e2e tests on containerd 1.7). Every later
# pass runs only the end-to-end tests of the same selection again on the next containerd:
# `-m e2e` (or `-m "e2e and (EXPR)"` when the arguments carry `-m EXPR`) with
# REKINDLE_E2E_RUNTIME set. $REKINDLE_E2E_RUNTIMES lists the runtimes, first one first
# (default "1.7 2.1"; "1.7" alone runs one pass). Each pass starts the sandbox of its runtime in
# the default dir and stops it at the end; a sandbox of another runtime left running there
# (REKINDLE_E2E_KEEP=1) fails the later pass with a hint (hack/sandbox.sh down).
#
# CI runs it through .ci/run. The exit status is 0 only when every pass passed; otherwise it is
# the largest status of the passes (pytest's: 1 failures, 2 interrupted, 3 internal error,
# 4 usage, 5 nothing collected), never a sum that could wrap to 0. A later pass that selects
# no e2e test (exit 5, e.g. hack/test.sh tests/unit) is reported and counts as passed; pass 1
# collecting nothing still fails. The last line sums every pass up.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" -eq 0 ] || { echo "test.sh: run as root (the end-to-end tests start containerd)" >&2; exit 1; }
"$root/hack/setup.sh"
cd "$root"
pytest=${REKINDLE_VENV:-$root/.venv}/bin/pytest
read -r -a runtimes <<<"${REKINDLE_E2E_RUNTIMES:-1.7 2.1}"
[ "${#runtimes[@]}" -gt 0 ] || { echo "test.sh: REKINDLE_E2E_RUNTIMES is empty" >&2; exit 4; }

# The arguments of an e2e-only pass: the caller's, with their marker expression (if any) and'ed
# with e2e rather than replaced (pytest keeps only the last -m).
e2e_args=() mark=""
while [ $# -gt 0 ]; do
    case $1 in
        -m) mark=${2:-}; shift 2 || shift ;;
        -m?*) mark=${1#-m}; shift ;;
        *) e2e_args+=("$1"); shift ;;
    esac
done
set -- "${e2e_args[@]}"  # the original arguments are rebuilt below for pass 1
[ -n "$mark" ] && pass1=("$@" -m "$mark") || pass1=("$@")
[ -n "$mark" ] && later=("$@" -m "e2e and ($mark)") || later=("$@" -m e2e)

# A run writes several GiB of artifacts at a time (pytest keeps a failed test's): say so up front
# when the disk is short, rather than as a CRIU "No space left on device" deep in a test.
free_kib=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR==2 {print $4}')
[ "${free_kib:-0}" -ge $((10 * 1024 * 1024)) ] ||
    echo "test.sh: warning: only $((${free_kib:-0} / 1024 / 1024)) GiB free under ${TMPDIR:-/tmp}; the e2e tests need about 10" >&2

worst=0 summary=()
for i in "${!runtimes[@]}"; do
    rt=${runtimes[$i]}
    if [ "$i" -eq 0 ]; then
        echo "==> tests on containerd $rt (pytest ${pass1[*]})"
        rc=0; REKINDLE_E2E_RUNTIME=$rt "$pytest" "${pass1[@]}" || rc=$?
        summary+=("all on $rt: exit $rc")
    else
        echo "==> e2e tests on containerd $rt (pytest ${later[*]})"
        rc=0; REKINDLE_E2E_RUNTIME=$rt "$pytest" "${later[@]}" || rc=$?
        if [ "$rc" -eq 5 ]; then
            summary+=("e2e on $rt: none selected"); rc=0
        else
            summary+=("e2e on $rt: exit $rc")
        fi
    fi
    [ "$rc" -gt "$worst" ] && worst=$rc
done
verdict=$([ "$worst" -eq 0 ] && echo passed || echo "FAILED (exit $worst)")
(IFS=';'; echo "==> tests $verdict:${summary[*]/#/ }")
exit "$worst"
