"""A writable-layer archive read straight from the store, each chunk verified before it is used.

A restore used to copy the archive into a private file while hashing it (stage), then copy it
again into the rootfs (apply): two reads and two writes of every byte. With the archive's chunk
digests (:func:`write_sums` at checkpoint: the BLAKE3 of each ``layout.SUM_CHUNK`` bytes, in a
file the signed manifest lists), :class:`VerifiedArchive` reads the store's file itself: every
chunk is read once into memory, hashed and compared before any byte of it is handed out, so a
store that changes the file under the reader makes the apply fail (and roll back), never writes
an unverified byte. The apply's check pass only loads the chunks holding headers; the write
pass reads each chunk once and writes its bytes out of the verified buffer.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

from runtime.digests import new_hash
from runtime.errors import OverlayError
from runtime.layout import DIGEST_BYTES, SUM_CHUNK

_AHEAD = 4  # chunks read and hashed ahead of the one in use on the sequential pass


def chunk_sums(fd: int, chunk: int = SUM_CHUNK) -> bytes:
    """The digest of each ``chunk`` bytes of ``fd``, in order (none for an empty file)."""
    size = os.fstat(fd).st_size
    out = bytearray()
    for off in range(0, size, chunk):
        data = os.pread(fd, min(chunk, size - off), off)
        if len(data) != min(chunk, size - off):
            raise OverlayError("the archive shrank while its digests were taken")
        out += new_hash(data).digest()
    return bytes(out)


def write_sums(tar_path: str, sums_path: str) -> None:
    """Write the chunk digests of the archive at ``tar_path`` to a new file ``sums_path``."""
    fd = os.open(tar_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        sums = chunk_sums(fd)
    finally:
        os.close(fd)
    out = os.open(sums_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(sums)
        while view:
            view = view[os.write(out, view):]
    finally:
        os.close(out)


class VerifiedArchive:
    """A read-only, seekable view of the first ``size`` bytes of ``fd`` (untrusted) that hands
    out only bytes of chunks whose digest matched ``sums``. Owns ``fd`` (closed by :meth:`close`).
    Past ``size`` it reads as end of file, whatever the file holds there."""

    def __init__(self, fd: int, size: int, sums: bytes, what: str = "archive",
                 chunk: int = SUM_CHUNK) -> None:
        if len(sums) != -(-size // chunk) * DIGEST_BYTES:
            os.close(fd)
            raise OverlayError(f"{what}: {len(sums)} bytes of chunk digests for {size} bytes")
        self._fd, self.size, self._sums, self._what, self._chunk = fd, size, sums, what, chunk
        self._pos = 0
        self._index, self._data = -1, b""  # the chunk in use, verified
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future[bytes]] = {}
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass

    # --- file-like, for runtime.overlay.tar.members ---

    def fileno(self) -> int:
        raise OverlayError(f"{self._what}: read only through its verified chunks")

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OverlayError(f"{self._what}: seek before its start")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.size, self._pos + n)
        parts = []
        while self._pos < end:
            data, at = self._at(self._pos)
            piece = data[at:at + end - self._pos]
            parts.append(piece)
            self._pos += len(piece)
        return b"".join(parts)

    # --- the data of a member ---

    def copy_to(self, offset: int, dst: int, dst_off: int, count: int) -> None:
        """Write ``count`` verified bytes from ``offset`` into ``dst`` at ``dst_off``."""
        if offset + count > self.size:
            raise OverlayError(f"{self._what}: data past its end")
        while count > 0:
            data, at = self._at(offset)
            view = memoryview(data)[at:at + count]
            done = len(view)
            while view:
                w = os.pwrite(dst, view, dst_off)
                view, dst_off = view[w:], dst_off + w
            offset, count = offset + done, count - done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._ahead.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> VerifiedArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- chunks ---

    def _at(self, offset: int) -> tuple[bytes, int]:
        """The verified chunk holding ``offset`` and where ``offset`` is in it."""
        index = offset // self._chunk
        if index != self._index:
            self._data = self._load(index)
            self._index = index
        return self._data, offset - index * self._chunk

    def _load(self, index: int) -> bytes:
        sequential = index == self._index + 1
        for stale in [i for i in self._ahead if i < index or i > index + _AHEAD]:
            self._ahead.pop(stale).cancel()
        future = self._ahead.pop(index, None)
        if sequential:  # the write pass: keep a few chunks read and hashed ahead, on other threads
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rekindle-layer")
            last = -(-self.size // self._chunk) - 1
            for ahead in range(index + 1, min(index + _AHEAD, last) + 1):
                if ahead not in self._ahead:
                    self._ahead[ahead] = self._pool.submit(self._read_chunk, ahead)
        return future.result() if future is not None else self._read_chunk(index)

    def _read_chunk(self, index: int) -> bytes:
        start = index * self._chunk
        length = min(self._chunk, self.size - start)
        data = b""
        while len(data) < length:
            got = os.pread(self._fd, length - len(data), start + len(data))
            if not got:
                raise OverlayError(f"{self._what}: ends early (changed or truncated in the store)")
            data += got
        if new_hash(data).digest() != self._sums[index * DIGEST_BYTES:(index + 1) * DIGEST_BYTES]:
            raise OverlayError(f"{self._what}: chunk {index} does not match its digest "
                               "(changed in the store)")
        return data
