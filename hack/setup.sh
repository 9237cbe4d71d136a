#!/usr/bin/env bash
# One-command set-up of a development/CI node: system deps, Python venv, native build.
#
#   hack/setup.sh          (as root; hack/demo.sh and hack/test.sh run it first)
#
# Runs hack/install-deps.sh, creates .venv (python3 -m venv) with the package installed
# editable plus its test extras, then runs `make` when a top-level Makefile exists and
# hack/build-zdtm.sh (CRIU's zdtm tests that tests/e2e/zdtm runs).
# Idempotent: a second run only re-checks. Set REKINDLE_SKIP_DEPS=1 to skip the system part.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
step() { echo "==> $*"; }

if [ "${REKINDLE_SKIP_DEPS:-0}" != 1 ]; then
    step "system dependencies (hack/install-deps.sh)"
    "$root/hack/install-deps.sh"
fi

venv=${REKINDLE_VENV:-$root/.venv}
if [ ! -x "$venv/bin/python" ]; then
    step "creating $venv"
    python3 -m venv "$venv"
fi
step "installing the package into $venv (pip install -e '.[test]')"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]'
# The Helm library declares Python >= 3.12 but works on 3.11 (tests/unit/test_chart.py).
"$venv/bin/python" -m pip install -q --disable-pip-version-check --ignore-requires-python -r requirements-chart.txt

if [ -f "$root/Makefile" ]; then
    step "building native parts (make)"
    make -C "$root" --no-print-directory
fi
step "zdtm tests for the e2e suite (hack/build-zdtm.sh)"
"$root/hack/build-zdtm.sh"
step "done; activate with: . ${venv#"$root"/}/bin/activate"
