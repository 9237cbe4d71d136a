"""PAX tar archives written and read at bounded cost, sparse files kept sparse.

Writing (:class:`TarWriter`): each member goes straight to the file descriptor (``tarfile``'s
writer keeps every member it wrote in memory). A regular file whose data has holes, found with
``SEEK_DATA``/``SEEK_HOLE``, is written as a GNU sparse member in PAX format 1.0, as GNU tar
writes it: the extended header carries ``GNU.sparse.major=1``, ``GNU.sparse.minor=0``,
``GNU.sparse.name`` (the real name) and ``GNU.sparse.realsize``; the ustar name is a placeholder
(``GNUSparseFile.0/<base name>``) and the ustar size counts the stored bytes: the map (the number
of extents, then offset and length of each, decimal, one per line, NUL-padded to a block) and
then the data of each extent. GNU tar (``tar -xS``) and ``tarfile`` read it back with the same
bytes and holes. A map has at most :data:`MAX_SPARSE_EXTENTS` extents (the ones closest together
are merged, storing the zeros between them). The writer refuses, before writing it, a member that
would take the archive (headers, data and the two end-of-archive blocks) past ``max_bytes``, and
stops at a ``time.monotonic()`` deadline.

Reading (:func:`members`): a parser of exactly what the writer produces (ustar headers, each
optionally preceded by one PAX extended header; 1.0 sparse members), which yields one
:class:`Member` at a time and keeps none (``tarfile``'s reader keeps every member it read, and
its parsing dominates the cost of a streaming pass). Every allocation is bounded: an extended
header by :data:`MAX_HEADER_BYTES`, a sparse map by :data:`MAX_SPARSE_EXTENTS` and by the
member's stored bytes. A bad checksum, a truncated archive, and header kinds the writer never
produces (global headers, GNU long names, old or 0.x GNU sparse formats) are refused. Everything
read is still untrusted: :mod:`runtime.overlay.check` checks names, types and sizes.
"""

from __future__ import annotations

import errno
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from runtime.errors import OverlayError
from runtime.overlay.fs import check_deadline, copy_range, write_all

BLOCK = tarfile.BLOCKSIZE
END_OF_ARCHIVE = 2 * BLOCK
MAX_HEADER_BYTES = 1 << 20
MAX_SPARSE_EXTENTS = 1 << 16
PAX_XATTR = "SCHILY.xattr."


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _header(info: tarfile.TarInfo) -> bytes:
    return info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")


def data_extents(fd: int, size: int, budget: int) -> list[tuple[int, int]] | None:
    """``(offset, length)`` of the data in the first ``size`` bytes of ``fd``, holes left out,
    fewer than MAX_SPARSE_EXTENTS of them; None as soon as the data exceeds ``budget``."""
    extents: list[list[int]] = []  # [start, end)
    data = pos = gap = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after pos
                break
            raise
        if start >= size:
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if extents and start - extents[-1][1] <= gap:
            data += end - extents[-1][1]
            extents[-1][1] = end
        else:
            extents.append([start, end])
            data += end - start
        while len(extents) >= MAX_SPARSE_EXTENTS:  # room left for the end marker
            gap = max(2 * gap, 64 << 10)
            merged = [extents[0]]
            for s, e in extents[1:]:
                if s - merged[-1][1] <= gap:
                    merged[-1][1] = e
                else:
                    merged.append([s, e])
            extents = merged
            data = sum(e - s for s, e in extents)
        if data > budget:
            return None
        pos = end
    return [(s, e - s) for s, e in extents]


class Source(Protocol):
    """What the reader needs of an archive: an open file, or a verified view of one."""

    def read(self, n: int = -1, /) -> bytes: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...


class TarWriter:
    """Write a PAX archive to ``fd`` (at its position 0) of at most ``max_bytes`` bytes."""

    def __init__(self, fd: int, max_bytes: int, deadline: float | None = None) -> None:
        self._fd, self.max_bytes, self.deadline = fd, max_bytes, deadline
        self.offset = 0
        self._buf = bytearray()  # headers gathered into fewer writes (a million files: a million headers)

    def _over(self, name: str) -> OverlayError:
        return OverlayError(f"{name}: the archive exceeds the writable-layer cap of "
                            f"{self.max_bytes} bytes")

    def _reserve(self, name: str, size: int) -> None:
        if self.offset + size + END_OF_ARCHIVE > self.max_bytes:
            raise self._over(name)

    def _write(self, data: bytes) -> None:
        self._buf += data
        self.offset += len(data)
        if len(self._buf) >= 256 << 10:
            self._flush()

    def _flush(self) -> None:
        write_all(self._fd, self._buf)
        self._buf.clear()

    def _pad(self) -> None:
        if self.offset % BLOCK:
            self._write(bytes(BLOCK - self.offset % BLOCK))

    def add(self, info: tarfile.TarInfo) -> None:
        """A member without data: directory, symlink, hardlink."""
        check_deadline(self.deadline, info.name)
        buf = _header(info)
        self._reserve(info.name, len(buf))
        self._write(buf)

    def add_file(self, info: tarfile.TarInfo, fd: int, size: int) -> int:
        """The regular file open as ``fd``, ``size`` bytes long; returns the data bytes stored."""
        name = info.name
        check_deadline(self.deadline, name)
        budget = self.max_bytes - self.offset - END_OF_ARCHIVE
        extents = data_extents(fd, size, budget)
        if extents is None:
            raise self._over(name)
        data = sum(n for _, n in extents)
        smap = b""
        if data == size:
            extents = [(0, size)] if size else []
            info.size = size
        else:
            if not extents or sum(extents[-1]) < size:
                extents.append((size, 0))  # as GNU tar does: the map reaches the real size
            smap = f"{len(extents)}\n".encode() + b"".join(f"{o}\n{n}\n".encode() for o, n in extents)
            smap += bytes(_padded(len(smap)) - len(smap))
            info.pax_headers = {**info.pax_headers, "GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                                "GNU.sparse.name": name, "GNU.sparse.realsize": str(size)}
            base = name.rsplit("/", 1)[-1]
            ok = base.isascii() and base.isprintable() and len(base) <= 80
            info.name = "GNUSparseFile.0/" + (base if ok else "sparse")
            info.size = len(smap) + data
        head = _header(info)
        self._reserve(name, len(head) + _padded(info.size))
        self._write(head + smap)
        if extents:
            self._flush()  # the data goes straight to the fd, after what is buffered
        for offset, length in extents:
            copy_range(fd, offset, self._fd, None, length, name, self.deadline)
            self.offset += length
        self._pad()
        return data

    def close(self) -> None:
        self._write(bytes(END_OF_ARCHIVE))
        self._flush()


@dataclass(frozen=True, slots=True)
class Member:
    """One archive member as read: every field still untrusted."""

    name: str
    type: bytes  # the tar type flag
    linkname: str
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int  # the file's size (for a sparse member, its real size)
    offset_data: int  # where its stored data starts in the archive (after a sparse map)
    end: int  # where its stored data ends (block-padded): the next header
    sparse: tuple[tuple[int, int], ...] | None  # (offset, length) of each extent
    xattrs: dict[str, bytes]

    def isreg(self) -> bool:
        return self.type in (tarfile.REGTYPE, tarfile.AREGTYPE)

    def isdir(self) -> bool:
        return self.type == tarfile.DIRTYPE

    def issym(self) -> bool:
        return self.type == tarfile.SYMTYPE

    def islnk(self) -> bool:
        return self.type == tarfile.LNKTYPE

    def isdev(self) -> bool:
        return self.type in (tarfile.CHRTYPE, tarfile.BLKTYPE)

    def isfifo(self) -> bool:
        return self.type == tarfile.FIFOTYPE


_NO_DATA = (tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.DIRTYPE,
            tarfile.FIFOTYPE)
_REFUSED = {tarfile.XGLTYPE: "global extended header", tarfile.GNUTYPE_LONGNAME: "GNU long name",
            tarfile.GNUTYPE_LONGLINK: "GNU long link", tarfile.GNUTYPE_SPARSE: "old GNU sparse member",
            tarfile.SOLARIS_XHDTYPE: "Solaris extended header", b"V": "volume header",
            b"M": "multi-volume continuation", b"N": "old GNU long name"}
_OTHER_SPARSE = ("GNU.sparse.map", "GNU.sparse.size", "GNU.sparse.offset", "GNU.sparse.numbytes")
_ZERO_BLOCK = bytes(BLOCK)
_MAX_NS = 2**63 - 1


class _Invalid(OverlayError):
    def __init__(self, offset: int, what: str) -> None:
        super().__init__(f"not a valid archive: {what} (header at offset {offset})")


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _number(field: bytes, at: int) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # base-256, as tarfile and GNU tar write large values
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0xFF else n
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if digits.translate(None, b"01234567"):  # int() would also take "+", "_" and spaces
        raise _Invalid(at, f"bad number {field!r}")
    return int(digits or b"0", 8)


def _decimal(value: str, what: str, at: int) -> int:
    if not value.isascii() or not value.isdigit():
        raise _Invalid(at, f"bad {what} {value[:40]!r}")
    return int(value)


def _mtime_ns(value: str, at: int) -> int:
    whole, _, frac = value.partition(".")
    neg = whole.startswith("-")
    whole = whole[1:] if neg else whole
    if not (whole.isascii() and whole.isdigit() and len(whole) <= 12 and frac.isascii()
            and (frac == "" or frac.isdigit())):
        raise _Invalid(at, f"bad mtime {value[:40]!r}")
    ns = int(whole) * 10**9 + int((frac + "000000000")[:9])
    return -ns if neg else ns


def _pax_records(data: bytes, at: int) -> dict[str, bytes]:
    """``length keyword=value\\n`` records; values kept as bytes (xattr values are binary)."""
    out: dict[str, bytes] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 21)
        if space <= pos or not data[pos:space].isdigit():
            raise _Invalid(at, "malformed extended header")
        length = int(data[pos:space])
        if length <= space - pos + 2 or pos + length > len(data) or data[pos + length - 1] != 10:
            raise _Invalid(at, "malformed extended header")
        key, eq, value = data[space + 1:pos + length - 1].partition(b"=")
        if not eq:
            raise _Invalid(at, "malformed extended header")
        out[key.decode("utf-8", "surrogateescape")] = value
        pos += length
    return out


def _sparse_map(f: Source, stored: int, at: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """A 1.0 map at ``f``'s position, read only within the member's ``stored`` bytes; the map
    and the bytes it took (whole blocks)."""
    numbers: list[int] = []
    count, read, buf = -1, 0, b""
    while count < 0 or len(numbers) < 2 * count:
        while b"\n" not in buf:
            if read >= stored or len(buf) > 40:
                raise _Invalid(at, "malformed sparse map")
            chunk = f.read(BLOCK)
            if len(chunk) != BLOCK:
                raise _Invalid(at, "archive truncated in a sparse map")
            buf, read = buf + chunk, read + BLOCK
        number, _, buf = buf.partition(b"\n")
        if not number.isdigit() or len(number) > 20:
            raise _Invalid(at, "malformed sparse map")
        if count < 0:
            count = int(number)
            if count > MAX_SPARSE_EXTENTS:
                raise _Invalid(at, f"sparse map of {count} extents is longer than {MAX_SPARSE_EXTENTS}")
        else:
            numbers.append(int(number))
    return tuple(zip(numbers[::2], numbers[1::2])), read


def members(f: Source) -> Iterator[Member]:
    """Each member of the archive open as ``f`` (from its start), parsed with every allocation
    bounded: extended headers by MAX_HEADER_BYTES, sparse maps by MAX_SPARSE_EXTENTS and the
    member's stored bytes. Refuses (OverlayError) a bad checksum, a truncated archive, and the
    header kinds this module never writes (global headers, GNU long names, other sparse formats)."""
    size = f.seek(0, os.SEEK_END)  # a file, or a runtime.overlay.verified.VerifiedArchive
    f.seek(0)
    offset = 0
    pax: dict[str, bytes] | None = None
    while True:
        at = offset
        block = f.read(BLOCK)
        if len(block) != BLOCK:
            raise _Invalid(at, "archive truncated" if block or at else "empty file")
        if block == _ZERO_BLOCK:
            if pax is not None:
                raise _Invalid(at, "extended header without a member")
            return
        chksum = _number(block[148:156], at)
        unsigned = sum(block) - sum(block[148:156]) + 256
        if chksum != unsigned:
            raise _Invalid(at, "bad header checksum")
        kind = block[156:157]
        stored = _number(block[124:136], at)
        offset += BLOCK
        if kind == tarfile.XHDTYPE:
            if pax is not None:
                raise _Invalid(at, "two extended headers in a row")
            if not 0 <= stored <= MAX_HEADER_BYTES:
                raise _Invalid(at, f"extended header of {stored} bytes is larger than {MAX_HEADER_BYTES}")
            data = f.read(stored)
            if len(data) != stored:
                raise _Invalid(at, "archive truncated")
            pax = _pax_records(data, at)
            offset += _padded(stored)
            f.seek(offset)
            continue
        if kind in _REFUSED:
            raise _Invalid(at, f"{_REFUSED[kind]} not supported")
        member = _member(block, kind, stored, pax or {}, offset, f, at)
        pax = None
        if member.end > size:
            raise _Invalid(at, f"archive truncated in {member.name!r}")
        offset = member.end
        f.seek(offset)
        yield member


def _member(block: bytes, kind: bytes, stored: int, pax: dict[str, bytes], offset: int,
            f: Source, at: int) -> Member:
    def text(key: str, field: bytes) -> str:
        return pax[key].decode("utf-8", "surrogateescape") if key in pax else _text(field)

    def number(key: str, field: bytes) -> int:
        return _decimal(pax[key].decode("ascii", "replace"), key, at) if key in pax else _number(field, at)

    name = text("path", block[0:100])
    if "path" not in pax and block[257:263] == b"ustar\x00" and block[345] != 0:
        name = _text(block[345:500]) + "/" + name
    if kind == tarfile.DIRTYPE:
        name = name.rstrip("/") or name
    if kind in _NO_DATA:
        stored = 0
    else:
        stored = number("size", block[124:136])
    mtime = (_mtime_ns(pax["mtime"].decode("ascii", "replace"), at) if "mtime" in pax
             else _number(block[136:148], at) * 10**9)
    if not -_MAX_NS <= mtime <= _MAX_NS:
        raise _Invalid(at, "mtime out of range")
    sparse, data_at, real = None, offset, stored
    if any(k in pax for k in _OTHER_SPARSE):
        raise _Invalid(at, "GNU sparse format 0.0/0.1 not supported")
    if "GNU.sparse.major" in pax or "GNU.sparse.minor" in pax:
        if (pax.get("GNU.sparse.major"), pax.get("GNU.sparse.minor")) != (b"1", b"0") or \
                "GNU.sparse.name" not in pax or "GNU.sparse.realsize" not in pax or \
                kind not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            raise _Invalid(at, "unsupported sparse member")
        name = pax["GNU.sparse.name"].decode("utf-8", "surrogateescape")
        real = _decimal(pax["GNU.sparse.realsize"].decode("ascii", "replace"), "real size", at)
        f.seek(offset)
        sparse, taken = _sparse_map(f, stored, at)
        data_at = offset + taken
    return Member(
        name=name, type=kind, linkname=text("linkpath", block[157:257]),
        mode=_number(block[100:108], at), uid=number("uid", block[108:116]),
        gid=number("gid", block[116:124]), mtime_ns=mtime, size=real, offset_data=data_at,
        end=offset + _padded(stored), sparse=sparse,
        xattrs={k[len(PAX_XATTR):]: v for k, v in pax.items() if k.startswith(PAX_XATTR)})
