"""CRIU's pages images hashed while written (runtime.pages.tailhash): the same sums and digest as
hashing the finished file; used by the publish for the very inode and size only."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from runtime import digests
from runtime.digests import PIECE, Hashed
from runtime.layout import SUM_CHUNK
from runtime.pages import bulk
from runtime.pages.tailhash import TailHasher
from runtime.store.volume import ArtifactStore
from tests.unit.test_store import KEY, make_manifest


def _hashed_after(path: Path) -> tuple[bytes, str]:
    sums = path.with_suffix(".sums")
    bulk.write_sums(str(path), str(sums))
    fd = os.open(path, os.O_RDONLY)
    try:
        return sums.read_bytes(), digests.hash_fd(fd)[1]
    finally:
        os.close(fd)


def _append_slowly(path: Path, data: bytes, step: int, started: threading.Event) -> None:
    with open(path, "wb", buffering=0) as f:
        for off in range(0, len(data), step):
            f.write(data[off:off + step])
            started.set()
            time.sleep(0.01)


@pytest.mark.parametrize("size,write_back", [(2 * PIECE + 3 * SUM_CHUNK + 4096, False), (3 * PIECE, True),
                                             (4096, False), (0, True)])
def test_a_file_written_while_followed_hashes_as_the_finished_file(tmp_path: Path, size: int,
                                                                   write_back: bool) -> None:
    data = os.urandom(size)
    path = tmp_path / "pages-7.img"
    started = threading.Event()
    with TailHasher(str(tmp_path), poll_s=0.005, write_back=write_back) as th:
        writer = threading.Thread(target=_append_slowly, args=(path, data, 8 * SUM_CHUNK + 512, started))
        writer.start()
        started.wait(10)
        writer.join()
        got = th.finish()
        ahead = th.ahead_bytes
    sums, digest = _hashed_after(path)
    h = got[str(path)]
    assert (h.sums, h.digest, h.size) == (sums, digest, size)
    assert h.matches(os.stat(path))
    if size >= 2 * PIECE:
        assert ahead >= PIECE  # whole pieces were hashed before the writer was done


def test_only_pages_images_are_followed_and_a_replaced_file_no_longer_matches(tmp_path: Path) -> None:
    (tmp_path / "core-1.img").write_bytes(b"x" * 100)
    path = tmp_path / "pages-1.img"
    path.write_bytes(os.urandom(PIECE + 1))
    with TailHasher(str(tmp_path)) as th:
        got = th.finish()
        assert list(got) == [str(path)]
        assert got[str(path)].matches(os.stat(path))
        path.unlink()
        path.write_bytes(os.urandom(PIECE + 1))  # same size, another inode (the first still held)
        assert not got[str(path)].matches(os.stat(path))



def test_leaving_without_finish_abandons_the_work(tmp_path: Path) -> None:
    (tmp_path / "pages-1.img").write_bytes(os.urandom(3 * PIECE))
    with TailHasher(str(tmp_path), poll_s=0.001):
        time.sleep(0.05)
    # nothing is left running: no thread of it remains
    assert not [t for t in threading.enumerate() if t.name.startswith("rekindle-tailhash")]


def _publish_with(tmp_path: Path, known: Hashed | None, data: bytes) -> str:
    store = ArtifactStore(str(tmp_path / "store"))
    with store.stage("team-a", "qwen-7b") as staging:
        path = Path(staging.path, "bulk", "pages-1.bin")
        path.parent.mkdir()
        path.write_bytes(data)
        if known is not None:
            st = os.stat(path)
            known = Hashed(st.st_dev, st.st_ino, known.size, st.st_mtime_ns, known.sums, known.digest)
        manifest = staging.publish(make_manifest(), KEY, known=[known] if known else [])
    return manifest.files[0].digest


def test_the_publish_takes_a_known_digest_of_the_very_file_and_size_only(tmp_path: Path) -> None:
    data = os.urandom(PIECE + 5)
    real = _publish_with(tmp_path / "a", None, data)
    # a digest made while written stands for the hash: the publish does not read the file again
    assert _publish_with(tmp_path / "b", Hashed(0, 0, len(data), 0, b"", "ab" * 32), data) == "ab" * 32
    # at another size it is not that file: hashed again
    assert _publish_with(tmp_path / "c", Hashed(0, 0, len(data) - 1, 0, b"", "ab" * 32), data) == real
