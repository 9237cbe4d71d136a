"""Host files from bind mounts: recorded from CRIU's files.img at checkpoint, checked at restore."""

from __future__ import annotations

import logging
import os
import stat
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from runtime import hostfiles
from runtime.criu.image_files import read_reg_files
from runtime.criu.proto import fown_pb2, regfile_pb2
from runtime.digests import hash_fd
from runtime.hostfiles import DigestCache, HostFilesError, check, record
from runtime.layout import MountPlanEntry
from runtime.manifest import HostFile

MAGIC = b"\x00" * 8


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _image(path: Path, entries: list[bytes]) -> None:
    path.write_bytes(MAGIC + b"".join(struct.pack("<I", len(e)) + e for e in entries))


def files_img(images: Path, files: list[tuple[str, int, int]], remapped: tuple[int, ...] = ()) -> None:
    """files.img as CRIU writes it: one file_entry (type, id, reg) per (path, size, mode), a
    fixed-width field and another kind of file among them, as in a real one."""
    entries = [_field(1, 5) + _field(2, 99) + b"\x81\x01" + b"\x00" * 8]  # UNIXSK, and a fixed64 field 16
    for i, (path, size, mode) in enumerate(files, start=1):
        reg = regfile_pb2.reg_file_entry(id=i, flags=0, pos=0, fown=fown_pb2.fown_entry(uid=0, euid=0, signum=0,
                                         pid_type=0, pid=0), name=path, size=size, mode=mode)
        entries.append(_field(1, 1) + _field(2, i) + _field(3, reg.SerializeToString()))
    _image(images / "files.img", entries)
    if remapped:
        _image(images / "remap-fpath.img", [_field(1, r) + _field(2, 1000 + r) + _field(3, 1) for r in remapped])


REG, DIR, CHR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755, stat.S_IFCHR | 0o666


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Any]:
    """A host directory bound at /hostlib, a file bound at /etc/single, the plugin's own mounts."""
    lib = tmp_path / "hostlib"
    (lib / "sub").mkdir(parents=True)
    (lib / "libfoo.so").write_bytes(os.urandom(70_000))
    (lib / "sub" / "data.bin").write_bytes(b"x" * 123)
    (lib / "link.so").symlink_to("libfoo.so")  # a link that stays inside: followed
    single = tmp_path / "single"
    single.write_bytes(b"one file bound on its own\n")
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    (ctl / "ready-for-checkpoint").write_text("ready\n")
    spec = [{"destination": "/hostlib", "type": "bind", "source": str(lib), "options": ["rbind", "ro"]},
            {"destination": "/etc/single", "type": "bind", "source": str(single), "options": ["rbind"]},
            {"destination": "/rekindle", "type": "bind", "source": str(ctl), "options": ["rbind"]},
            {"destination": "/dev/shm", "type": "bind", "source": str(ctl), "options": ["rbind"]},
            {"destination": "/proc", "type": "proc", "source": "proc"}]
    plan = [MountPlanEntry("m0", "/dev/shm", "bind"), MountPlanEntry("m1", "/etc/single", "bind"),
            MountPlanEntry("m2", "/hostlib", "bind"), MountPlanEntry("m3", "/rekindle", "bind"),
            MountPlanEntry("m4", "/sys/fs/cgroup", "cgroup2")]
    images = tmp_path / "images"
    images.mkdir()
    return {"lib": lib, "single": single, "spec": spec, "plan": plan, "images": images, "tmp": tmp_path}


def _digest(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return hash_fd(fd)[1]
    finally:
        os.close(fd)


def test_reg_files_are_read_from_files_img_without_dirs_devices_or_remapped_ones(tmp_path: Path) -> None:
    files_img(tmp_path, [("/a", 1, REG), ("/", 0, DIR), ("/dev/null", 0, CHR), ("/ghost", 4, REG)], remapped=(4,))
    assert [(f.path, f.size) for f in read_reg_files(str(tmp_path))] == [("/a", 1)]


def test_record_lists_the_bind_mounted_files_the_tree_uses_and_nothing_else(host: dict[str, Any]) -> None:
    lib: Path = host["lib"]
    files_img(host["images"], [
        ("/hostlib/libfoo.so", 70_000, REG),       # mapped (a VMA's file)
        ("/hostlib/libfoo.so", 70_000, REG),       # and open: one record
        ("/hostlib/sub/data.bin", 123, REG),
        ("/hostlib/link.so", 70_000, REG),
        ("/etc/single", 26, REG),                   # a file bound on its own
        ("/usr/lib/libc.so.6", 1_900_000, REG),     # the image's: its id is checked
        ("/rekindle/ready-for-checkpoint", 6, REG),  # the plugin's own mount
        ("/dev/shm/seg", 9, REG),                   # captured into the artifact
        ("/hostlib", 0, DIR),
    ])
    got = record(str(host["images"]), host["plan"], host["spec"], cache=DigestCache())
    assert got == (
        HostFile("/etc/single", "", 26, _digest(host["single"])),
        HostFile("/hostlib", "libfoo.so", 70_000, _digest(lib / "libfoo.so")),
        HostFile("/hostlib", "link.so", 70_000, _digest(lib / "libfoo.so")),
        HostFile("/hostlib", "sub/data.bin", 123, _digest(lib / "sub" / "data.bin")),
    )


def test_a_mount_reached_through_a_symlink_is_matched_where_the_tree_sees_it(host: dict[str, Any]) -> None:
    plan = [MountPlanEntry("m0", "/opt/lib", "bind", mount_point="/hostlib")]
    spec = [{"destination": "/opt/lib", "type": "bind", "source": str(host["lib"])}]
    files_img(host["images"], [("/hostlib/sub/data.bin", 123, REG)])
    assert [(h.mount, h.path) for h in record(str(host["images"]), plan, spec, cache=DigestCache())] == [
        ("/opt/lib", "sub/data.bin")]


@pytest.mark.parametrize("plant, needle", [
    (lambda lib: (lib / "evil.so").symlink_to("/etc/passwd"), "Invalid cross-device link"),
    (lambda lib: (lib / "evil.so").symlink_to("../single"), "Invalid cross-device link"),
    (lambda lib: os.mkfifo(lib / "evil.so"), "not a regular file but a FIFO"),
    (lambda lib: None, "No such file or directory"),
], ids=["absolute-symlink-out", "relative-symlink-out", "fifo", "gone"])
def test_record_never_leaves_the_bind_source_and_never_opens_what_is_not_a_file(
        host: dict[str, Any], plant: Any, needle: str) -> None:
    plant(host["lib"])
    files_img(host["images"], [("/hostlib/evil.so", 26, REG)])
    with pytest.raises(HostFilesError, match=needle):  # a FIFO would block an open for reading
        record(str(host["images"]), host["plan"], host["spec"], cache=DigestCache())


def test_record_refuses_a_file_that_is_not_the_size_criu_saw(host: dict[str, Any]) -> None:
    files_img(host["images"], [("/hostlib/sub/data.bin", 100, REG)])
    with pytest.raises(HostFilesError, match="123 bytes on the host, 100 when dumped"):
        record(str(host["images"]), host["plan"], host["spec"], cache=DigestCache())


def test_record_refuses_more_bytes_than_the_cap_before_reading_any(host: dict[str, Any]) -> None:
    files_img(host["images"], [("/hostlib/libfoo.so", 70_000, REG), ("/hostlib/sub/data.bin", 123, REG)])
    cache = DigestCache()
    with pytest.raises(HostFilesError, match=r"2 files from bind mounts, 0\.1 MiB together, more than the "
                                             r"0\.0 MiB a restore would hash .*largest: /hostlib/libfoo\.so"):
        record(str(host["images"]), host["plan"], host["spec"], max_bytes=50_000, cache=cache)
    assert cache.hashed == 0


def _recorded(host: dict[str, Any], cache: DigestCache) -> tuple[HostFile, ...]:
    files_img(host["images"], [("/hostlib/libfoo.so", 70_000, REG), ("/etc/single", 26, REG)])
    return record(str(host["images"]), host["plan"], host["spec"], cache=cache)


def test_check_accepts_the_same_files_through_the_targets_own_mounts(host: dict[str, Any]) -> None:
    cache = DigestCache()
    recs = _recorded(host, cache)
    other = host["tmp"] / "other-node-lib"
    other.mkdir()
    (other / "libfoo.so").write_bytes((host["lib"] / "libfoo.so").read_bytes())
    spec = [{**host["spec"][0], "source": str(other)}, host["spec"][1]]
    assert check(recs, spec, cache=cache) == []


def test_check_refuses_a_file_of_the_same_size_and_other_content(host: dict[str, Any]) -> None:
    cache = DigestCache()
    recs = _recorded(host, cache)
    lib = host["lib"] / "libfoo.so"
    lib.write_bytes(os.urandom(70_000))
    reasons = check(recs, host["spec"], cache=cache)
    assert len(reasons) == 1 and reasons[0].startswith(
        f"host file /hostlib/libfoo.so ({host['lib']}) differs from the checkpoint's (same size, digest "), reasons


@pytest.mark.parametrize("change, needle", [
    (lambda h: (h["lib"] / "libfoo.so").unlink(), "host file /hostlib/libfoo.so ({lib}): No such file or directory"),
    (lambda h: (h["lib"] / "libfoo.so").write_bytes(b"short"),
     "host file /hostlib/libfoo.so ({lib}) is 5 bytes, the checkpoint's was 70000"),
    (lambda h: ((h["lib"] / "libfoo.so").unlink(), (h["lib"] / "libfoo.so").symlink_to("/etc/passwd")),
     "host file /hostlib/libfoo.so ({lib}): Invalid cross-device link"),
    (lambda h: h["spec"].pop(0), "host file /hostlib/libfoo.so: the target has no bind mount at /hostlib"),
], ids=["missing", "other-size", "symlink-out", "no-such-mount"])
def test_check_refuses_a_file_that_is_not_there_as_it_was(host: dict[str, Any], change: Any, needle: str) -> None:
    cache = DigestCache()
    recs = _recorded(host, cache)
    change(host)
    assert check(recs, host["spec"], cache=cache) == [needle.format(lib=host["lib"])]


def test_check_refuses_more_than_this_nodes_cap(host: dict[str, Any]) -> None:
    recs = _recorded(host, DigestCache())
    assert check(recs, host["spec"], max_bytes=1000) == [
        "host files of 0.1 MiB are more than the 0.0 MiB this node hashes"]


def test_an_artifact_without_records_is_restored_as_before_with_a_warning(
        host: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="runtime.hostfiles"):
        assert check(None, host["spec"], label="team-a/old") == []
    assert "team-a/old: made before host files were recorded" in caplog.text


def test_restores_on_one_node_hash_a_file_once_until_it_changes(host: dict[str, Any]) -> None:
    cache = DigestCache()
    recs = _recorded(host, cache)  # the checkpoint hashed both
    assert cache.hashed == 2
    results: list[list[str]] = []
    threads = [threading.Thread(target=lambda: results.append(check(recs, host["spec"], cache=cache)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[]] * 4 and cache.hashed == 2
    lib = host["lib"] / "libfoo.so"
    st = lib.stat()
    lib.write_bytes(os.urandom(70_000))
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: the ctime still moved
    assert len(check(recs, host["spec"], cache=cache)) == 1 and cache.hashed == 3


def test_the_cache_is_bounded() -> None:
    cache = DigestCache(max_entries=2)
    for i in range(3):
        fd = os.memfd_create(f"f{i}")
        try:
            os.write(fd, bytes([i]))
            cache.digest(fd)
        finally:
            os.close(fd)
    assert len(cache._done) == 2
    assert hostfiles.CACHE is not cache


def test_settled_digests_outlive_the_process_and_a_changed_file_is_hashed_again(
        host: dict[str, Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.hostfiles as hf
    saved = tmp_path / "digests.json"
    first = DigestCache()
    first.persist(str(saved))
    # Files written just now are not settled: nothing is kept on disk for them.
    recs = _recorded(host, first)
    assert first.hashed == 2 and not saved.exists()
    # Hashed as if two seconds later (their ctime is then old enough): kept.
    later = DigestCache()
    later.persist(str(saved))
    real = hf.time.time_ns
    monkeypatch.setattr(hf.time, "time_ns", lambda: real() + hf.SETTLED_NS + 1)
    assert check(recs, host["spec"], cache=later) == [] and later.hashed == 2 and saved.exists()
    monkeypatch.undo()
    # A new process (a restarted plugin) hashes nothing it has a settled digest of...
    again = DigestCache()
    assert again.persist(str(saved)) == 2
    assert check(recs, host["spec"], cache=again) == [] and again.hashed == 0
    # ...and a file changed since (new ctime) is read again, and refused.
    (host["lib"] / "libfoo.so").write_bytes(os.urandom(70_000))
    fresh = DigestCache()
    fresh.persist(str(saved))
    reasons = check(recs, host["spec"], cache=fresh)
    assert fresh.hashed == 1 and len(reasons) == 1 and "differs from the checkpoint's" in reasons[0], reasons


@pytest.mark.parametrize("content", [b"{not json", b'{"version": 1, "digests": [[1, 2, 3]]}',
                                     b'{"version": 2, "digests": []}', b'[]'],
                         ids=["garbage", "short-row", "other-version", "not-an-object"])
def test_a_digest_file_that_is_not_ours_is_ignored(tmp_path: Any, content: bytes) -> None:
    saved = tmp_path / "digests.json"
    saved.write_bytes(content)
    assert DigestCache().persist(str(saved)) == 0
