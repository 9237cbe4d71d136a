"""Hash CRIU's page images while CRIU writes them.

``criu dump`` writes each process's ``pages-<id>.img`` front to back on one thread, for seconds
(17.6 GB took 8-14 s on the H200), while the node's other cores wait. Every 64 MiB piece of such a
file that lies below its size (CRIU only appends) is hashed at once, both ways the artifact needs
it: the digest of each SUM_CHUNK (a bulk file's ``.sums``) and the piece's digest (the file's
manifest digest, :mod:`runtime.digests`). After the dump, the split and the publish take these
instead of reading every byte twice more. Where the publish will move the files into the store
(same file system) and fsync them there, each hashed piece's write-back starts at once.

Only files in the checkpoint's private staging dir are followed: nobody but CRIU and this process
writes there. A result is used only for the very inode it was made from, at the very size and
modification time; anything else is hashed again the usual way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from runtime import libc
from runtime.digests import PIECE, Hashed, combine_pieces, new_hash, piece_ranges
from runtime.layout import DIGEST_BYTES, SUM_CHUNK

log = logging.getLogger(__name__)

PREFIX, SUFFIX = "pages-", ".img"
WORKERS = 4  # CRIU writes 1-2 GB/s; four threads hash both ways faster than that
POLL_S = 0.05


SYNC_FILE_RANGE_WRITE = 2  # start writing back the dirty pages of the range; wait for nothing


def _write_back(fd: int, offset: int, length: int) -> None:
    if libc.function("sync_file_range")(fd, offset, length, SYNC_FILE_RANGE_WRITE) != 0:
        log.debug("tail hash: sync_file_range: %s", os.strerror(libc.errno()))


def _piece(fd: int, offset: int, length: int, write_back: bool = False) -> tuple[bytes, bytes]:
    """(the piece's digest, its chunks' digests) of ``length`` bytes at ``offset``; with
    ``write_back``, the piece's write-back to disk is started once it is hashed."""
    piece, sums, done = new_hash(), [], 0
    while done < length:
        want = min(SUM_CHUNK, length - done)
        data = os.pread(fd, want, offset + done)
        if len(data) != want:
            raise OSError(f"short read at {offset + done}: the file shrank while hashed")
        sums.append(new_hash(data).digest())  # both update calls drop the GIL
        piece.update(data)
        done += want
    if write_back:
        _write_back(fd, offset, length)
    return piece.digest(), b"".join(sums)


class _Followed:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        st = os.fstat(fd)
        self.dev, self.ino = st.st_dev, st.st_ino
        self.pieces: list[Future[tuple[bytes, bytes]]] = []
        self.end = 0  # bytes scheduled so far, from the start


class TailHasher:
    """``with TailHasher(images_dir) as th: criu dump ...; hashed = th.finish()``.

    ``finish`` (after CRIU has exited) hashes what is left and returns, by path, what it hashed;
    leaving the block without it abandons the work. The files stay open until the block is left:
    keep it open until the results are used (an inode number is not reused meanwhile). Any error only costs the head start: the
    file is then missing from the result."""

    def __init__(self, images_dir: str, workers: int = WORKERS, poll_s: float = POLL_S,
                 write_back: bool = False) -> None:
        self.images_dir = images_dir
        # The files will be moved into the store and fsync'ed there: their write-back starts
        # while CRIU still writes, and the publish's fsync finds little left to write.
        self.write_back = write_back
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rekindle-tailhash")
        self._files: dict[str, _Followed] = {}
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._follow, name="rekindle-tailhash-poll", daemon=True)
        self.ahead_bytes = 0  # bytes hashed before CRIU was done (for the log)

    def __enter__(self) -> TailHasher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for f in self._files.values():
            os.close(f.fd)
        self._files.clear()

    def _follow(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self._scan(final=False)
            except OSError as exc:  # the dir went away: the checkpoint failed; nothing to do
                log.debug("tail hash: %s", exc)
                return

    def _scan(self, final: bool) -> None:
        with os.scandir(self.images_dir) as it:
            names = [e.name for e in it if e.name.startswith(PREFIX) and e.name.endswith(SUFFIX)]
        for name in names:
            f = self._files.get(name)
            if f is None:
                try:
                    fd = os.open(os.path.join(self.images_dir, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:
                    continue
                f = self._files[name] = _Followed(fd)
            size = os.fstat(f.fd).st_size
            end = size if final else size - size % PIECE  # while CRIU writes: whole pieces only
            while f.end < end:
                length = min(PIECE, end - f.end)
                f.pieces.append(self._pool.submit(_piece, f.fd, f.end, length, self.write_back))
                f.end += length
                if not final:
                    self.ahead_bytes += length

    def finish(self) -> dict[str, Hashed]:
        """Everything hashed, by path: call once CRIU has exited (its files complete)."""
        t0 = time.monotonic()
        self._stop.set()
        self._thread.join()
        out: dict[str, Hashed] = {}
        try:
            self._scan(final=True)
        except OSError as exc:
            log.warning("tail hash: cannot list %s (%s); the files are hashed after the dump", self.images_dir, exc)
            return out
        total = 0
        for name, f in self._files.items():
            try:
                results = [p.result() for p in f.pieces]
                st = os.fstat(f.fd)
            except OSError as exc:
                log.warning("tail hash: %s: %s; hashed after the dump instead", name, exc)
                continue
            if st.st_size != f.end:
                continue  # changed after the last look: not what was hashed
            out[os.path.join(self.images_dir, name)] = Hashed(
                f.dev, f.ino, st.st_size, st.st_mtime_ns, b"".join(s for _, s in results),
                combine_pieces(st.st_size, [d for d, _ in results]), tuple(d for d, _ in results))
            total += st.st_size
        log.info("tail hash: %d file(s), %.1f MiB, %.1f MiB of it while CRIU wrote; %.2fs after it",
                 len(out), total / 2**20, self.ahead_bytes / 2**20, time.monotonic() - t0)
        return out


def rehash(fd: int, before: Hashed, changed: Sequence[tuple[int, int]], workers: int = WORKERS) -> Hashed | None:
    """What ``fd`` hashes to now that the ``(offset, length)`` spans ``changed`` of it were
    rewritten (punched) since ``before`` was made of it: only the pieces that hold a changed
    byte are read again, their chunks' digests with them. None when ``before`` lacks the
    pieces' digests or is not of this file at its size (then it must be hashed whole)."""
    st = os.fstat(fd)
    ranges = piece_ranges(st.st_size)
    if (st.st_dev, st.st_ino, st.st_size) != (before.dev, before.ino, before.size) or len(before.pieces) != len(ranges):
        return None
    stale = [i for i, (off, length) in enumerate(ranges)
             if any(a < off + length and off < a + n for a, n in changed)]
    pieces, sums = list(before.pieces), bytearray(before.sums)
    per_piece = PIECE // SUM_CHUNK * DIGEST_BYTES
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rekindle-rehash") as pool:
        for i, (digest, chunk_sums) in zip(stale, pool.map(lambda i: _piece(fd, *ranges[i]), stale)):
            pieces[i] = digest
            sums[i * per_piece:i * per_piece + len(chunk_sums)] = chunk_sums
    st = os.fstat(fd)  # the mtime the change left
    return Hashed(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, bytes(sums),
                  combine_pieces(st.st_size, pieces), tuple(pieces))
