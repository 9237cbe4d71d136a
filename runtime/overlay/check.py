"""Checks of an untrusted layer (archive members and deletions) before anything is written.

:class:`MemberCheck` sees the archive one member at a time and keeps only what its rules need:
the names that are symlinks so far, and the hardlink targets (collected in a first pass, checked
in a second). Each refusal is an :class:`OverlayError` naming the member. A member must have:

- a relative, normalised name without NUL, no parent that an earlier member made a symlink;
- a type among directory, regular file, symlink, hardlink and fifo (device nodes are refused);
- for a hardlink, a target that is a normalised relative name, not below an earlier symlink, and
  a regular file written earlier in the same archive (so a link never reaches a file of the
  image, and a streaming writer has always written the target already);
- only allowed xattr names (never overlayfs' own);
- an owner, group and mtime that the kernel accepts;
- stored data inside the archive and below the ``max_bytes`` cap (the offset where its data
  ends is the bound: it bounds each member and the sum of all); for a sparse member, a map of
  sorted, non-overlapping extents inside its declared real size whose data fits its stored bytes.

:func:`load_deletions` reads the deletions JSON (bounded) into checked relative paths.
"""

from __future__ import annotations

import os

from runtime import strict_json
from runtime.errors import OverlayError
from runtime.overlay.fs import ALLOWED_XATTRS, OVERLAY_XATTRS
from runtime.overlay.tar import MAX_SPARSE_EXTENTS, Member

MAX_DELETIONS_BYTES = 64 * 1024 * 1024
_MAX_ID = 2**32 - 2  # (uid_t)-1 means "unchanged" to chown


def parts(name: str, what: str) -> list[str]:
    out = name.split("/")
    if not name or "\0" in name or name.startswith("/") or any(p in ("", ".", "..") for p in out):
        raise OverlayError(f"{what} {name!r}: not a normalised relative path inside the rootfs")
    return out


class MemberCheck:
    """The rules above, applied to members in archive order.

    ``link_targets`` None: collect the hardlink targets into :attr:`link_names` (their rule is
    checked by a second pass that is given them); a set: check hardlinks against it."""

    def __init__(self, *, max_bytes: int, link_targets: frozenset[str] | None = None) -> None:
        self.max_bytes = max_bytes
        self._targets = link_targets
        self.link_names: set[str] = set()
        self._symlinks: set[str] = set()
        self._regular: set[str] = set()  # link targets that are regular files so far

    def _below_symlink(self, name_parts: list[str]) -> str | None:
        for i in range(1, len(name_parts)):
            if "/".join(name_parts[:i]) in self._symlinks:
                return "/".join(name_parts[:i])
        return None

    def check(self, m: Member) -> list[str]:
        """Check ``m``; return its name's parts."""
        name_parts = parts(m.name, "entry")
        if (link := self._below_symlink(name_parts)) is not None:
            raise OverlayError(f"entry {m.name!r}: parent {link!r} is a symlink earlier in the archive")
        if m.islnk():
            self._check_hardlink(m)
        elif m.issym():
            if "\0" in m.linkname:
                raise OverlayError(f"entry {m.name!r}: symlink target contains NUL")
        elif m.isdev():
            raise OverlayError(f"entry {m.name!r}: device nodes are not allowed")
        elif not (m.isreg() or m.isdir() or m.isfifo()):
            raise OverlayError(f"entry {m.name!r}: unsupported tar entry type {m.type!r}")
        self._check_size(m)
        for xname in m.xattrs:
            if xname.startswith(OVERLAY_XATTRS) or not xname.startswith(ALLOWED_XATTRS):
                raise OverlayError(f"entry {m.name!r}: xattr {xname!r} not allowed")
        if not (0 <= m.uid <= _MAX_ID and 0 <= m.gid <= _MAX_ID):
            raise OverlayError(f"entry {m.name!r}: owner {m.uid}:{m.gid} out of range")
        (self._symlinks.add if m.issym() else self._symlinks.discard)(m.name)
        if self._targets is not None and m.name in self._targets:
            (self._regular.add if m.isreg() else self._regular.discard)(m.name)
        return name_parts

    def _check_hardlink(self, m: Member) -> None:
        try:
            target = parts(m.linkname, "hardlink target")
        except OverlayError:
            raise OverlayError(f"entry {m.name!r}: hardlink to {m.linkname!r} points outside "
                               "the rootfs") from None
        if (link := self._below_symlink(target)) is not None:
            raise OverlayError(f"entry {m.name!r}: hardlink target {m.linkname!r} is below "
                               f"symlink {link!r}")
        if self._targets is None:
            self.link_names.add(m.linkname)
        elif m.linkname not in self._regular:
            raise OverlayError(f"entry {m.name!r}: hardlink target {m.linkname!r} is not a "
                               "regular file earlier in the archive")

    def _check_size(self, m: Member) -> None:
        if m.end > self.max_bytes:
            raise OverlayError(f"entry {m.name!r}: the archive exceeds the writable-layer cap of "
                               f"{self.max_bytes} bytes")
        if m.sparse is None:
            data = m.size if m.isreg() else 0
        else:
            if len(m.sparse) > MAX_SPARSE_EXTENTS:
                raise OverlayError(f"entry {m.name!r}: sparse map longer than {MAX_SPARSE_EXTENTS}")
            data = pos = 0
            for offset, length in m.sparse:
                if offset < pos or length < 0 or offset + length > m.size:
                    raise OverlayError(f"entry {m.name!r}: sparse map outside its declared size "
                                       f"of {m.size} bytes or out of order")
                pos, data = offset + length, data + length
        if data < 0 or data > m.end - m.offset_data:
            raise OverlayError(f"entry {m.name!r}: declares more data than the archive stores")


def load_deletions(path: str) -> list[tuple[list[str], str]]:
    """The deletions JSON at ``path``: ``[(path parts, "whiteout" | "opaque")]``.

    Parsed strictly (``runtime.strict_json``: size, nesting of 2, no duplicate keys, no lone
    surrogate but the stand-ins for a file name's bytes that are not UTF-8, which capture writes
    as such); plain json.loads recursed on deep nesting (RecursionError, not an OverlayError)."""
    try:
        with open(path, "rb") as f:  # read no more than the file holds: read(n) allocates n
            data = f.read(min(os.fstat(f.fileno()).st_size, MAX_DELETIONS_BYTES) + 1)
        obj = strict_json.loads(data, max_bytes=MAX_DELETIONS_BYTES, max_depth=2, escaped_bytes=True)
    except (OSError, ValueError) as exc:
        raise OverlayError(f"deletions {path}: {exc}") from exc
    if not isinstance(obj, list):
        raise OverlayError(f"deletions {path}: not a JSON list")
    out: list[tuple[list[str], str]] = []
    for entry in obj:
        if (not isinstance(entry, dict) or set(entry) != {"path", "type"}
                or not isinstance(entry["path"], str)
                or entry["type"] not in ("whiteout", "opaque")):
            raise OverlayError(f"deletions {path}: bad entry {entry!r}")
        out.append((parts(entry["path"], "deletion"), entry["type"]))
    return out
