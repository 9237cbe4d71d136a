"""bulk.fill against a real stopped process: bytes land where the plan says, verified; a cold
page cache gets each piece asked of the disk whole before it is read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import bulk, digests
from runtime.layout import BulkFile, BulkRange, bulk_file
from runtime.store import ArtifactStore
from tests.unit.test_store import KEY, publish

SIZE = 3 << 20

_CHILD = """
import mmap, ctypes, sys
m = mmap.mmap(-1, %d)
print(ctypes.addressof(ctypes.c_char.from_buffer(m)), flush=True)
sys.stdin.read()
""" % SIZE


def _stopped_child() -> tuple[subprocess.Popen[str], int]:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    vaddr = int(child.stdout.readline())
    os.kill(child.pid, signal.SIGSTOP)
    return child, vaddr


def _memory(pid: int, vaddr: int, length: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(vaddr)
        return f.read(length)


@pytest.mark.skipif(os.geteuid() != 0, reason="process_vm_writev into another process needs root")
@pytest.mark.parametrize("cold", [False, True], ids=["cached", "cold"])
def test_fill_writes_verified_pages_and_asks_the_disk_ahead_when_cold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold: bool) -> None:
    monkeypatch.setattr(digests, "PIECE", 1 << 20)  # for publish and fill alike: three pieces
    data = os.urandom(SIZE)
    store = ArtifactStore(str(tmp_path))
    publish(store, files={bulk_file(1): data})
    advised: list[tuple[int, int]] = []
    if cold:
        monkeypatch.setattr(bulk, "is_cached", lambda *_: False)
    real = os.posix_fadvise
    monkeypatch.setattr(bulk.os, "posix_fadvise",
                        lambda fd, off, n, advice: (advised.append((off, n)), real(fd, off, n, advice))[1])
    child, vaddr = _stopped_child()
    try:
        plan = BulkFile(1, bulk_file(1), 1, (BulkRange(vaddr, SIZE, 0),))
        with store.open("team-a", "qwen-7b", KEY) as art:
            fd = art.open_file(plan.path)
            try:
                stats = bulk.fill(art, [plan], [fd], lambda _pid: child.pid, threads=2)
            finally:
                os.close(fd)
        assert stats.bytes_written == SIZE
        assert _memory(child.pid, vaddr, SIZE) == data
        assert sorted(advised) == ([(o, 1 << 20) for o in range(0, SIZE, 1 << 20)] if cold else [])
    finally:
        child.kill()
        child.wait()
