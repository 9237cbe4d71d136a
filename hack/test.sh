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
# REKINDLE_E2E_RUNTIME set. $REKINDLE_E2E_RUNTIMES lists the runtimes, first one first; an entry
# RUNTIME:MARK runs only the e2e tests that also carry MARK on it. The default,
# "1.7 2.4 2.1:every_runtime 2.2:every_runtime", runs everything on 1.7, the whole e2e selection
# on the newest (2.4), and on 2.1 and 2.2 the modules that meet what differs between runtimes
# (tests/conftest.py EVERY_RUNTIME; docs/compatibility.md); "1.7" alone runs one pass. A later
# runtime whose containerd is not installed (hack/build-containerd.sh needs the Go module proxy)
# is not run, and the summary says so. Each pass starts the sandbox of its runtime in the default
# dir and stops it at the end; a sandbox of another runtime left running there
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
read -r -a runtimes <<<"${REKINDLE_E2E_RUNTIMES:-1.7 2.4 2.1:every_runtime 2.2:every_runtime}"
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
# later_args SUBSET: the arguments of a later pass, its subset marker (if any) and'ed in too.
later_args() {
    local m=e2e
    [ -z "$1" ] || m="$m and $1"
    [ -z "$mark" ] || m="$m and ($mark)"
    later=("${e2e_args[@]}" -m "$m")
}
# The containerd binary of a 2.x runtime: under its prefix (hack/versions.env), as the sandbox finds it.
containerd_of() {
    local var="REKINDLE_CONTAINERD${1//./}_PREFIX"
    echo "${!var:-/opt/rekindle/containerd-$1}/usr/bin/containerd"
}

# A run writes several GiB of artifacts at a time (pytest keeps a failed test's): say so up front
# when the disk is short, rather than as a CRIU "No space left on device" deep in a test.
free_kib=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR==2 {print $4}')
[ "${free_kib:-0}" -ge $((10 * 1024 * 1024)) ] ||
    echo "test.sh: warning: only $((${free_kib:-0} / 1024 / 1024)) GiB free under ${TMPDIR:-/tmp}; the e2e tests need about 10" >&2

worst=0 summary=()
for i in "${!runtimes[@]}"; do
    rt=${runtimes[$i]%%:*} subset=""
    [ "$rt" = "${runtimes[$i]}" ] || subset=${runtimes[$i]#*:}
    if [ "$i" -eq 0 ]; then
        echo "==> tests on containerd $rt (pytest ${pass1[*]})"
        rc=0; REKINDLE_E2E_RUNTIME=$rt "$pytest" "${pass1[@]}" || rc=$?
        summary+=("all on $rt: exit $rc")
    else
        what="e2e${subset:+ ($subset)} on $rt"
        bin=$(containerd_of "$rt")
        if [ "$rt" != 1.7 ] && [ ! -x "$bin" ]; then
            echo "==> $what: NOT RUN: $bin is missing (hack/install-deps.sh could not build it)" >&2
            summary+=("$what: not run, no containerd $rt"); continue
        fi
        later_args "$subset"
        echo "==> $what (pytest ${later[*]})"
        rc=0; REKINDLE_E2E_RUNTIME=$rt "$pytest" "${later[@]}" || rc=$?
        if [ "$rc" -eq 5 ]; then
            summary+=("$what: none selected"); rc=0
        else
            summary+=("$what: exit $rc")
        fi
    fi
    [ "$rc" -gt "$worst" ] && worst=$rc
done
verdict=$([ "$worst" -eq 0 ] && echo passed || echo "FAILED (exit $worst)")
(IFS=';'; echo "==> tests $verdict:${summary[*]/#/ }")
exit "$worst"
