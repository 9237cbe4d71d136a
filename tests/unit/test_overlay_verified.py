"""A layer applied straight from the store's archive (runtime.overlay.verified): the same tree as
from a private copy, and every chunk verified before a byte of it is parsed or written. A store
that changes the archive after its digests were signed gets the apply refused and rolled back,
and none of its bytes reach a file of the rootfs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime import layout
from runtime.errors import OverlayError
from runtime.overlay.rootfs import apply, capture
from runtime.overlay.tar import members
from runtime.overlay.verified import VerifiedArchive, chunk_sums, write_sums
from tests.unit.test_overlay import snapshot

CHUNK = 4096  # small: members straddle chunks, as 1 MiB ones do in a real layer


def _layer(tmp_path: Path) -> tuple[Path, Path, bytes]:
    upper = tmp_path / "upper"
    (upper / "d" / "e").mkdir(parents=True)
    (upper / "d" / "big").write_bytes(b"A" * (10 * CHUNK + 123))
    os.link(upper / "d" / "big", upper / "d" / "big-link")
    for i in range(30):
        (upper / "d" / "e" / f"small{i}").write_bytes(bytes([i]) * (i * 37))
    (upper / "d" / "link").symlink_to("/etc/passwd")
    with open(upper / "sparse", "wb") as f:
        f.seek(5 * CHUNK)
        f.write(b"tail")
    os.setxattr(upper / "d" / "big", "user.k", b"v")
    tar, dels = tmp_path / "layer.tar", tmp_path / "layer.json"
    capture(str(upper), str(tar), str(dels), exclude=[])
    with open(tar, "rb") as f:
        sums = chunk_sums(f.fileno(), CHUNK)
    return tar, dels, sums


def _archive(tar: Path, sums: bytes, size: int | None = None) -> VerifiedArchive:
    return VerifiedArchive(os.open(tar, os.O_RDONLY), tar.stat().st_size if size is None else size, sums,
                           chunk=CHUNK)


def _rootfs(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    (root / "d").mkdir(parents=True)
    (root / "d" / "big").write_bytes(b"the image's own file\n")  # replaced by the layer's
    return root


def test_a_layer_from_the_store_is_the_same_tree_as_from_a_private_copy(tmp_path: Path) -> None:
    tar, dels, sums = _layer(tmp_path)
    copy, streamed = _rootfs(tmp_path, "copy"), _rootfs(tmp_path, "streamed")
    apply(str(copy), str(tar), str(dels))
    with _archive(tar, sums) as archive:
        stats = apply(str(streamed), archive, str(dels))
    assert snapshot(streamed) == snapshot(copy)
    assert (streamed / "d" / "big").read_bytes() == b"A" * (10 * CHUNK + 123)
    assert stats.files == 32 and stats.hardlinks == 1


def _data_offset(tar: Path, name: str) -> int:
    with open(tar, "rb") as f:
        return next(m.offset_data for m in members(f) if m.name == name)


def test_a_data_chunk_changed_in_the_store_is_refused_before_any_byte_of_it_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tar, dels, sums = _layer(tmp_path)
    root = _rootfs(tmp_path, "rootfs")
    before = snapshot(root)
    # Changed after the digests were signed, inside the big file's data (a chunk of data only:
    # the check pass never reads it, so the write pass meets it after writing other files).
    at = _data_offset(tar, "d/big") + 4 * CHUNK + 100
    with open(tar, "r+b") as f:
        f.seek(at)
        f.write(b"EVIL")
    written: list[bytes] = []
    real_pwrite = os.pwrite

    def recording(fd: int, data: bytes | memoryview, offset: int) -> int:
        written.append(bytes(data))
        return real_pwrite(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", recording)
    with _archive(tar, sums) as archive, pytest.raises(OverlayError, match="does not match its digest"):
        apply(str(root), archive, str(dels))
    assert written, "the apply wrote the chunks before the changed one"
    assert not any(b"EVIL" in w for w in written)
    assert snapshot(root) == before  # rolled back


def test_a_header_changed_in_the_store_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tar, dels, sums = _layer(tmp_path)
    root = _rootfs(tmp_path, "rootfs")
    before = snapshot(root)
    with open(tar, "r+b") as f:
        f.write(b"../../etc/shadow\0")  # the first member's name
    monkeypatch.setattr(os, "pwrite", lambda *a: pytest.fail("wrote"))
    with _archive(tar, sums) as archive, pytest.raises(OverlayError, match="chunk 0 does not match"):
        apply(str(root), archive, str(dels))
    assert snapshot(root) == before


def test_a_truncated_archive_or_digests_of_another_length_are_refused(tmp_path: Path) -> None:
    tar, dels, sums = _layer(tmp_path)
    size = tar.stat().st_size
    with pytest.raises(OverlayError, match="chunk digests for"):
        _archive(tar, sums[:-32])
    os.truncate(tar, size - CHUNK - 1)
    root = _rootfs(tmp_path, "rootfs")
    before = snapshot(root)
    with _archive(tar, sums, size) as archive, pytest.raises(OverlayError, match="ends early"):
        apply(str(root), archive, str(dels))
    assert snapshot(root) == before


def test_bytes_past_the_signed_size_are_never_read(tmp_path: Path) -> None:
    tar, dels, sums = _layer(tmp_path)
    size = tar.stat().st_size
    with open(tar, "ab") as f:
        f.write(b"\xff" * 3 * CHUNK)
    root = _rootfs(tmp_path, "rootfs")
    with _archive(tar, sums, size) as archive:
        apply(str(root), archive, str(dels))
    assert (root / "sparse").read_bytes() == bytes(5 * CHUNK) + b"tail"


def test_the_digests_written_at_checkpoint_are_one_per_chunk(tmp_path: Path) -> None:
    tar, _, _ = _layer(tmp_path)
    write_sums(str(tar), str(tmp_path / "sums"))
    size = tar.stat().st_size
    assert (tmp_path / "sums").stat().st_size == -(-size // layout.SUM_CHUNK) * layout.DIGEST_BYTES
    with pytest.raises(FileExistsError):  # never over a file (or a link) already there
        write_sums(str(tar), str(tmp_path / "sums"))


def test_staging_leaves_in_the_store_only_the_layers_it_can_verify_by_chunk() -> None:
    listed = {layout.ROOTFS_TAR, layout.layer_sums(layout.ROOTFS_TAR), layout.SHM_TAR, "bulk/pages-1.bulk",
              layout.RESTORE_PLAN}
    skip = layout.staged_skip(listed)
    assert [p for p in sorted(listed) if skip(p)] == ["bulk/pages-1.bulk", layout.ROOTFS_TAR]
    assert not layout.staged_skip({layout.ROOTFS_TAR})(layout.ROOTFS_TAR)  # an artifact of before
