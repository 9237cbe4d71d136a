"""Capture a container's overlayfs upperdir into a tar; apply it to another container's rootfs.

Contract:

- :func:`capture` walks the upperdir through directory fds and never follows a symlink. It
  writes regular files, directories and symlinks (as symlinks) into a PAX tar with mode,
  uid/gid, mtime and xattrs (``SCHILY.xattr.*``; overlayfs' own ``trusted.overlay.*`` and
  ``user.overlay.*`` are left out). A file with several hardlinks is stored once per link as
  an independent regular file (links are not preserved). Whiteouts (char device 0:0, or a file
  carrying an ``overlay.whiteout`` xattr) become ``{"path", "type": "whiteout"}`` entries of the
  deletions JSON; opaque dirs (``overlay.opaque=y``) become ``"opaque"`` entries and are also
  captured. Device nodes, sockets and fifos are skipped with a logged reason. Excluded paths
  (bind-mount destinations, /proc, /sys, /dev, ...) are skipped with everything below them.
  Overlay features whose data lives in the lower layers (``redirect``, ``metacopy``) raise
  :class:`OverlayError` rather than produce a wrong capture.
- :func:`apply` treats the tar and the deletions JSON as untrusted. Before anything is written it
  checks every member: a relative, normalised name without NUL; a type among dir, regular file,
  symlink and hardlink (devices and fifos are refused); no parent that an earlier member made a
  symlink; a hardlink target that is itself a valid relative name; only allowed xattr names.
  Then it deletes (whiteouts; opaque dirs are emptied), and writes each member by opening its
  parent one component at a time with ``O_NOFOLLOW|O_DIRECTORY`` from an fd of the rootfs, so a
  symlink on the way (planted in the archive or in the rootfs) is refused, never followed. An
  existing entry at a member's name is removed and the new one is created with
  ``O_CREAT|O_EXCL|O_NOFOLLOW``; owner, mode, xattrs and mtime are set through the fd. Symlink
  targets are stored verbatim: they are only ever resolved inside the container. Nothing is
  ever created or changed outside ``rootfs``.
"""

from __future__ import annotations

import decimal
import errno
import json
import logging
import os
import posixpath
import shutil
import stat
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field

from runtime.errors import OverlayError

log = logging.getLogger(__name__)

DEFAULT_EXCLUDES = ("rekindle", ".rekindle", "etc/hosts", "etc/resolv.conf", "etc/hostname",
                    "dev", "proc", "sys")
OVERLAY_XATTRS = ("trusted.overlay.", "user.overlay.")
ALLOWED_XATTRS = ("user.", "security.", "trusted.", "system.posix_acl_access",
                  "system.posix_acl_default")
PAX_XATTR = "SCHILY.xattr."
MAX_DELETIONS_BYTES = 64 * 1024 * 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class CaptureStats:
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0  # regular files with more than one link, each stored as a plain file
    whiteouts: int = 0
    opaque: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)


@dataclass
class ApplyStats:
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    deleted: int = 0
    opaque: int = 0
    bytes: int = 0


# --- capture -----------------------------------------------------------------------------------

def capture(upperdir: str, out_tar: str, deletions_json: str,
            exclude: Iterable[str] = DEFAULT_EXCLUDES) -> CaptureStats:
    """Archive ``upperdir`` into ``out_tar`` and its deletions into ``deletions_json``."""
    excluded = {_normalise_exclude(p) for p in exclude}
    stats, deletions = CaptureStats(), []
    tmp = out_tar + ".tmp"
    try:
        root = os.open(upperdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise OverlayError(f"capture {upperdir}: {exc}") from exc
    try:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            _capture_dir(root, "", tar, excluded, stats, deletions)
        deletions.sort(key=lambda d: (d["path"], d["type"]))
        with open(deletions_json + ".tmp", "wb") as f:
            f.write(json.dumps(deletions, sort_keys=True, separators=(",", ":")).encode())
        os.replace(deletions_json + ".tmp", deletions_json)
        os.replace(tmp, out_tar)
    except (OSError, RecursionError) as exc:
        raise OverlayError(f"capture {upperdir}: {exc}") from exc
    finally:
        os.close(root)
        for leftover in (tmp, deletions_json + ".tmp"):
            if os.path.lexists(leftover):
                os.unlink(leftover)
    log.info("captured %s: %d files, %d dirs, %d symlinks, %d whiteouts, %d opaque, %d bytes, "
             "%d skipped", upperdir, stats.files, stats.dirs, stats.symlinks, stats.whiteouts,
             stats.opaque, stats.bytes, len(stats.skipped))
    return stats


def _normalise_exclude(path: str) -> str:
    norm = posixpath.normpath("/" + path).lstrip("/")
    if not norm:
        raise OverlayError(f"exclude {path!r} would exclude the whole rootfs")
    return norm


def _is_excluded(rel: str, excluded: set[str]) -> bool:
    return any(rel == e or rel.startswith(e + "/") for e in excluded)


def _read_xattrs(target: int | str) -> dict[str, bytes]:
    try:
        follow = isinstance(target, int)  # an fd is never a symlink; a path must not be followed
        names = os.listxattr(target, follow_symlinks=follow)
        return {n: os.getxattr(target, n, follow_symlinks=follow) for n in names}
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EPERM):
            return {}
        raise


def _has(xattrs: dict[str, bytes], suffix: str, value: bytes | None = None) -> bool:
    return any(p + suffix in xattrs and (value is None or xattrs[p + suffix] == value)
               for p in OVERLAY_XATTRS)


def _tarinfo(rel: str, kind: bytes, st: os.stat_result, xattrs: dict[str, bytes]) -> tarfile.TarInfo:
    info = tarfile.TarInfo(rel)
    info.type = kind
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid, info.gid = st.st_uid, st.st_gid
    info.uname = info.gname = ""
    info.mtime = st.st_mtime_ns // 10**9
    info.pax_headers = {PAX_XATTR + k: v.decode("utf-8", "surrogateescape")
                        for k, v in xattrs.items() if not k.startswith(OVERLAY_XATTRS)}
    if st.st_mtime_ns >= 0:  # exact nanoseconds; tarfile itself would go through a float
        info.pax_headers["mtime"] = f"{info.mtime}.{st.st_mtime_ns % 10**9:09d}"
    return info


def _mtime_ns(member: tarfile.TarInfo) -> int:
    try:
        value = decimal.Decimal(member.pax_headers["mtime"]) * 10**9
        if value.is_finite():
            return int(value)
    except KeyError:
        pass
    return round(member.mtime * 10**9)


def _capture_dir(dfd: int, prefix: str, tar: tarfile.TarFile, excluded: set[str],
                 stats: CaptureStats, deletions: list[dict[str, str]]) -> None:
    with os.scandir(dfd) as it:
        names = sorted(e.name for e in it)
    for name in names:
        rel = prefix + name
        if _is_excluded(rel, excluded):
            log.debug("capture: %s excluded", rel)
            continue
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            deletions.append({"path": rel, "type": "whiteout"})
            stats.whiteouts += 1
        elif stat.S_ISDIR(st.st_mode):
            fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                xattrs = _read_xattrs(fd)
                if _has(xattrs, "redirect"):
                    raise OverlayError(f"capture: {rel} is a renamed directory (overlay "
                                       "redirect_dir); its content lives in a lower layer")
                if _has(xattrs, "opaque", b"y"):
                    deletions.append({"path": rel, "type": "opaque"})
                    stats.opaque += 1
                tar.addfile(_tarinfo(rel, tarfile.DIRTYPE, os.fstat(fd), xattrs))
                stats.dirs += 1
                _capture_dir(fd, rel + "/", tar, excluded, stats, deletions)
            finally:
                os.close(fd)
        elif stat.S_ISREG(st.st_mode):
            _capture_file(dfd, name, rel, tar, stats, deletions)
        elif stat.S_ISLNK(st.st_mode):
            info = _tarinfo(rel, tarfile.SYMTYPE, st, _read_xattrs(f"/proc/self/fd/{dfd}/{name}"))
            info.linkname = os.readlink(name, dir_fd=dfd)
            tar.addfile(info)
            stats.symlinks += 1
        else:
            kind = ("device node" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "socket" if stat.S_ISSOCK(st.st_mode) else "fifo")
            log.info("capture: skipping %s (%s)", rel, kind)
            stats.skipped.append(f"{rel} ({kind})")


def _capture_file(dfd: int, name: str, rel: str, tar: tarfile.TarFile, stats: CaptureStats,
                  deletions: list[dict[str, str]]) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OverlayError(f"capture: {rel} changed type while being read")
        xattrs = _read_xattrs(fd)
        if _has(xattrs, "whiteout"):
            deletions.append({"path": rel, "type": "whiteout"})
            stats.whiteouts += 1
            return
        if _has(xattrs, "metacopy"):
            raise OverlayError(f"capture: {rel} is a metadata-only copy-up (overlay metacopy); "
                               "its data lives in a lower layer")
        info = _tarinfo(rel, tarfile.REGTYPE, st, xattrs)
        info.size = st.st_size
        with os.fdopen(os.dup(fd), "rb") as f:
            tar.addfile(info, f)
        stats.files += 1
        stats.bytes += st.st_size
        stats.hardlinks += st.st_nlink > 1
    finally:
        os.close(fd)


# --- apply -------------------------------------------------------------------------------------

def apply(rootfs: str, tar_path: str, deletions_json: str) -> ApplyStats:
    """Apply a captured layer to ``rootfs`` (the target container's merged overlay mount)."""
    stats = ApplyStats()
    deletions = _load_deletions(deletions_json)
    try:
        root = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise OverlayError(f"apply to {rootfs}: {exc}") from exc
    try:
        with tarfile.open(tar_path, "r:") as tar:
            members = tar.getmembers()
            _check_members(members)
            for parts, kind in deletions:
                _delete(root, parts, kind, stats)
            dir_times: list[tuple[list[str], int]] = []
            for member in members:
                _extract(root, tar, member, stats, dir_times)
            for parts, mtime in reversed(dir_times):
                parent = _open_parent(root, parts[:-1], "/".join(parts))
                try:
                    os.utime(parts[-1], ns=(mtime, mtime), dir_fd=parent, follow_symlinks=False)
                finally:
                    os.close(parent)
    except tarfile.TarError as exc:
        raise OverlayError(f"apply {tar_path}: not a valid archive: {exc}") from exc
    except (ArithmeticError, ValueError) as exc:  # absurd numbers in headers
        raise OverlayError(f"apply {tar_path}: bad value in archive: {exc}") from exc
    except (OSError, RecursionError) as exc:
        raise OverlayError(f"apply {tar_path} to {rootfs}: {exc}") from exc
    finally:
        os.close(root)
    log.info("applied %s to %s: %d files, %d dirs, %d symlinks, %d deleted, %d opaque, %d bytes",
             tar_path, rootfs, stats.files, stats.dirs, stats.symlinks, stats.deleted,
             stats.opaque, stats.bytes)
    return stats


def _parts(name: str, what: str) -> list[str]:
    parts = name.split("/")
    if not name or "\0" in name or name.startswith("/") or any(
            p in ("", ".", "..") for p in parts):
        raise OverlayError(f"{what} {name!r}: not a normalised relative path inside the rootfs")
    return parts


def _load_deletions(path: str) -> list[tuple[list[str], str]]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_DELETIONS_BYTES + 1)
        if len(data) > MAX_DELETIONS_BYTES:
            raise OverlayError(f"deletions {path}: larger than {MAX_DELETIONS_BYTES} bytes")
        obj = json.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise OverlayError(f"deletions {path}: {exc}") from exc
    if not isinstance(obj, list):
        raise OverlayError(f"deletions {path}: not a JSON list")
    out: list[tuple[list[str], str]] = []
    for entry in obj:
        if (not isinstance(entry, dict) or set(entry) != {"path", "type"}
                or not isinstance(entry["path"], str)
                or entry["type"] not in ("whiteout", "opaque")):
            raise OverlayError(f"deletions {path}: bad entry {entry!r}")
        out.append((_parts(entry["path"], "deletion"), entry["type"]))
    return out


def _check_members(members: list[tarfile.TarInfo]) -> None:
    """Refuse the whole archive before writing anything when one member is unsafe."""
    symlinks: set[str] = set()
    for m in members:
        parts = _parts(m.name, "entry")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in symlinks:
                raise OverlayError(f"entry {m.name!r}: parent {'/'.join(parts[:i])!r} is a "
                                   "symlink earlier in the archive")
        if m.islnk():
            if not m.linkname or "\0" in m.linkname or m.linkname.startswith("/") or any(
                    p in ("", ".", "..") for p in m.linkname.split("/")):
                raise OverlayError(f"entry {m.name!r}: hardlink to {m.linkname!r} points "
                                   "outside the rootfs")
        elif m.issym():
            if "\0" in m.linkname:
                raise OverlayError(f"entry {m.name!r}: symlink target contains NUL")
        elif m.ischr() or m.isblk() or m.isfifo():
            raise OverlayError(f"entry {m.name!r}: device nodes and fifos are not allowed")
        elif not (m.isreg() or m.isdir()):
            raise OverlayError(f"entry {m.name!r}: unsupported tar entry type {m.type!r}")
        (symlinks.add if m.issym() else symlinks.discard)(m.name)
        for key in m.pax_headers:
            if key.startswith(PAX_XATTR):
                name = key[len(PAX_XATTR):]
                if name.startswith(OVERLAY_XATTRS) or not name.startswith(ALLOWED_XATTRS):
                    raise OverlayError(f"entry {m.name!r}: xattr {name!r} not allowed")


def _open_parent(root: int, parts: list[str], entry: str, missing_ok: bool = False) -> int:
    """An fd of the directory ``parts`` below ``root``, never following a symlink (-1 when
    ``missing_ok`` and it does not exist)."""
    fd = os.dup(root)
    try:
        for i, part in enumerate(parts):
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                where = "/".join(parts[:i + 1])
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OverlayError(f"entry {entry!r}: parent {where!r} is a symlink or not "
                                       "a directory") from exc
                if exc.errno == errno.ENOENT and missing_ok:
                    os.close(fd)
                    return -1
                if exc.errno == errno.ENOENT:
                    raise OverlayError(f"entry {entry!r}: parent {where!r} missing") from exc
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _remove(parent: int, name: str) -> bool:
    """Remove ``name`` in ``parent`` (recursively for a dir, never following a symlink)."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent)
    else:
        os.unlink(name, dir_fd=parent)
    return True


def _delete(root: int, parts: list[str], kind: str, stats: ApplyStats) -> None:
    parent = _open_parent(root, parts[:-1], "/".join(parts), missing_ok=True)
    if parent < 0:
        return
    try:
        if kind == "whiteout":
            stats.deleted += _remove(parent, parts[-1])
            return
        try:
            fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            stats.deleted += _remove(parent, parts[-1])  # a non-dir where the opaque dir goes
            return
        try:
            for child in os.listdir(fd):
                stats.deleted += _remove(fd, child)
            stats.opaque += 1
        finally:
            os.close(fd)
    finally:
        os.close(parent)


def _xattrs(member: tarfile.TarInfo) -> dict[str, bytes]:
    return {k[len(PAX_XATTR):]: v.encode("utf-8", "surrogateescape")
            for k, v in member.pax_headers.items() if k.startswith(PAX_XATTR)}


def _set_meta(fd: int, member: tarfile.TarInfo) -> None:
    os.chown(fd, member.uid, member.gid)  # before chmod: chown clears setuid bits
    os.chmod(fd, member.mode & 0o7777)
    for name, value in _xattrs(member).items():  # after chown: it clears security.capability
        os.setxattr(fd, name, value)


def _extract(root: int, tar: tarfile.TarFile, m: tarfile.TarInfo, stats: ApplyStats,
             dir_times: list[tuple[list[str], int]]) -> None:
    parts = m.name.split("/")
    leaf = parts[-1]
    parent = _open_parent(root, parts[:-1], m.name)
    try:
        if m.isdir():
            try:
                st = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(leaf, dir_fd=parent)
                    raise FileNotFoundError
            except FileNotFoundError:
                os.mkdir(leaf, 0o700, dir_fd=parent)
            fd = os.open(leaf, _DIR_FLAGS, dir_fd=parent)
            try:
                _set_meta(fd, m)
            finally:
                os.close(fd)
            dir_times.append((parts, _mtime_ns(m)))
            stats.dirs += 1
            return
        _remove(parent, leaf)
        if m.isreg():
            fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=parent)
            try:
                src = tar.extractfile(m)
                assert src is not None
                with os.fdopen(os.dup(fd), "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                _set_meta(fd, m)
                ns = _mtime_ns(m)
                os.utime(fd, ns=(ns, ns))
            finally:
                os.close(fd)
            stats.files += 1
            stats.bytes += m.size
        elif m.issym():
            os.symlink(m.linkname, leaf, dir_fd=parent)
            os.chown(leaf, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
            for name, value in _xattrs(m).items():
                os.setxattr(f"/proc/self/fd/{parent}/{leaf}", name, value, follow_symlinks=False)
            ns = _mtime_ns(m)
            os.utime(leaf, ns=(ns, ns), dir_fd=parent, follow_symlinks=False)
            stats.symlinks += 1
        elif m.islnk():
            target = m.linkname.split("/")
            tparent = _open_parent(root, target[:-1], m.name)
            try:
                if not stat.S_ISREG(os.stat(target[-1], dir_fd=tparent,
                                            follow_symlinks=False).st_mode):
                    raise OverlayError(f"entry {m.name!r}: hardlink target {m.linkname!r} is not "
                                       "a regular file")
                os.link(target[-1], leaf, src_dir_fd=tparent, dst_dir_fd=parent,
                        follow_symlinks=False)
            finally:
                os.close(tparent)
            stats.hardlinks += 1
    finally:
        os.close(parent)

