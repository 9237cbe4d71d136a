"""Overlay capture and apply: a real overlayfs round trip, whiteouts, hostile archives, sparse
files and hard links, caps and deadline, all-or-nothing apply, bounded memory."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import stat
import subprocess
import tarfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import OverlayError
from runtime.overlay.rootfs import apply, capture

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, trusted xattrs, "
                                "chown, mount -t overlay)")


def snapshot(top: Path) -> dict[str, Any]:
    """Everything observable about a tree, without following symlinks."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            rel = str(p.relative_to(top))
            info: dict[str, Any] = {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid}
            if not stat.S_ISLNK(st.st_mode):
                info["mtime_ns"] = st.st_mtime_ns
            if stat.S_ISREG(st.st_mode):
                info["sha"] = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                info["target"] = os.readlink(p)
            if not stat.S_ISLNK(st.st_mode):
                info["xattrs"] = {n: os.getxattr(p, n) for n in os.listxattr(p)
                                  if n.startswith("user.")}
            out[rel] = info
    return out


def host_shadow() -> tuple[str, int]:
    p = Path("/etc/shadow")
    if not p.exists():
        return "", 0
    return hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_nlink


# --- capture on a plain directory standing in for an upperdir -------------------------------------

def read_tar(path: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(path) as tar:
        return {m.name: m for m in tar.getmembers()}


def test_capture_stores_symlinks_as_symlinks_and_never_follows_them(tmp_path: Path) -> None:
    upper, outside = tmp_path / "upper", tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "secret").write_bytes(b"secret")
    upper.mkdir()
    (upper / "to-dir").symlink_to(outside / "sub")
    (upper / "to-file").symlink_to(outside / "sub" / "secret")
    stats = capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[])
    members = read_tar(tmp_path / "d.tar")
    assert sorted(members) == ["to-dir", "to-file"]
    assert all(m.issym() for m in members.values())
    assert members["to-dir"].linkname == str(outside / "sub")
    assert stats.symlinks == 2 and stats.files == 0


def test_capture_stores_a_hard_linked_file_once_and_its_other_names_as_links(tmp_path: Path) -> None:
    upper, root = tmp_path / "upper", tmp_path / "root"
    (upper / "sub").mkdir(parents=True)
    root.mkdir()
    (upper / "a").write_bytes(os.urandom(100 << 20))
    os.link(upper / "a", upper / "b")
    os.link(upper / "a", upper / "sub" / "c")
    stats = capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[])
    members = read_tar(tmp_path / "d.tar")
    assert members["a"].isreg() and members["a"].size == 100 << 20
    assert [(members[n].islnk(), members[n].linkname) for n in ("b", "sub/c")] == [(True, "a")] * 2
    assert (tmp_path / "d.tar").stat().st_size < (100 << 20) + 64 * 1024  # stored once
    assert (stats.files, stats.hardlinks) == (1, 2)
    apply(str(root), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))
    assert {(root / n).stat().st_ino for n in ("a", "b", "sub/c")} == {(root / "a").stat().st_ino}
    assert (root / "a").stat().st_nlink == 3
    assert (root / "sub" / "c").read_bytes() == (upper / "a").read_bytes()


def test_capture_keeps_fifos_and_apply_recreates_them_but_sockets_are_skipped(tmp_path: Path) -> None:
    """A fifo of the writable layer (a process of the tree may hold it open, and CRIU's restore
    reopens it by name) was left out of the capture: that artifact could never restore."""
    upper, root = tmp_path / "upper", tmp_path / "root"
    upper.mkdir()
    root.mkdir()
    (upper / "run").mkdir()
    os.mkfifo(upper / "run" / "fifo", 0o640)
    os.utime(upper / "run" / "fifo", ns=(1_600_000_000_123_456_789,) * 2)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(upper / "sock"))
    try:
        stats = capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"),
                        exclude=[])
    finally:
        sock.close()
    assert sorted(read_tar(tmp_path / "d.tar")) == ["run", "run/fifo"]
    assert read_tar(tmp_path / "d.tar")["run/fifo"].isfifo()
    assert stats.skipped == ["sock (socket)"] and stats.fifos == 1
    applied = apply(str(root), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))
    st = (root / "run" / "fifo").lstat()
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640, oct(st.st_mode)
    assert st.st_mtime_ns == 1_600_000_000_123_456_789 and applied.fifos == 1


@pytest.mark.parametrize("exclude, kept", [
    (["/proc", "/etc/hosts"], ["etc", "etc/keep", "var", "var/x"]),
    (["etc"], ["proc", "proc/x", "var", "var/x"]),
    (["/var/x/"], ["etc", "etc/hosts", "etc/keep", "proc", "proc/x", "var"]),
    (["/etc/../proc"], ["etc", "etc/hosts", "etc/keep", "var", "var/x"]),
], ids=["file-and-dir", "dir-subtree", "trailing-slash", "normalised"])
def test_capture_skips_excluded_paths_and_everything_below(tmp_path: Path, exclude: list[str],
                                                           kept: list[str]) -> None:
    upper = tmp_path / "upper"
    for rel in ("etc/hosts", "etc/keep", "proc/x", "var/x"):
        (upper / rel).parent.mkdir(parents=True, exist_ok=True)
        (upper / rel).write_bytes(b"1")
    capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=exclude)
    assert sorted(read_tar(tmp_path / "d.tar")) == kept


def test_capture_keeps_user_xattrs_including_binary_values(tmp_path: Path) -> None:
    upper, root = tmp_path / "upper", tmp_path / "root"
    upper.mkdir()
    root.mkdir()
    (upper / "f").write_bytes(b"1")
    os.setxattr(upper / "f", "user.bin", b"\x00\xff\xfe binary")
    os.setxattr(upper / "f", "user.text", "héllo".encode())
    capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[])
    apply(str(root), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))
    assert os.getxattr(root / "f", "user.bin") == b"\x00\xff\xfe binary"
    assert os.getxattr(root / "f", "user.text") == "héllo".encode()


@needs_root
def test_capture_turns_whiteouts_and_opaque_dirs_into_deletions(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    (upper / "etc" / "opaque").mkdir(parents=True)
    (upper / "etc" / "opaque" / "new").write_bytes(b"n")
    os.setxattr(upper / "etc" / "opaque", "trusted.overlay.opaque", b"y")
    os.mknod(upper / "etc" / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    os.mknod(upper / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    stats = capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[])
    assert json.loads((tmp_path / "d.json").read_text()) == [
        {"path": "etc/gone", "type": "whiteout"}, {"path": "etc/opaque", "type": "opaque"}]
    members = read_tar(tmp_path / "d.tar")
    assert sorted(members) == ["etc", "etc/opaque", "etc/opaque/new"]
    assert not any(k.startswith("SCHILY.xattr.trusted.overlay")
                   for m in members.values() for k in m.pax_headers)
    assert stats.skipped == ["null (device node)"] and stats.whiteouts == 1 and stats.opaque == 1


@needs_root
@pytest.mark.parametrize("kind, xattr", [("dir", "trusted.overlay.redirect"),
                                          ("file", "trusted.overlay.metacopy")],
                         ids=["redirect-dir", "metacopy-file"])
def test_capture_refuses_overlay_features_with_data_in_lower_layers(tmp_path: Path, kind: str,
                                                                    xattr: str) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    target = upper / "x"
    target.mkdir() if kind == "dir" else target.write_bytes(b"")
    os.setxattr(target, xattr, b"/elsewhere" if kind == "dir" else b"")
    with pytest.raises(OverlayError, match="lower layer"):
        capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[])
    assert not (tmp_path / "d.tar").exists() and not (tmp_path / "d.tar.tmp").exists()


def test_capture_then_apply_keeps_long_and_undecodable_names(tmp_path: Path) -> None:
    upper, root = tmp_path / "upper", tmp_path / "root"
    root.mkdir()
    deep = upper / ("d" * 120) / ("e" * 120)
    deep.mkdir(parents=True)
    (deep / ("f" * 200)).write_bytes(b"long")
    raw = os.fsencode(upper) + b"/caf\xe9-\xff.bin"  # not UTF-8
    with open(raw, "wb") as f:
        f.write(b"latin-1")
    (upper / "h\u00e9llo").symlink_to("t" * 300)
    capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[])
    apply(str(root), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))
    assert snapshot(root) == snapshot(upper)
    assert open(os.fsencode(root) + b"/caf\xe9-\xff.bin", "rb").read() == b"latin-1"
    assert os.readlink(root / "h\u00e9llo") == "t" * 300


# --- real overlayfs round trip --------------------------------------------------------------------

@pytest.fixture
def overlay(tmp_path: Path) -> Iterator[Any]:
    mounted: list[Path] = []

    def mount(name: str, lower: Path) -> tuple[Path, Path]:
        upper, work, merged = (tmp_path / name / d for d in ("upper", "work", "merged"))
        for d in (upper, work, merged):
            d.mkdir(parents=True)
        result = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                                 f"lowerdir={lower},upperdir={upper},workdir={work}",
                                 str(merged)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"mount -t overlay failed: {result.stderr.strip()}")
        mounted.append(merged)
        return upper, merged

    yield mount
    for merged in reversed(mounted):
        subprocess.run(["umount", str(merged)], check=False)


@needs_root
def test_capture_then_apply_reproduces_the_merged_tree_on_a_fresh_overlay(
        tmp_path: Path, overlay: Any) -> None:
    lower = tmp_path / "lower"
    for rel, data in {"etc/config": b"old", "etc/remove-me": b"x", "usr/lib/a.so": b"a",
                      "cache/old/1": b"1", "cache/old/2": b"2", "bin/tool": b"#!"}.items():
        (lower / rel).parent.mkdir(parents=True, exist_ok=True)
        (lower / rel).write_bytes(data)
    (lower / "lib").symlink_to("usr/lib")
    upper_a, a = overlay("a", lower)
    (a / "etc" / "config").write_bytes(b"new content")
    (a / "etc" / "remove-me").unlink()
    (a / "usr" / "lib" / "a.so").unlink()
    subprocess.run(["rm", "-rf", str(a / "cache")], check=True)
    (a / "cache").mkdir()
    (a / "cache" / "fresh").write_bytes(b"f")
    os.chown(a / "bin" / "tool", 1000, 1001)
    (a / "bin" / "tool").chmod(0o4755)
    (a / "models" / "qwen").mkdir(parents=True)
    (a / "models" / "qwen" / "w.bin").write_bytes(os.urandom(300_000))
    os.setxattr(a / "models" / "qwen" / "w.bin", "user.digest", b"\x00\x01")
    (a / "models" / "latest").symlink_to("qwen")
    os.link(a / "models" / "qwen" / "w.bin", a / "models" / "w-link.bin")
    (a / "etc" / "hosts").write_bytes(b"10.0.0.1 source-pod")
    (a / "proc").mkdir()
    os.mkfifo(a / "models" / "fifo")
    os.utime(a / "etc" / "config", ns=(1_600_000_000_123_456_789,) * 2)

    upper_b, b = overlay("b", lower)
    (b / "etc" / "hosts").write_bytes(b"10.0.0.2 target-pod")
    stats = capture(str(upper_a), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))
    assert json.loads((tmp_path / "d.json").read_text()) == [
        {"path": "cache", "type": "opaque"}, {"path": "etc/remove-me", "type": "whiteout"},
        {"path": "usr/lib/a.so", "type": "whiteout"}]
    assert stats.skipped == [] and stats.hardlinks == 1 and stats.fifos == 1
    applied = apply(str(b), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))
    assert applied.deleted == 3 and applied.opaque == 1  # cache/old + two whiteouts

    expected, got = snapshot(a), snapshot(b)
    for rel in ("proc", "etc/hosts"):
        expected.pop(rel)
        got.pop(rel, None)
    assert got == expected
    assert (b / "etc" / "hosts").read_bytes() == b"10.0.0.2 target-pod"
    assert not (b / "cache" / "old").exists() and (b / "cache" / "fresh").read_bytes() == b"f"
    assert stat.S_IMODE((b / "bin" / "tool").stat().st_mode) == 0o4755
    assert (b / "etc" / "config").stat().st_mtime_ns == 1_600_000_000_123_456_789
    assert (b / "models" / "w-link.bin").stat().st_ino == (b / "models" / "qwen" / "w.bin").stat().st_ino


# --- hostile archives -------------------------------------------------------------------------

def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"pwned", link: str = "",
           pax: dict[str, str] | None = None) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.pax_headers = pax or {}
    return info, data


def write_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A target rootfs next to an ``outside`` tree that must never change."""
    rootfs, outside = tmp_path / "rootfs", tmp_path / "outside"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "passwd").write_bytes(b"root:x:0:0")
    (outside / "etc").mkdir(parents=True)
    (outside / "etc" / "passwd").write_bytes(b"host")
    (rootfs / "planted").symlink_to(outside)
    (rootfs / "planted-file").symlink_to(outside / "etc" / "passwd")
    (tmp_path / "d.json").write_text("[]")
    before_outside, before_shadow = snapshot(outside), host_shadow()
    yield rootfs, outside
    assert snapshot(outside) == before_outside
    assert host_shadow() == before_shadow
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.json", "d.tar", "outside", "rootfs"]


HOSTILE = [
    ([member("../outside/etc/passwd")], "entry '../outside/etc/passwd': not a normalised"),
    ([member("etc/../../outside/x")], "not a normalised"),
    ([member("/etc/passwd")], "entry '/etc/passwd': not a normalised"),
    ([member("./etc/passwd")], "not a normalised"),
    ([member("link", tarfile.SYMTYPE, link=".."), member("link/outside/etc/passwd")],
     "parent 'link' is a symlink earlier in the archive"),
    ([member("esc", tarfile.SYMTYPE, link="/"), member("esc/etc/passwd")],
     "parent 'esc' is a symlink earlier in the archive"),
    ([member("a", tarfile.SYMTYPE, link="../../../../../../.."),
      member("a/var/pwned")], "parent 'a' is a symlink"),
    ([member("planted/etc/passwd")], "entry 'planted/etc/passwd': parent 'planted' is a symlink"),
    ([member("shadow", tarfile.LNKTYPE, link="/etc/shadow")],
     "hardlink to '/etc/shadow' points outside"),
    ([member("shadow", tarfile.LNKTYPE, link="../../../../etc/shadow")], "points outside"),
    ([member("p", tarfile.LNKTYPE, link="planted-file")], "is not a regular file"),
    ([member("p", tarfile.LNKTYPE, link="etc/passwd")],
     "hardlink target 'etc/passwd' is not a regular file earlier in the archive"),
    ([member("p", tarfile.LNKTYPE, link="f"), member("f")], "not a regular file earlier"),
    ([member("f"), member("f", tarfile.SYMTYPE, link="/etc/shadow"),
      member("p", tarfile.LNKTYPE, link="f")], "not a regular file earlier"),
    ([member("d", tarfile.SYMTYPE, link="/etc"), member("p", tarfile.LNKTYPE, link="d/shadow")],
     "hardlink target 'd/shadow' is below symlink 'd'"),
    ([member("dev/sda", tarfile.BLKTYPE)], "entry 'dev/sda': device nodes"),
    ([member("mem", tarfile.CHRTYPE)], "device nodes are not allowed"),
    ([member("f", pax={"SCHILY.xattr.trusted.overlay.opaque": "y"})], "xattr"),
    ([member("f", pax={"SCHILY.xattr.system.nfs4_acl": "x"})], "xattr 'system.nfs4_acl'"),
]


@pytest.mark.parametrize("members, needle", HOSTILE, ids=[
    "dotdot-escape", "inner-dotdot", "absolute", "dot-prefix", "symlink-then-write-through",
    "symlink-to-root-then-write", "symlink-dir-traversal", "write-through-planted-symlink",
    "hardlink-to-etc-shadow", "hardlink-dotdot", "hardlink-to-planted-symlink",
    "hardlink-to-a-file-of-the-image", "hardlink-before-its-target", "hardlink-to-a-replaced-target",
    "hardlink-through-a-symlink-member", "block-device",
    "char-device", "overlay-xattr", "unknown-xattr"])
def test_apply_refuses_hostile_archive_and_changes_nothing_outside(
        tmp_path: Path, sandbox: tuple[Path, Path], members: list[Any], needle: str) -> None:
    rootfs, _ = sandbox
    tar = write_tar(tmp_path / "d.tar", members)
    with pytest.raises(OverlayError, match=needle.replace("(", r"\(")):
        apply(str(rootfs), str(tar), str(tmp_path / "d.json"))
    assert not (rootfs / "pwned").exists() and (rootfs / "etc" / "passwd").read_bytes() == b"root:x:0:0"


def test_apply_replaces_a_planted_symlink_instead_of_writing_through_it(
        tmp_path: Path, sandbox: tuple[Path, Path]) -> None:
    rootfs, outside = sandbox
    tar = write_tar(tmp_path / "d.tar", [member("planted-file", data=b"mine"),
                                         member("planted", tarfile.DIRTYPE),
                                         member("planted/x", data=b"inside")])
    apply(str(rootfs), str(tar), str(tmp_path / "d.json"))
    assert (rootfs / "planted-file").read_bytes() == b"mine"
    assert not (rootfs / "planted-file").is_symlink()
    assert (rootfs / "planted" / "x").read_bytes() == b"inside"
    assert not (outside / "x").exists()


def test_apply_creates_symlinks_with_any_target_but_never_follows_them(
        tmp_path: Path, sandbox: tuple[Path, Path]) -> None:
    rootfs, _ = sandbox
    tar = write_tar(tmp_path / "d.tar", [member("abs", tarfile.SYMTYPE, link="/etc/shadow"),
                                         member("rel", tarfile.SYMTYPE, link="../../outside"),
                                         member("etc/new", data=b"n"),
                                         member("ok", tarfile.LNKTYPE, link="etc/new")])
    stats = apply(str(rootfs), str(tar), str(tmp_path / "d.json"))
    assert os.readlink(rootfs / "abs") == "/etc/shadow"
    assert os.readlink(rootfs / "rel") == "../../outside"
    assert (rootfs / "ok").stat().st_ino == (rootfs / "etc" / "new").stat().st_ino
    assert (stats.symlinks, stats.hardlinks) == (2, 1)


@pytest.mark.parametrize("deletions, needle", [
    ([{"path": "../outside/etc/passwd", "type": "whiteout"}], "not a normalised"),
    ([{"path": "/etc/passwd", "type": "whiteout"}], "not a normalised"),
    ([{"path": "etc/\u0000x", "type": "whiteout"}], "not a normalised"),
    ([{"path": "planted/etc/passwd", "type": "whiteout"}], "parent 'planted' is a symlink"),
    ([{"path": "planted/etc", "type": "opaque"}], "parent 'planted' is a symlink"),
    ([{"path": "etc", "type": "rmrf"}], "bad entry"),
    ([{"path": "etc", "type": "whiteout", "extra": 1}], "bad entry"),
    (["etc"], "bad entry"),
    ({"path": "etc"}, "not a JSON list"),
], ids=["dotdot", "absolute", "nul", "through-planted-symlink", "opaque-through-symlink",
        "unknown-type", "unknown-key", "bare-string", "not-a-list"])
def test_apply_refuses_hostile_deletions(tmp_path: Path, sandbox: tuple[Path, Path],
                                         deletions: Any, needle: str) -> None:
    rootfs, _ = sandbox
    tar = write_tar(tmp_path / "d.tar", [])
    (tmp_path / "d.json").write_text(json.dumps(deletions))
    with pytest.raises(OverlayError, match=needle):
        apply(str(rootfs), str(tar), str(tmp_path / "d.json"))
    assert (rootfs / "etc" / "passwd").exists()


@pytest.mark.parametrize("raw, needle", [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 2"),  # json.loads: RecursionError
    (b'[[{"path": "etc/passwd", "type": "whiteout"}]]', "nested deeper than 2"),
    (b'[{"path": "etc/passwd", "type": "opaque", "type": "whiteout"}]', "duplicate key"),
    (b'[{"path": "etc/\\ud800", "type": "whiteout"}]', "lone surrogate U\\+D800"),  # before any change
    (b'[{"path": "etc/\xff", "type": "whiteout"}]', "not UTF-8"),
], ids=["deep", "nested-list", "duplicate-key", "lone-surrogate", "not-utf8"])
def test_apply_parses_the_deletions_strictly(tmp_path: Path, sandbox: tuple[Path, Path], raw: bytes,
                                             needle: str) -> None:
    rootfs, _ = sandbox
    tar = write_tar(tmp_path / "d.tar", [])
    (tmp_path / "d.json").write_bytes(raw)
    with pytest.raises(OverlayError, match=needle):
        apply(str(rootfs), str(tar), str(tmp_path / "d.json"))
    assert (rootfs / "etc" / "passwd").exists()


@needs_root
def test_a_whiteout_of_a_name_that_is_not_utf8_still_comes_back(tmp_path: Path) -> None:
    upper, root = tmp_path / "upper", tmp_path / "root"
    upper.mkdir()
    os.mknod(os.path.join(os.fsencode(upper), b"gone-\xff"), stat.S_IFCHR | 0o000, os.makedev(0, 0))
    capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[])
    assert b"\\udcff" in (tmp_path / "d.json").read_bytes()  # os.fsdecode's stand-in for the byte
    root.mkdir()
    (root / os.fsdecode(b"gone-\xff")).write_bytes(b"in the image")
    stats = apply(str(root), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))
    assert stats.deleted == 1 and os.listdir(root) == []


@pytest.mark.parametrize("kind", ["whiteout", "opaque"])
def test_apply_deletes_a_symlink_itself_never_its_target(tmp_path: Path,
                                                         sandbox: tuple[Path, Path],
                                                         kind: str) -> None:
    rootfs, _ = sandbox
    tar = write_tar(tmp_path / "d.tar", [])
    (tmp_path / "d.json").write_text(json.dumps([{"path": "planted", "type": kind},
                                                 {"path": "planted-file", "type": kind}]))
    stats = apply(str(rootfs), str(tar), str(tmp_path / "d.json"))
    assert not os.path.lexists(rootfs / "planted") and not os.path.lexists(rootfs / "planted-file")
    assert stats.deleted == 2


def test_apply_empties_an_opaque_dir_and_ignores_missing_paths(tmp_path: Path,
                                                               sandbox: tuple[Path, Path]) -> None:
    rootfs, _ = sandbox
    (rootfs / "etc" / "sub").mkdir()
    (rootfs / "etc" / "sub" / "f").write_bytes(b"")
    tar = write_tar(tmp_path / "d.tar", [member("etc/new", data=b"n")])
    (tmp_path / "d.json").write_text(json.dumps([{"path": "etc", "type": "opaque"},
                                                 {"path": "no/such/thing", "type": "whiteout"}]))
    stats = apply(str(rootfs), str(tar), str(tmp_path / "d.json"))
    assert sorted(os.listdir(rootfs / "etc")) == ["new"]
    assert (stats.opaque, stats.deleted, stats.files) == (1, 2, 1)


def test_apply_rejects_a_file_that_is_not_a_tar(tmp_path: Path, sandbox: tuple[Path, Path]) -> None:
    rootfs, _ = sandbox
    (tmp_path / "d.tar").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(OverlayError, match="not a valid archive"):
        apply(str(rootfs), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))


@pytest.mark.parametrize("pax", [{"mtime": "1e999999"}, {"uid": "99999999999999999999"}],
                         ids=["huge-mtime", "huge-uid"])
def test_apply_turns_absurd_metadata_into_an_overlay_error(tmp_path: Path,
                                                           sandbox: tuple[Path, Path],
                                                           pax: dict[str, str]) -> None:
    rootfs, _ = sandbox
    tar = write_tar(tmp_path / "d.tar", [member("f", pax=pax)])
    with pytest.raises(OverlayError):
        apply(str(rootfs), str(tar), str(tmp_path / "d.json"))


# --- sparse files -----------------------------------------------------------------------------

def extents(path: Path) -> tuple[int, list[tuple[int, str]]]:
    """Size and (offset, sha256) of each data extent: equal for two files means equal bytes and
    equal holes (a hole reads as zeros), without reading gigabytes of zeros."""
    out, fd = [], os.open(path, os.O_RDONLY)
    try:
        size, pos = os.fstat(fd).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, hashlib.sha256(os.pread(fd, end - start, start)).hexdigest()))
            pos = end
        return size, out
    finally:
        os.close(fd)


def make_sparse(path: Path, size: int, chunks: dict[int, bytes]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in chunks.items():
            f.seek(offset)
            f.write(data)


@pytest.mark.parametrize("tail", [False, True], ids=["ends-in-a-hole", "ends-in-data"])
def test_capture_stores_a_sparse_file_sparsely_and_gnu_tar_and_apply_restore_its_holes(
        tmp_path: Path, tail: bool) -> None:
    upper, root, gnu = tmp_path / "upper", tmp_path / "root", tmp_path / "gnu"
    for d in (upper, root, gnu):
        d.mkdir()
    size = 2 << 30
    chunks = {1 << 30: os.urandom(4096)}
    if tail:
        chunks[size - 4096] = os.urandom(4096)
    make_sparse(upper / "sparse.bin", size, chunks)
    os.utime(upper / "sparse.bin", ns=(1_700_000_000_000_000_001,) * 2)
    expected = extents(upper / "sparse.bin")

    stats = capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[])
    assert (tmp_path / "d.tar").stat().st_size < 16 * 1024 + 4096 * len(chunks)
    assert (stats.files, stats.sparse, stats.bytes) == (1, 1, size)
    info = read_tar(tmp_path / "d.tar")["sparse.bin"]
    assert info.size == size and info.sparse is not None
    assert info.pax_headers["GNU.sparse.major"] == "1" and info.pax_headers["GNU.sparse.minor"] == "0"

    listing = subprocess.run(["tar", "-tvf", str(tmp_path / "d.tar")], capture_output=True,
                             text=True, check=True).stdout
    assert listing.split()[2:3] == [str(size)] and listing.rstrip().endswith(" sparse.bin")
    subprocess.run(["tar", "-xSf", str(tmp_path / "d.tar"), "-C", str(gnu)], check=True)
    assert extents(gnu / "sparse.bin") == expected
    assert (gnu / "sparse.bin").stat().st_blocks * 512 < 1 << 20

    applied = apply(str(root), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))
    assert extents(root / "sparse.bin") == expected
    assert (root / "sparse.bin").stat().st_blocks * 512 < 1 << 20
    assert (root / "sparse.bin").stat().st_mtime_ns == 1_700_000_000_000_000_001
    assert applied.bytes == 4096 * len(chunks)


def test_capture_merges_extents_beyond_the_map_limit(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.overlay.tar as overlay_tar
    monkeypatch.setattr(overlay_tar, "MAX_SPARSE_EXTENTS", 5)
    upper, root = tmp_path / "upper", tmp_path / "root"
    upper.mkdir()
    root.mkdir()
    # 4 clusters of 4 extents 64 KiB apart: the gaps inside a cluster are the ones stored as zeros
    make_sparse(upper / "f", 64 << 20, {c * (16 << 20) + i * (64 << 10): os.urandom(4096)
                                        for c in range(4) for i in range(4)})
    capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[])
    info = read_tar(tmp_path / "d.tar")["f"]
    assert info.sparse is not None and len(info.sparse) == 5  # 4 clusters and the end marker
    assert (tmp_path / "d.tar").stat().st_size < 1 << 20
    apply(str(root), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))
    assert (root / "f").read_bytes() == (upper / "f").read_bytes()


# --- caps and deadline ------------------------------------------------------------------------

def test_capture_refuses_a_layer_over_the_cap_and_leaves_no_output(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "small").write_bytes(b"s" * 1000)
    (upper / "big").write_bytes(os.urandom(2 << 20))
    with pytest.raises(OverlayError, match="exceeds the writable-layer cap of 1048576 bytes"):
        capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[],
                max_bytes=1 << 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["upper"]
    # holes do not count: a 2 GiB sparse file fits a 1 MiB cap
    (upper / "big").unlink()
    make_sparse(upper / "big", 2 << 30, {0: b"d" * 4096})
    stats = capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[],
                    max_bytes=1 << 20)
    assert (tmp_path / "d.tar").stat().st_size == stats.stored_bytes <= 1 << 20


def test_capture_stops_at_its_deadline_and_leaves_no_output(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "f").write_bytes(b"1")
    with pytest.raises(OverlayError, match="deadline"):
        capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[],
                deadline=time.monotonic() - 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["upper"]


def sparse_member(name: str, realsize: int, extent_map: list[tuple[int, int]], data: bytes,
                  count: int | None = None) -> tuple[tarfile.TarInfo, bytes]:
    """A PAX 1.0 sparse member with any map, as a hostile archive could carry."""
    smap = f"{len(extent_map) if count is None else count}\n".encode()
    smap += b"".join(f"{o}\n{n}\n".encode() for o, n in extent_map)
    smap += bytes(-len(smap) % 512)
    info, _ = member("GNUSparseFile.0/" + name, data=smap + data, pax={
        "GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name,
        "GNU.sparse.realsize": str(realsize)})
    return info, smap + data


@pytest.mark.parametrize("members, max_bytes, needle", [
    ([member("big", data=b"x" * (2 << 20))], 1 << 20, "exceeds the writable-layer cap of 1048576"),
    ([member("a", data=b"x" * 700_000), member("b", data=b"x" * 700_000)], 1 << 20,
     "entry 'b': the archive exceeds the writable-layer cap"),
    ([sparse_member("s", 1 << 40, [(0, 4096)], b"x" * 4096)], 4096, "writable-layer cap"),
    ([sparse_member("s", 4096, [(0, 4096), (8192, 4096)], b"x" * 8192)], None,
     "outside its declared size"),
    ([sparse_member("s", 1 << 30, [(8192, 4096), (0, 4096)], b"x" * 8192)], None,
     "out of order"),
    ([sparse_member("s", 1 << 30, [(0, 1 << 29)], b"x" * 4096)], None,
     "declares more data than the archive stores"),
    ([sparse_member("s", 1 << 30, [(0, 1)], b"x", count=1 << 20)], None,
     "sparse map of 1048576 extents is longer than"),
    ([sparse_member("s", 1 << 30, [(0, 1)], b"x", count=3)], None, "malformed sparse map"),
], ids=["member-over-cap", "sum-over-cap", "sparse-stored-over-cap", "map-beyond-real-size",
        "map-out-of-order", "map-data-beyond-stored", "map-too-long", "map-truncated"])
def test_apply_bounds_every_member_before_writing_anything(
        tmp_path: Path, sandbox: tuple[Path, Path], members: list[Any], max_bytes: int | None,
        needle: str) -> None:
    rootfs, _ = sandbox
    before = snapshot(rootfs)
    tar = write_tar(tmp_path / "d.tar", [member("etc/passwd", data=b"first"), *members])
    with pytest.raises(OverlayError, match=needle):
        apply(str(rootfs), str(tar), str(tmp_path / "d.json"),
              **({} if max_bytes is None else {"max_bytes": max_bytes}))
    assert snapshot(rootfs) == before


def test_apply_refuses_an_oversized_extended_header(tmp_path: Path,
                                                    sandbox: tuple[Path, Path]) -> None:
    rootfs, _ = sandbox
    tar = write_tar(tmp_path / "d.tar", [member("f", pax={"SCHILY.xattr.user.x": "v" * (2 << 20)})])
    with pytest.raises(OverlayError, match="extended header of .* bytes is larger than"):
        apply(str(rootfs), str(tar), str(tmp_path / "d.json"))


# --- all or nothing -----------------------------------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Any]:
    """mount(name, size): a tmpfs of that size under tmp_path, unmounted at teardown."""
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=755", "tmpfs",
                                 str(mnt)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"mount -t tmpfs failed: {result.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in reversed(mounted):
        subprocess.run(["umount", str(mnt)], check=True)


def image_tree(root: Path) -> None:
    """What a container image's rootfs could hold."""
    for rel, data in {"etc/passwd": b"root:x:0:0", "etc/group": b"root:x:0:", "usr/lib/x.so": b"so",
                      "cache/old/1": b"1", "cache/2": b"2", "opt/tool": b"#!/bin/sh",
                      "var/data": os.urandom(100_000)}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "lib").symlink_to("usr/lib")
    os.chown(root / "opt" / "tool", 1000, 1000)
    (root / "opt" / "tool").chmod(0o4755)
    os.setxattr(root / "etc" / "passwd", "user.origin", b"image")
    (root / "etc").chmod(0o751)
    for i, p in enumerate(sorted(root.rglob("*"), reverse=True)):
        os.utime(p, ns=(1_500_000_000_000_000_000 + i,) * 2, follow_symlinks=False)


LATE = {
    "enospc": [member("big", data=os.urandom(2 << 20))],
    "missing-parent": [member("no/such/dir/f")],
    "hardlink-target-gone": [member("t", tarfile.DIRTYPE), member("t/f"), member("t"),
                             member("l", tarfile.LNKTYPE, link="t/f")],
    "parent-is-a-symlink-of-the-image": [member("lib/pwned")],
}


@needs_root
@pytest.mark.parametrize("late", sorted(LATE))
def test_a_late_failure_leaves_the_rootfs_exactly_as_it_was(tmp_path: Path, tmpfs: Any,
                                                             late: str) -> None:
    rootfs = tmpfs("rootfs", "1m")  # "big" (2 MiB) does not fit: ENOSPC half way
    image_tree(rootfs)
    before = snapshot(rootfs)
    (tmp_path / "d.json").write_text(json.dumps([{"path": "etc/group", "type": "whiteout"},
                                                 {"path": "cache", "type": "opaque"},
                                                 {"path": "usr/lib", "type": "whiteout"}]))
    tar = write_tar(tmp_path / "d.tar", [
        member("etc", tarfile.DIRTYPE, pax={"SCHILY.xattr.user.new": "1"}),
        member("etc/passwd", data=b"changed"), member("cache", tarfile.DIRTYPE),
        member("cache/fresh"), member("opt/tool", tarfile.DIRTYPE), member("opt/tool/x"),
        member("new", tarfile.DIRTYPE), *(member(f"new/{i}") for i in range(50)),
        member("var/data", tarfile.SYMTYPE, link="/elsewhere"), *LATE[late]])
    with pytest.raises(OverlayError):
        apply(str(rootfs), str(tar), str(tmp_path / "d.json"))
    assert snapshot(rootfs) == before
    assert os.statvfs(rootfs).f_bfree > 0 and not list(rootfs.glob(".rekindle-undo-*"))


@needs_root
@pytest.mark.parametrize("fail", [False, True], ids=["applied", "rolled-back"])
def test_deleting_lower_layer_directories_of_an_overlay_is_all_or_nothing(
        tmp_path: Path, overlay: Any, fail: bool) -> None:
    lower = tmp_path / "lower"
    image_tree(lower)
    (lower / "usr" / "lib" / "sub").mkdir()
    (lower / "usr" / "lib" / "sub" / "y").write_bytes(b"y")
    _, merged = overlay("c", lower)
    before = snapshot(merged)
    (tmp_path / "d.json").write_text(json.dumps([{"path": "usr/lib", "type": "whiteout"},
                                                 {"path": "cache", "type": "opaque"}]))
    tar = write_tar(tmp_path / "d.tar", [member("etc/passwd", data=b"changed"),
                                         member("cache/fresh", data=b"f"),
                                         *([member("no/parent")] if fail else [])])
    if fail:
        with pytest.raises(OverlayError, match="parent 'no' missing"):
            apply(str(merged), str(tar), str(tmp_path / "d.json"))
        assert snapshot(merged) == before
    else:
        apply(str(merged), str(tar), str(tmp_path / "d.json"))
        assert sorted(os.listdir(merged / "usr")) == [] and os.listdir(merged / "cache") == ["fresh"]
        assert (merged / "etc" / "passwd").read_bytes() == b"changed"
    assert not list(merged.glob(".rekindle-undo-*"))


# --- streaming ----------------------------------------------------------------------------------

@needs_root
def test_capture_and_apply_of_many_files_stay_in_bounded_memory(tmp_path: Path, tmpfs: Any) -> None:
    # 5,000 files: holding every member's header would cost ~3 MiB here (0.75 GiB for a million);
    # streamed, both stay near 0.3 MiB whatever the count (bench/overlay_memory.py measures a
    # million). tmpfs keeps the file creation fast.
    upper, root = tmpfs("upper", "256m"), tmpfs("root", "256m")
    for d in range(5):
        (upper / f"d{d:02d}").mkdir()
        for i in range(1000):
            os.close(os.open(upper / f"d{d:02d}" / f"f{i:04d}", os.O_CREAT | os.O_WRONLY, 0o644))
    peaks = []
    for step in (lambda: capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"),
                                 exclude=[]),
                 lambda: apply(str(root), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))):
        tracemalloc.start()
        try:
            step()
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert len(os.listdir(root / "d04")) == 1000
    assert max(peaks) < 1 << 20, [f"{p / 2**20:.1f} MiB" for p in peaks]
