"""bench/let_go.py's cases against real processes on a small tmpfs file: every way of letting
the pieces go, by every shape, leaves each process reading the file's bytes."""

from __future__ import annotations

import os
import tempfile

import pytest

from bench import let_go
from runtime.pages import uffd

pytestmark = pytest.mark.skipif(uffd.probe_minor("/dev/shm") is not None,
                                reason=f"no minor-mode userfaultfd on /dev/shm: {uffd.probe_minor('/dev/shm')}")


@pytest.fixture(scope="module")
def small_file():
    d = tempfile.mkdtemp(dir="/dev/shm")
    path, crc = let_go.make_file(d, 8 << 20)
    yield path, crc
    os.unlink(path)
    os.rmdir(d)


@pytest.mark.parametrize("mode", let_go.MODES)
@pytest.mark.parametrize("shape", let_go.SHAPES)
def test_every_process_reads_the_files_bytes(small_file, mode: str, shape: str) -> None:
    path, crc = small_file
    rec = let_go.run_case(path, 8 << 20, crc, 2, 2, mode, shape, "populate")
    assert rec["identical"] and not rec["errors"], rec
    assert rec["pieces"] == 2 * 4 and len(rec["child_read_s"]) == 2


def test_a_wrong_crc_is_not_identical(small_file) -> None:
    path, crc = small_file
    assert not let_go.run_case(path, 8 << 20, crc ^ 1, 1, 1, "unregister", "each", "touch")["identical"]
