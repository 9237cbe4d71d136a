"""runtime.container.mountattr on a real mount namespace: flags are added inside it only, paths are looked up
there, and nothing from inside it is executed."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.container.confine import visible_mounts
from runtime.container.containers import read_mountinfo
from runtime.container.mountattr import MOUNT_ATTR_NOEXEC, MOUNT_ATTR_RDONLY, adjust


@pytest.fixture
def private_ns(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A process in its own mount namespace with a writable tmpfs at ``tmp_path/vol``."""
    vol = tmp_path / "vol"
    vol.mkdir()
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
                             f'mount -t tmpfs tmpfs "{vol}" && touch "{vol}/inside" && echo up && exec sleep 60'],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        yield proc.pid, vol
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _options(pid: int, point: Path) -> set[str]:
    return set(visible_mounts(read_mountinfo(pid))[str(point)].options.split(","))


def test_adjust_adds_flags_in_the_namespace_and_probes_paths_there(private_ns: tuple[int, Path]) -> None:
    pid, vol = private_ns
    assert "rw" in _options(pid, vol)
    found = adjust(pid, {str(vol): MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOEXEC},
                   probe=[str(vol / "inside"), str(vol / "absent")])
    assert found == [str(vol / "inside")]  # the tmpfs's file, not visible from the host
    assert not (vol / "inside").exists()
    assert {"ro", "noexec"} <= _options(pid, vol)
    with pytest.raises(OSError):
        open(f"/proc/{pid}/root{vol}/new", "w").close()  # EROFS through the namespace's own mount
    (vol / "host-side").write_text("host")  # the host's directory is untouched


def test_adjust_runs_nothing_from_the_namespace(private_ns: tuple[int, Path], tmp_path: Path) -> None:
    """A trap in the namespace's view of the host Python's paths is never read or run."""
    pid, vol = private_ns
    marker = tmp_path / "ran"
    trap = f'import os; open("{marker}", "w").close()\n'
    site = os.path.dirname(os.__file__)
    # Shadow the standard library inside the namespace only: anything imported after setns would run it.
    subprocess.run(["nsenter", "-t", str(pid), "-m", "--", "sh", "-c",
                    f'mount -t tmpfs tmpfs "{site}" && for m in json ctypes encodings traceback linecache; do '
                    f'printf %s \'{trap}\' > "{site}/$m.py"; done'], check=True, timeout=10)
    found = adjust(pid, {str(vol): MOUNT_ATTR_RDONLY}, probe=[str(vol / "inside")])
    assert found == [str(vol / "inside")]
    time.sleep(0.1)
    assert not marker.exists()
