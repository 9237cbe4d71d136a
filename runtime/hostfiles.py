"""Host files a restore reopens from bind mounts: digests recorded at checkpoint, compared before CRIU.

CRIU reopens by path every file the restored tree maps or holds open, and checks only its size
(``--file-validation filesize``, runtime/criu/command.py). Files of the rootfs are the image's (its id
is compared) or the writable layer's (in the artifact, hashed). Files under a bind mount are the
host's: driver libraries the NVIDIA toolkit binds in (``libcuda.so``), hostPath and other
volumes. A file there of the same size and other content would be mapped into the restored
process as if it were the one it had.

Contract:

- :func:`record` (checkpoint, after the dump): every regular file of CRIU's ``files.img``
  (fds, file-backed VMAs, executables; ``runtime.criu.image_files.read_reg_files``) whose path lies
  under a bind mount of the dump's mount plan, less the plugin's own mounts (control dir, init)
  and ``/dev/shm`` (captured into the artifact), hashed from the host side through that mount's
  source: ``(mount destination, path beneath it, size, digest)`` for the manifest. Raises
  :class:`HostFilesError` (the checkpoint fails, the source runs on) when a file cannot be read
  there, is not a regular file, is not the size CRIU saw, or when together they exceed
  ``max_bytes`` (:data:`MAX_BYTES`): a restore would have to hash them all before it starts.
- :func:`check` (restore, before anything is staged or restored): the same files resolved
  through the TARGET's spec (its bind source at the same destination, as ``runtime.container.mount_plan``
  hands CRIU), every reason one is missing, not regular, of another size or content. An
  artifact without records (``host_files`` None: a format 2 manifest, written before this check
  existed) is restored as before, with a warning: it is signed by a node key, so no one without
  that key can make one, and refusing would turn every artifact made before an upgrade into a
  cold start at once, for a check those artifacts never had.
- Resolution never leaves a bind source: the source path itself is the runtime's (the spec,
  opened as runc did: resolved in the root of the container's runtime, ``view_of``, through
  ``runtime.container.hostview``, so a source only the host has, such as its driver libraries, is found
  when the plugin runs in a pod of its own), everything beneath it is resolved with ``runtime.fs.openat2.open_beneath``
  (a symlink a tenant planted in a volume is followed only while it stays inside), opened
  ``O_PATH`` first and reopened for reading only when it is a regular file (no device or FIFO
  is ever opened for real).
- Files are hashed in parallel (``runtime.digests``), and each digest is kept in a
  process-wide :class:`DigestCache` keyed by (dev, ino, size, mtime_ns, ctime_ns): the restores
  of one node hash ``libcuda.so`` once, not once each, and a file written since has a new ctime.
  The plugin keeps that cache in its state dir too (:meth:`DigestCache.persist`), so that its
  first restore after a restart does not read gigabytes of libraries from a cold disk again:
  only digests of files whose ctime was at least :data:`SETTLED_NS` old when they were hashed
  are kept there (a file's ctime can be coarse; a change inside the same tick as the hash would
  otherwise go unseen), and no one but root can write the state dir.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import posixpath
import stat
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from runtime import control as control_mod
from runtime.container import hostview
from runtime.criu.image_files import read_reg_files
from runtime.digests import WORKERS, hash_fd
from runtime.errors import Reason, RekindleError
from runtime.fs.openat2 import open_beneath
from runtime.layout import MountPlanEntry
from runtime.manifest import HostFile

log = logging.getLogger(__name__)

# Every recorded byte is hashed again before a restore (once per node and file version: the
# cache). Driver libraries are a few hundred MiB; weights mapped from a volume can be far more,
# and a checkpoint of those is refused rather than a restore made to wait on them.
MAX_BYTES = 8 << 30
SKIPPED = ("/dev/shm", *control_mod.CONTAINER_PATHS, control_mod.INIT_DIR_IN_CONTAINER)


class HostFilesError(RekindleError):
    """The files a checkpoint's tree uses from bind mounts could not be recorded."""

    reason_class = Reason.INCOMPATIBLE


@dataclass(frozen=True)
class _Bind:
    destination: str  # in the spec (the key of a restore's lookup)
    point: str        # where the tree sees it (the destination, after symlinks in the rootfs)
    source: str       # host path (the spec's)


StatKey = tuple[int, int, int, int, int]


def stat_key(st: os.stat_result) -> StatKey:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


SETTLED_NS = 2_000_000_000  # a file's ctime this much before its hash began: the digest may be kept on disk
_PERSIST_VERSION = 1
_MAX_PERSISTED_BYTES = 4 << 20


class DigestCache:
    """Digests by :func:`stat_key`, for this process's life (LRU, ``max_entries``). A file
    whose stat changed while it was hashed is not kept. Callers asking for a file another thread
    is hashing wait for that hash instead of reading the file again. With :meth:`persist`, the
    settled digests are also kept in a file (loaded at once, written by :meth:`save`)."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._max = max_entries
        self._lock = threading.Lock()
        self._done: collections.OrderedDict[StatKey, str] = collections.OrderedDict()
        self._running: dict[StatKey, Future[str]] = {}
        self._settled: set[StatKey] = set()  # of _done: old enough to be kept on disk
        self._path: str | None = None
        self._dirty = False
        self.hashed = 0  # files read and hashed (not served from the cache)

    def persist(self, path: str) -> int:
        """Keep the settled digests in ``path`` (a root-only state dir) from now on; those it
        holds already are loaded. Returns how many were loaded (a file that is not what this
        writes is ignored, and replaced by the next save)."""
        loaded = 0
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                raw = os.read(fd, _MAX_PERSISTED_BYTES + 1) if stat.S_ISREG(st.st_mode) and st.st_uid == 0 else b""
            finally:
                os.close(fd)
            doc = json.loads(raw) if raw and len(raw) <= _MAX_PERSISTED_BYTES else {}
            if isinstance(doc, dict) and doc.get("version") == _PERSIST_VERSION:
                with self._lock:
                    for e in doc.get("digests", [])[:self._max]:
                        if (isinstance(e, list) and len(e) == 6 and all(type(x) is int and x >= 0 for x in e[:5])
                                and isinstance(e[5], str) and len(e[5]) == 64):
                            key: StatKey = (e[0], e[1], e[2], e[3], e[4])
                            self._done[key] = e[5]
                            self._settled.add(key)
                            loaded += 1
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("host file digests at %s not loaded: %s", path, exc)
        self._path = path
        return loaded

    def save(self) -> None:
        """Write the settled digests (when any changed) to the :meth:`persist` file, atomically."""
        with self._lock:
            if self._path is None or not self._dirty:
                return
            rows = [[*k, d] for k, d in self._done.items() if k in self._settled]
            self._dirty = False
            path = self._path
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, json.dumps({"version": _PERSIST_VERSION, "digests": rows}).encode())
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("host file digests not saved to %s: %s", path, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def digest(self, fd: int) -> tuple[int, str]:
        """(size, digest) of the open regular file ``fd``."""
        st = os.fstat(fd)
        key = stat_key(st)
        with self._lock:
            hit = self._done.get(key)
            if hit is not None:
                self._done.move_to_end(key)
                return st.st_size, hit
            running = self._running.get(key)
            if running is None:
                mine: Future[str] = Future()
                self._running[key] = mine
        if running is not None:
            return st.st_size, running.result()
        began = time.time_ns()
        try:
            size, digest = hash_fd(fd)
            stable = stat_key(os.fstat(fd)) == key and size == st.st_size
        except BaseException as exc:
            with self._lock:
                del self._running[key]
            mine.set_exception(exc)
            raise
        with self._lock:
            del self._running[key]
            self.hashed += 1
            if stable:
                self._done[key] = digest
                if st.st_ctime_ns <= began - SETTLED_NS:
                    self._settled.add(key)
                    self._dirty = True
                while len(self._done) > self._max:
                    gone, _ = self._done.popitem(last=False)
                    self._settled.discard(gone)
        mine.set_result(digest)
        return size, digest


CACHE = DigestCache()


def _is_bind(m: Mapping[str, Any]) -> bool:
    return m.get("type") == "bind" or any(o in ("bind", "rbind") for o in m.get("options") or [])


def _spec_binds(spec_mounts: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """destination -> host source of every bind mount of a spec (the last one wins, as mounted)."""
    return {posixpath.normpath(m["destination"]): str(m["source"])
            for m in spec_mounts if _is_bind(m) and m.get("destination") and m.get("source")}


def _under(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


def _binds(plan: Sequence[MountPlanEntry], spec_mounts: Iterable[Mapping[str, Any]]) -> list[_Bind]:
    sources = _spec_binds(spec_mounts)
    out = []
    for e in plan:
        if e.type != "bind" or e.destination not in sources:
            continue
        if any(_under(e.destination, s) for s in SKIPPED):
            continue
        out.append(_Bind(e.destination, e.mount_point or e.destination, sources[e.destination]))
    return sorted(out, key=lambda b: len(b.point), reverse=True)  # the innermost mount first


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symlink", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}


def _open_regular(root: int, source: str, path: str) -> int:
    """A read fd of ``path`` beneath the bind source ``source`` ("" = the source itself),
    the source resolved in ``root`` (the runtime's), the path never outside the source;
    OSError, or ValueError when it is not a regular file."""
    top = hostview.open_in_root(root, source, os.O_PATH)
    try:
        fd = open_beneath(top, path, os.O_PATH) if path else os.dup(top)
    finally:
        os.close(top)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"not a regular file but {_KINDS.get(stat.S_IFMT(mode), 'something else')}")
        # Reopened through our own fd: the very inode checked, now for reading.
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)


def _hash_all(jobs: Sequence[tuple[str, str]], cache: DigestCache,
              view_of: int | None = None) -> list[tuple[int, str] | str]:
    """(size, digest), or the reason it could not be read, of each (source, path), in parallel,
    sources resolved in the root of the runtime of the container whose init is ``view_of``."""
    def one(job: tuple[str, str]) -> tuple[int, str] | str:
        try:
            fd = _open_regular(root, *job)
        except (OSError, ValueError) as exc:
            return str(exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
        try:
            return cache.digest(fd)
        except OSError as exc:
            return exc.strerror or str(exc)
        finally:
            os.close(fd)
    if not jobs:
        return []
    root = hostview.host_root(view_of)
    try:
        with ThreadPoolExecutor(max_workers=min(WORKERS, len(jobs)), thread_name_prefix="rekindle-hostfile") as pool:
            return list(pool.map(one, jobs))
    finally:
        os.close(root)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def record(images_dir: str, plan: Sequence[MountPlanEntry], spec_mounts: Iterable[Mapping[str, Any]], *,
           max_bytes: int = MAX_BYTES, cache: DigestCache = CACHE, view_of: int | None = None) -> tuple[HostFile, ...]:
    """The bind-mounted files the dumped tree uses, hashed from the host (see the module doc);
    ``view_of``: the source container's init pid (its runtime resolved the spec's sources)."""
    started = time.monotonic()
    binds = _binds(plan, spec_mounts)
    wanted: dict[tuple[str, str], tuple[_Bind, int]] = {}  # (mount, path) -> (bind, size CRIU saw)
    for f in read_reg_files(images_dir):
        path = posixpath.normpath(f.path)
        bind = next((b for b in binds if _under(path, b.point)), None)
        if bind is not None:
            rel = posixpath.relpath(path, bind.point) if path != bind.point else ""
            wanted[(bind.destination, rel)] = (bind, f.size)
    total = sum(size for _, size in wanted.values())
    if total > max_bytes:
        biggest = sorted(wanted.items(), key=lambda kv: -kv[1][1])[:3]
        raise HostFilesError(
            f"the tree maps or holds open {len(wanted)} files from bind mounts, {_mib(total)} together, "
            f"more than the {_mib(max_bytes)} a restore would hash before it starts (largest: "
            + ", ".join(f"{posixpath.join(m, p)} {_mib(s)}" for (m, p), (_, s) in biggest) + ")")
    keys = sorted(wanted)
    results = _hash_all([(wanted[k][0].source, k[1]) for k in keys], cache, view_of)
    out, problems = [], []
    for (mount, path), result in zip(keys, results):
        where = posixpath.join(mount, path) if path else mount
        if isinstance(result, str):
            problems.append(f"{where} ({wanted[(mount, path)][0].source}): {result}")
        elif result[0] != wanted[(mount, path)][1]:
            problems.append(f"{where}: {result[0]} bytes on the host, {wanted[(mount, path)][1]} when dumped")
        else:
            try:
                out.append(HostFile(mount=mount, path=path, size=result[0], digest=result[1]))
            except ValueError as exc:  # a path the manifest cannot carry
                problems.append(f"{where}: {exc}")
    if problems:
        raise HostFilesError("files the tree uses from bind mounts cannot be recorded: " + "; ".join(problems))
    log.info("host files: %d from bind mounts, %s, hashed in %.3fs",
             len(out), _mib(sum(h.size for h in out)), time.monotonic() - started)
    cache.save()
    return tuple(out)


def check(records: Sequence[HostFile] | None, spec_mounts: Iterable[Mapping[str, Any]], *, label: str = "",
          max_bytes: int = MAX_BYTES, cache: DigestCache = CACHE, view_of: int | None = None) -> list[str]:
    """Every reason the target's files (through its own bind mounts) differ from ``records``;
    ``view_of``: the target's init pid (its runtime resolved the spec's sources)."""
    if records is None:
        log.warning("%s: made before host files were recorded; files from bind mounts are checked by "
                    "size only (by CRIU)", label or "artifact")
        return []
    total = sum(r.size for r in records)
    if total > max_bytes:
        return [f"host files of {_mib(total)} are more than the {_mib(max_bytes)} this node hashes"]
    started = time.monotonic()
    sources = _spec_binds(spec_mounts)
    reasons: list[str] = []
    jobs, checked = [], []
    for r in records:
        source = sources.get(r.mount)
        if source is None:
            reasons.append(f"host file {r.in_container}: the target has no bind mount at {r.mount}")
            continue
        jobs.append((source, r.path))
        checked.append(r)
    for r, (source, _), result in zip(checked, jobs, _hash_all(jobs, cache, view_of)):
        if isinstance(result, str):
            reasons.append(f"host file {r.in_container} ({source}): {result}")
        elif result[0] != r.size:
            reasons.append(f"host file {r.in_container} ({source}) is {result[0]} bytes, "
                           f"the checkpoint's was {r.size}")
        elif result[1] != r.digest:
            reasons.append(f"host file {r.in_container} ({source}) differs from the checkpoint's "
                           f"(same size, digest {result[1][:16]}, want {r.digest[:16]})")
    log.info("%s: %d host files checked in %.3fs, %d differ", label or "artifact", len(records),
             time.monotonic() - started, len(reasons))
    cache.save()
    return reasons
