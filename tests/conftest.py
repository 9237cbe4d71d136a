"""Test-suite wiring: markers by directory, e2e prerequisites, the --containerd option.

- Tests under ``tests/e2e/`` are marked ``e2e``, under ``tests/gpu/`` ``gpu`` (no need to repeat it).
- An ``e2e`` test (wherever it lives) is skipped, with the reason, when not run as root or when
  containerd, runc or CRIU >= 4.2 is missing (``hack/setup.sh`` installs them).
- ``--containerd 1.7|2.1`` (or ``$REKINDLE_E2E_RUNTIME``) picks the runtime of the ``sandbox``
  fixture (tests/e2e/conftest.py); default 1.7.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest

from runtime.criu.command import MIN_VERSION, criu_version, version_tuple
from runtime.errors import CriuError

TESTS = Path(__file__).resolve().parent
MARK_BY_DIR = {"e2e": "e2e", "gpu": "gpu"}
# The e2e modules CI runs on every containerd (hack/test.sh: `-m "e2e and every_runtime"` on 2.1
# and 2.2): those that meet what differs between runtimes (the sandbox, NRI's handshake and
# adjustments, the entrypoint swap's route, checkpoint and restore, other NRI plugins). The rest
# runs on 1.7 and on the newest (docs/compatibility.md).
EVERY_RUNTIME = {"test_sandbox", "test_nri_plugin", "test_checkpoint_restore", "test_second_nri_plugin",
                 "test_nri_sample_plugins"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--containerd", choices=["1.7", "2.1", "2.2", "2.4"], default=os.environ.get("REKINDLE_E2E_RUNTIME", "1.7"),
                     help="containerd runtime of the e2e sandbox fixture (default: $REKINDLE_E2E_RUNTIME or 1.7)")


@functools.cache
def e2e_skip_reason() -> str | None:
    """Why e2e tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "e2e tests need root (as root: hack/test.sh -m e2e)"
    missing = [t for t in ("containerd", "runc", "criu") if shutil.which(t) is None]
    if missing:
        return f"e2e tests need {', '.join(missing)} (run hack/setup.sh)"
    try:
        version = version_tuple(criu_version("criu")) or ()
    except CriuError:
        version = ()
    if version < MIN_VERSION:
        return f"e2e tests need criu >= {'.'.join(map(str, MIN_VERSION))} (run hack/install-deps.sh)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            top = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if top in MARK_BY_DIR:
            item.add_marker(getattr(pytest.mark, MARK_BY_DIR[top]))
        if top == "e2e" and Path(item.path).stem in EVERY_RUNTIME:
            item.add_marker(pytest.mark.every_runtime)
        if item.get_closest_marker("e2e") and (reason := e2e_skip_reason()):
            item.add_marker(pytest.mark.skip(reason=reason))
