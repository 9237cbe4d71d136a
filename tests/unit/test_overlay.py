"""Overlay capture and apply: a real overlayfs round trip, whiteouts, and hostile archives."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import OverlayError
from runtime.overlay import apply, capture

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


def test_capture_stores_hardlinks_as_independent_regular_files(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "a").write_bytes(b"data")
    os.link(upper / "a", upper / "b")
    stats = capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[])
    members = read_tar(tmp_path / "d.tar")
    assert members["a"].isreg() and members["b"].isreg() and members["b"].size == 4
    assert stats.hardlinks == 2 and stats.files == 2


def test_capture_skips_fifos_and_sockets_with_a_reason(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    os.mkfifo(upper / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(upper / "sock"))
    try:
        stats = capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"),
                        exclude=[])
    finally:
        sock.close()
    assert read_tar(tmp_path / "d.tar") == {}
    assert stats.skipped == ["fifo (fifo)", "sock (socket)"]


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
    assert stats.skipped == ["models/fifo (fifo)"] and stats.hardlinks == 2
    applied = apply(str(b), str(tmp_path / "d.tar"), str(tmp_path / "d.json"))
    assert applied.deleted == 3 and applied.opaque == 1  # cache/old + two whiteouts

    expected, got = snapshot(a), snapshot(b)
    for rel in ("models/fifo", "proc", "etc/hosts"):
        expected.pop(rel)
        got.pop(rel, None)
    assert got == expected
    assert (b / "etc" / "hosts").read_bytes() == b"10.0.0.2 target-pod"
    assert not (b / "cache" / "old").exists() and (b / "cache" / "fresh").read_bytes() == b"f"
    assert stat.S_IMODE((b / "bin" / "tool").stat().st_mode) == 0o4755
    assert (b / "etc" / "config").stat().st_mtime_ns == 1_600_000_000_123_456_789


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
    ([member("dev/sda", tarfile.BLKTYPE)], "entry 'dev/sda': device nodes"),
    ([member("mem", tarfile.CHRTYPE)], "device nodes and fifos"),
    ([member("pipe", tarfile.FIFOTYPE)], "device nodes and fifos"),
    ([member("f", pax={"SCHILY.xattr.trusted.overlay.opaque": "y"})], "xattr"),
    ([member("f", pax={"SCHILY.xattr.system.nfs4_acl": "x"})], "xattr 'system.nfs4_acl'"),
]


@pytest.mark.parametrize("members, needle", HOSTILE, ids=[
    "dotdot-escape", "inner-dotdot", "absolute", "dot-prefix", "symlink-then-write-through",
    "symlink-to-root-then-write", "symlink-dir-traversal", "write-through-planted-symlink",
    "hardlink-to-etc-shadow", "hardlink-dotdot", "hardlink-to-planted-symlink", "block-device",
    "char-device", "fifo", "overlay-xattr", "unknown-xattr"])
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
                                         member("ok", tarfile.LNKTYPE, link="etc/passwd")])
    stats = apply(str(rootfs), str(tar), str(tmp_path / "d.json"))
    assert os.readlink(rootfs / "abs") == "/etc/shadow"
    assert os.readlink(rootfs / "rel") == "../../outside"
    assert (rootfs / "ok").stat().st_ino == (rootfs / "etc" / "passwd").stat().st_ino
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
