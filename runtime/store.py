"""The artifact store: versions published atomically under a name, read through one fd, verified.

The store is a shared volume: other nodes and tenants can create, replace, rename and hard-link
files in it at any moment. The layout makes a reader see exactly one version, and nothing a
reader uses is trusted before its digest matched the signed manifest.

Layout of a namespace directory ``<root>/<namespace>/``::

    <name>                          symlink -> .version-<name>-<generation>-<hex16> (the name)
    .version-<name>-<gen>-<hex16>/  one published version (layout: runtime.layout)
    .staging-<name>-<hex16>/        a publish in progress; .owner.json says who writes it
    .trash-<...>                    a version being removed
    .link-<name>-<hex16>            a pointer being switched (lives for a moment)

Contract:

- Names are validated before any path is built (namespace: DNS-1123 label; artifact: 1-63 of
  ``[a-z0-9.-]``). Entries starting with ``.`` are never artifacts.
- :meth:`Staging.publish` hashes every file, writes the manifest (with a generation that only
  grows for a name) and its HMAC, fsyncs, renames the staging dir to a fresh version dir and
  then switches the name by renaming a new symlink over it. A reader sees the old version or
  the new one, never a mix. The previous version is removed unless a reader holds it.
- :meth:`ArtifactStore.open` reads the name's symlink once, checks that it names a version of
  this name, opens that directory (never following a symlink) and keeps its fd: every later
  read goes through that fd, so renames and re-publishes after ``open`` do not change what this
  reader reads. It checks the signature before parsing and the manifest's namespace/name. It
  takes a shared OFD lock on the version's manifest for as long as the artifact is open, which
  delete, prune and sweep respect (they never remove a version a restore is reading).
- Bytes are used only as verified: :meth:`Artifact.copy_verified` copies a listed file into a
  private node-local file while hashing it and refuses a mismatch; :meth:`Artifact.open_file`
  hands out an fd for callers that hash exactly the bytes they consume (the bulk page fill).
- A file's ``digest`` is the BLAKE3 (256-bit) digest of its content up to 64 MiB; above that it
  is the BLAKE3 digest of a tag and the digests of its 64 MiB pieces, hashed in parallel (BLAKE3:
  several times sha256's speed per core, and the restore hashes every byte it uses).
- Leaks: a staging dir records its owner (node, boot id, pid, start time); :meth:`sweep` removes
  staging dirs whose owner is provably dead on this node or that are older than a bound (another
  node's), trash, leftover links, and versions no name points to that are older than a grace
  period and not locked.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import fcntl
import blake3
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

from runtime import layout, names
from runtime.errors import ArtifactNotFound, ArtifactRejected, RekindleError, StoreError
from runtime.manifest import MAX_MANIFEST_BYTES as MAX_MANIFEST
from runtime.manifest import FileEntry, Manifest, sign, verify

log = logging.getLogger(__name__)

MANIFEST = layout.MANIFEST
SIGNATURE = layout.SIGNATURE
OWNER = ".owner.json"
MAX_SIG_BYTES = 256
_CHUNK = 1 << 20
_VERSION_RE = re.compile(r"\.version-(?P<name>.+)-(?P<gen>[0-9]{1,20})-(?P<rand>[0-9a-f]{16})")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
STAGING_PREFIX, VERSION_PREFIX, TRASH_PREFIX, LINK_PREFIX = ".staging-", ".version-", ".trash-", ".link-"
STALE_AFTER = 24 * 3600.0  # another node's staging dir older than this is abandoned
GRACE = 600.0  # an unreferenced version younger than this may be about to be linked


def validate_namespace(namespace: str) -> str:
    if not names.is_dns_label(namespace):
        raise StoreError(f"invalid namespace {namespace!r}: want a DNS-1123 label")
    return namespace


def validate_name(name: str) -> str:
    if not names.is_artifact_name(name):
        raise StoreError(f"invalid artifact name {name!r}: want 1-63 of [a-z0-9.-], "
                         "starting and ending with [a-z0-9]")
    return name


def is_valid_name(name: str) -> bool:
    return names.is_artifact_name(name)


def _fsync_dir(path: str | int) -> None:
    fd = os.open(path, _DIR_FLAGS) if isinstance(path, str) else os.dup(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes, dir_fd: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


# --- digests -------------------------------------------------------------------------------------
# Files larger than one piece get a two-level digest: the BLAKE3 of the BLAKE3s of their 64 MiB
# pieces, hashed in parallel. GPU checkpoints are tens of GiB in a few files.
PIECE = 64 << 20
_PIECE_TAG = b"rekindle-pieces-v2\n"
WORKERS = min(16, os.cpu_count() or 1)


def combine_pieces(size: int, pieces: list[bytes]) -> str:
    """The file digest from its pieces' digests (in order)."""
    if size <= PIECE:
        return pieces[0].hex() if pieces else new_hash().hexdigest()
    return new_hash(_PIECE_TAG + b"".join(pieces)).hexdigest()


def new_hash(data: bytes = b"") -> blake3.blake3:
    """The content hash (BLAKE3; its update drops the GIL, so threads hash in parallel)."""
    return blake3.blake3(data)


def piece_ranges(size: int) -> list[tuple[int, int]]:
    """(offset, length) of each piece; one (empty) piece for an empty file."""
    return [(off, min(PIECE, size - off)) for off in range(0, size, PIECE)] or [(0, 0)]


def _copy_range(src: int, dst: int | None, offset: int, length: int) -> bytes:
    """Digest of ``length`` bytes at ``offset`` of ``src``, written to ``dst`` at the same offset."""
    digest, done = new_hash(), 0
    while done < length:
        data = os.pread(src, min(_CHUNK, length - done), offset + done)
        if not data:
            raise OSError(errno.EIO, "file shrank while being read")
        digest.update(data)  # releases the GIL for large buffers: threads hash in parallel
        if dst is not None:
            view = memoryview(data)
            pos = offset + done
            while view:
                n = os.pwrite(dst, view, pos)
                view, pos = view[n:], pos + n
        done += len(data)
    return digest.digest()


def hash_fd(fd: int, dst: int | None = None) -> tuple[int, str]:
    """(size, digest) of ``fd`` (copied to ``dst`` on the way when given)."""
    size = os.fstat(fd).st_size
    ranges = piece_ranges(size)
    if len(ranges) == 1:
        pieces = [_copy_range(fd, dst, *ranges[0])]
    else:
        with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rekindle-hash") as pool:
            pieces = list(pool.map(lambda r: _copy_range(fd, dst, *r), ranges))
    return size, combine_pieces(size, pieces)


# --- locks ---------------------------------------------------------------------------------------
# Open-file-description locks: per open file (not per process, so two restores in one plugin do
# not share a lock), and honoured over NFS. Readers hold F_RDLCK on a version's manifest; anything
# that removes a version must first get F_WRLCK.
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)


def _ofd_lock(fd: int, kind: int, wait: bool) -> bool:
    arg = struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 0, 0)
    try:
        fcntl.fcntl(fd, _F_OFD_SETLKW if wait else _F_OFD_SETLK, arg)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def _exclusive(dir_fd: int, wait: float = 0.0) -> int | None:
    """An fd holding the exclusive lock of the version dir ``dir_fd``, or None while a reader
    holds it. A version without a manifest (broken) is lockable trivially (-1)."""
    try:
        fd = os.open(MANIFEST, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return -1
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            return -1
        raise
    deadline = time.monotonic() + wait
    while True:
        if _ofd_lock(fd, fcntl.F_WRLCK, wait=False):
            return fd
        if time.monotonic() >= deadline:
            os.close(fd)
            return None
        time.sleep(0.1)


# --- owners of staging dirs ----------------------------------------------------------------------

def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Owner:
    """Who writes a staging dir; ``alive()`` is only ever decided for this node's owners."""

    node: str
    boot_id: str
    pid: int
    start_time: int
    created: float

    @classmethod
    def me(cls) -> Owner:
        pid = os.getpid()
        return cls(socket.gethostname(), _boot_id(), pid, _start_time(pid) or 0, time.time())

    def provably_dead(self) -> bool:
        if self.node != socket.gethostname():
            return False
        if self.boot_id != _boot_id():
            return True
        return _start_time(self.pid) != self.start_time


def _read_owner(dir_fd: int) -> Owner | None:
    try:
        fd = os.open(OWNER, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        d = json.loads(raw)
        return Owner(str(d["node"]), str(d["boot_id"]), int(d["pid"]), int(d["start_time"]),
                     float(d["created"]))
    except (ValueError, KeyError, TypeError):
        return None


# --- walking -------------------------------------------------------------------------------------

def _walk_files(dir_fd: int, prefix: str = "") -> Iterator[str]:
    """Relative paths of all non-directories below ``dir_fd``; never follows symlinks."""
    with os.scandir(dir_fd) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        rel = prefix + entry.name
        if entry.is_dir(follow_symlinks=False):
            sub = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                yield from _walk_files(sub, rel + "/")
            finally:
                os.close(sub)
        else:
            yield rel


def _tree_bytes(dir_fd: int) -> int:
    total = 0
    for rel in _walk_files(dir_fd):
        with contextlib.suppress(OSError):
            total += os.stat(rel, dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512
    return total


def _open_regular(dir_fd: int, name: str, label: str) -> int:
    """An fd of the regular file ``name`` below ``dir_fd``, no symlink followed; anything else
    (absent, a link, a fifo, a directory) is ArtifactRejected."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ArtifactRejected(label, f"incomplete: no {name}") from None
    except OSError as exc:
        raise ArtifactRejected(label, f"{name}: {_why(exc)}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArtifactRejected(label, f"{name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_capped(dir_fd: int, name: str, cap: int, label: str) -> bytes:
    fd = _open_regular(dir_fd, name, label)
    try:
        data = os.read(fd, cap + 1)
        while len(data) <= cap and (more := os.read(fd, cap + 1 - len(data))):
            data += more
    finally:
        os.close(fd)
    if len(data) > cap:
        raise ArtifactRejected(label, f"{name} larger than {cap} bytes")
    return data


def _why(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "is a symlink or not a directory"
    return exc.strerror or str(exc)


def _safe_parts(path: str) -> list[str] | None:
    parts = path.split("/")
    if (path.startswith("/") or "\0" in path or any(p in ("", ".", "..") for p in parts)
            or path in (MANIFEST, SIGNATURE)):
        return None
    return parts


# --- a published version, open -----------------------------------------------------------------

class _Vanished(Exception):
    """The version a name pointed to went away while being opened (a replace raced us)."""

    def __init__(self, cause: ArtifactRejected | None = None) -> None:
        super().__init__(str(cause or "gone"))
        self.cause = cause


class Artifact:
    """One version of an artifact, opened by ``ArtifactStore.open``: its directory fd, its
    manifest (signature and location checked) and a shared lock. Use as a context manager, or
    call :meth:`close`."""

    def __init__(self, label: str, version: str, dir_fd: int, lock_fd: int, manifest: Manifest) -> None:
        self.label = label
        self.version = version
        self.manifest = manifest
        self._dir_fd = dir_fd
        self._lock_fd = lock_fd
        self._entries = {f.path: f for f in manifest.files}

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in (self._lock_fd, self._dir_fd):
            if fd >= 0:
                os.close(fd)
        self._lock_fd = self._dir_fd = -1

    def entry(self, path: str) -> FileEntry:
        try:
            return self._entries[path]
        except KeyError:
            raise ArtifactRejected(self.label, f"file {path}: not in the manifest") from None

    def open_file(self, path: str) -> int:
        """A read-only fd of listed file ``path``, opened below the version's dir fd without
        following any symlink. The caller must verify what it reads (size and digest)."""
        self.entry(path)
        parts = _safe_parts(path)
        if parts is None:
            raise ArtifactRejected(self.label, f"file {path!r}: unsafe path in manifest")
        fds: list[int] = []
        try:
            cur = self._dir_fd
            for part in parts[:-1]:
                cur = os.open(part, _DIR_FLAGS, dir_fd=cur)
                fds.append(cur)
            fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=cur)
        except FileNotFoundError:
            raise ArtifactRejected(self.label, f"file {path}: missing") from None
        except OSError as exc:
            raise ArtifactRejected(self.label, f"file {path}: {_why(exc)}") from exc
        finally:
            for d in fds:
                os.close(d)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ArtifactRejected(self.label, f"file {path}: not a regular file")
        os.set_blocking(fd, True)
        return fd

    def check(self, path: str, size: int, digest: str) -> None:
        want = self.entry(path)
        if size != want.size or digest != want.digest:
            raise ArtifactRejected(self.label, f"file {path}: content changed (size {size}, "
                                   f"want {want.size})")

    def copy_verified(self, path: str, dest: str) -> None:
        """Copy ``path`` to the private file ``dest`` while hashing; refuse a mismatch (and
        remove ``dest``). Only ``dest`` may be used afterwards."""
        src = self.open_file(path)
        try:
            dst = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                size, digest = hash_fd(src, dst)
            finally:
                os.close(dst)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(dest)
            raise ArtifactRejected(self.label, f"file {path}: {exc}") from exc
        finally:
            os.close(src)
        try:
            self.check(path, size, digest)
        except ArtifactRejected:
            os.unlink(dest)
            raise

    def materialize(self, dest_dir: str, skip: Callable[[str], bool] = lambda _p: False) -> int:
        """Copy every listed file not ``skip``ped into ``dest_dir`` (private, created 0700),
        verifying each, several files at once; returns the bytes copied."""
        os.makedirs(dest_dir, mode=0o700, exist_ok=True)
        jobs = []
        for f in self.manifest.files:
            if skip(f.path):
                continue
            parts = _safe_parts(f.path)
            if parts is None:
                raise ArtifactRejected(self.label, f"file {f.path!r}: unsafe path in manifest")
            os.makedirs(os.path.join(dest_dir, *parts[:-1]), mode=0o700, exist_ok=True)
            jobs.append((f, os.path.join(dest_dir, *parts)))
        with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rekindle-stage") as pool:
            list(pool.map(lambda job: self.copy_verified(job[0].path, job[1]), jobs))
        return sum(f.size for f, _ in jobs)

    def verify_files(self) -> None:
        """Hash every listed file in place (``artifacts inspect --verify``: a report, not a
        licence to use the files afterwards)."""
        for f in self.manifest.files:
            fd = self.open_file(f.path)
            try:
                size, digest = hash_fd(fd)
            except OSError as exc:
                raise ArtifactRejected(self.label, f"file {f.path}: {exc}") from exc
            finally:
                os.close(fd)
            self.check(f.path, size, digest)


@dataclass(frozen=True, slots=True)
class Listing:
    """One entry of :meth:`ArtifactStore.list`: a manifest, or the reason it is bad."""

    namespace: str
    name: str
    manifest: Manifest | None
    problem: str | None
    version: str = ""


@dataclass(frozen=True, slots=True)
class Leftover:
    """A non-artifact entry of the store (``artifacts list --all``)."""

    namespace: str
    entry: str
    kind: str  # staging | trash | unreferenced-version | link
    bytes: int
    owner: Owner | None
    age: float


class Staging:
    """A staging dir; use as a context manager and call :meth:`publish` inside it."""

    def __init__(self, store: ArtifactStore, namespace: str, name: str) -> None:
        self.store = store
        self.namespace, self.name = namespace, name
        self.parent = os.path.join(store.root, namespace)
        os.makedirs(self.parent, mode=0o700, exist_ok=True)
        if os.path.islink(self.parent):
            raise StoreError(f"store namespace dir {self.parent} is a symlink")
        self.path = os.path.join(self.parent, f"{STAGING_PREFIX}{name}-{secrets.token_hex(8)}")
        os.mkdir(self.path, 0o700)
        _write_file(os.path.join(self.path, OWNER), json.dumps(dataclasses.asdict(Owner.me())).encode())
        self.published: Listing | None = None

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if os.path.lexists(self.path):
            if exc is None and self.published is None:
                log.warning("staging %s left unpublished; removing it", self.path)
            shutil.rmtree(self.path, ignore_errors=True)

    def publish(self, manifest: Manifest, key: bytes) -> Manifest:
        """Record every file in the manifest, sign it, and switch the name to this version."""
        if (manifest.namespace, manifest.name) != (self.namespace, self.name):
            raise StoreError(f"manifest names {manifest.namespace}/{manifest.name}, staging is "
                             f"for {self.namespace}/{self.name}")
        try:
            ns_fd = os.open(self.parent, _DIR_FLAGS)
        except OSError as exc:
            raise StoreError(f"publish {self.namespace}/{self.name}: {exc}") from exc
        try:
            try:
                previous = self.store.current_version(ns_fd, self.name)
            except ArtifactRejected:
                previous = None  # whatever sits at the name is moved away by _switch
            files = self._hash_and_sync()
            generation = max(time.time_ns() // 1000, _generation_of(previous) + 1)
            manifest = dataclasses.replace(manifest, files=tuple(files), generation=generation)
            data = manifest.to_json()
            _write_file(os.path.join(self.path, MANIFEST), data)
            _write_file(os.path.join(self.path, SIGNATURE), sign(data, key).encode())
            os.unlink(os.path.join(self.path, OWNER))
            _fsync_dir(self.path)
            version = f"{VERSION_PREFIX}{self.name}-{generation}-{secrets.token_hex(8)}"
            os.rename(self.path, os.path.join(self.parent, version))
            self._switch(ns_fd, version)
            os.fsync(ns_fd)
        except OSError as exc:
            raise StoreError(f"publish {self.namespace}/{self.name}: {exc}") from exc
        try:
            if previous and previous != version:
                self.store.remove_version(ns_fd, previous)
        finally:
            os.close(ns_fd)
        log.info("published artifact %s/%s generation %d (%d files)", self.namespace, self.name,
                 generation, len(files))
        self.published = Listing(self.namespace, self.name, manifest, None, version)
        return manifest

    def _switch(self, ns_fd: int, version: str) -> None:
        """Point the name at ``version``: a new symlink renamed over the old one (atomic)."""
        tmp = f"{LINK_PREFIX}{self.name}-{secrets.token_hex(8)}"
        os.symlink(version, tmp, dir_fd=ns_fd)
        try:
            try:
                os.rename(tmp, self.name, src_dir_fd=ns_fd, dst_dir_fd=ns_fd)
            except IsADirectoryError:
                # A directory at the name (an older layout, or planted): move it out of the way.
                os.rename(self.name, f"{TRASH_PREFIX}{self.name}-{secrets.token_hex(8)}",
                          src_dir_fd=ns_fd, dst_dir_fd=ns_fd)
                os.rename(tmp, self.name, src_dir_fd=ns_fd, dst_dir_fd=ns_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=ns_fd)
            raise

    def _hash_and_sync(self) -> list[FileEntry]:
        files: list[FileEntry] = []
        dirs = {self.path}
        for rel in _walk_files_path(self.path):
            if rel in (MANIFEST, SIGNATURE, OWNER):
                continue
            path = os.path.join(self.path, rel)
            parts = rel.split("/")[:-1]
            dirs.update(os.path.join(self.path, *parts[:i]) for i in range(1, len(parts) + 1))
            fd = os.open(path, _FILE_FLAGS)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise StoreError(f"staging entry {rel} is not a regular file")
                size, digest = hash_fd(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            files.append(FileEntry(path=rel, size=size, digest=digest))
        for d in dirs:
            _fsync_dir(d)
        return files


def _walk_files_path(path: str) -> Iterator[str]:
    fd = os.open(path, _DIR_FLAGS)
    try:
        yield from _walk_files(fd)
    finally:
        os.close(fd)


def _generation_of(version: str | None) -> int:
    m = _VERSION_RE.fullmatch(version or "")
    return int(m.group("gen")) if m else 0


class ArtifactStore:
    """Artifacts under ``root`` (the root itself is trusted: configured by the node admin)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def stage(self, namespace: str, name: str) -> Staging:
        validate_namespace(namespace)
        validate_name(name)
        try:
            return Staging(self, namespace, name)
        except OSError as exc:
            raise StoreError(f"cannot stage {namespace}/{name} in {self.root}: {exc}") from exc

    # ------------------------------------------------------------------ reading
    def _ns_fd(self, namespace: str, label: str) -> int:
        try:
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ArtifactNotFound(f"artifact {label} not found: no store at {self.root}") from None
        except OSError as exc:
            raise StoreError(f"store {self.root}: {exc}") from exc
        try:
            return os.open(namespace, _DIR_FLAGS, dir_fd=root)
        except FileNotFoundError:
            raise ArtifactNotFound(f"artifact {label} not found in {self.root}") from None
        except OSError as exc:
            raise ArtifactRejected(label, f"namespace dir: {_why(exc)}") from exc
        finally:
            os.close(root)

    @staticmethod
    def current_version(ns_fd: int, name: str) -> str | None:
        """The version dir ``name`` points to (validated as a version of ``name``), or None."""
        try:
            target = os.readlink(name, dir_fd=ns_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise ArtifactRejected(name, "not a published name (a directory or file where "
                                       "the name's link belongs; an older layout?)") from None
            raise
        m = _VERSION_RE.fullmatch(target)
        if m is None or m.group("name") != name:
            raise ArtifactRejected(name, f"name points to {target!r}, not to a version of {name}")
        return target

    def open(self, namespace: str, name: str, key: bytes) -> Artifact:
        """Open the version ``namespace/name`` points to now; cheap (reads the manifest only).

        A version replaced and removed between reading the name and locking it is not an
        error: the name is read again (a few times) and the new version opened."""
        validate_namespace(namespace)
        validate_name(name)
        label = f"{namespace}/{name}"
        ns_fd = self._ns_fd(namespace, label)
        try:
            for attempt in range(4):
                try:
                    version = self.current_version(ns_fd, name)
                except ArtifactRejected as exc:
                    raise ArtifactRejected(label, exc.reason) from None
                if version is None:
                    raise ArtifactNotFound(f"artifact {label} not found in {self.root}")
                try:
                    return self._open_version(ns_fd, version, label, key, namespace, name)
                except _Vanished as vanished:
                    if attempt == 3 or self.current_version(ns_fd, name) == version:
                        if vanished.cause is not None:
                            raise vanished.cause from None
                        raise ArtifactNotFound(f"artifact {label}: version {version} is gone") from None
            raise AssertionError("unreachable")  # pragma: no cover
        finally:
            os.close(ns_fd)

    def _open_version(self, ns_fd: int, version: str, label: str, key: bytes, namespace: str,
                      name: str) -> Artifact:
        dir_fd = lock_fd = -1
        try:
            try:
                dir_fd = os.open(version, _DIR_FLAGS, dir_fd=ns_fd)
            except FileNotFoundError:
                raise _Vanished() from None
            except OSError as exc:
                raise ArtifactRejected(label, f"version {version}: {_why(exc)}") from exc
            lock_fd, data = self._read_locked(dir_fd, label)
            sig = _read_capped(dir_fd, SIGNATURE, MAX_SIG_BYTES, label)
            verify(data, sig.decode("ascii", "replace"), key, artifact=label)
            manifest = Manifest.from_json(data, artifact=label)
            if (manifest.namespace, manifest.name) != (namespace, name):
                raise ArtifactRejected(label, f"manifest names {manifest.namespace}/{manifest.name}, "
                                       f"found at {label}")
            if manifest.generation != _generation_of(version):
                raise ArtifactRejected(label, f"manifest generation {manifest.generation} does not "
                                       f"match its version {version}")
            return Artifact(label, version, dir_fd, lock_fd, manifest)
        except BaseException as exc:
            for fd in (lock_fd, dir_fd):
                if fd >= 0:
                    os.close(fd)
            if isinstance(exc, ArtifactRejected) and ("incomplete" in exc.reason or exc.reason == "being removed"):
                raise _Vanished(exc) from exc  # a remover may have taken it apart under us
            raise

    @staticmethod
    def _read_locked(dir_fd: int, label: str) -> tuple[int, bytes]:
        """The manifest's bytes, read through the fd that holds the version's shared lock."""
        fd = _open_regular(dir_fd, MANIFEST, label)
        try:
            # Never wait here (this runs inside NRI handlers): a writer lock means a remover
            # is taking this version away.
            if not _ofd_lock(fd, fcntl.F_RDLCK, wait=False):
                raise ArtifactRejected(label, "being removed")
            data = b""
            while len(data) <= MAX_MANIFEST and (more := os.pread(fd, MAX_MANIFEST + 1 - len(data), len(data))):
                data += more
            if len(data) > MAX_MANIFEST:
                raise ArtifactRejected(label, f"{MANIFEST} larger than {MAX_MANIFEST} bytes")
            return fd, data
        except BaseException:
            os.close(fd)
            raise

    # ------------------------------------------------------------------ listing
    def namespaces(self) -> list[str]:
        return self._children(self.root)

    def list(self, namespace: str | None = None, key: bytes | None = None) -> list[Listing]:
        """Every artifact (of one namespace); with ``key`` the signature is checked and a bad
        one is listed with its problem."""
        out: list[Listing] = []
        namespaces = [validate_namespace(namespace)] if namespace else self.namespaces()
        for ns in namespaces:
            ns_path = os.path.join(self.root, ns)
            if not os.path.isdir(ns_path) or os.path.islink(ns_path):
                if namespace is None:
                    out.append(Listing(ns, "", None, "namespace entry is not a directory"))
                continue
            for name in self._children(ns_path):
                out.append(self._describe(ns, name, key))
        return out

    def _children(self, path: str) -> builtins.list[str]:
        try:
            return sorted(n for n in os.listdir(path) if not n.startswith("."))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreError(f"cannot list {path}: {exc}") from exc

    def _describe(self, ns: str, name: str, key: bytes | None) -> Listing:
        try:
            validate_namespace(ns)
            validate_name(name)
            if key is not None:
                with self.open(ns, name, key) as art:
                    return Listing(ns, name, art.manifest, None, art.version)
            ns_fd = self._ns_fd(ns, f"{ns}/{name}")
            try:
                version = self.current_version(ns_fd, name)
                if version is None:
                    return Listing(ns, name, None, "vanished")
                dir_fd = os.open(version, _DIR_FLAGS, dir_fd=ns_fd)
                try:
                    data = _read_capped(dir_fd, MANIFEST, MAX_MANIFEST, f"{ns}/{name}")
                finally:
                    os.close(dir_fd)
            finally:
                os.close(ns_fd)
            return Listing(ns, name, Manifest.from_json(data, artifact=f"{ns}/{name}"),
                           "signature not checked", version)
        except RekindleError as exc:
            return Listing(ns, name, None, str(exc))
        except OSError as exc:
            return Listing(ns, name, None, f"unreadable: {exc}")

    def leftovers(self, namespace: str | None = None) -> builtins.list[Leftover]:
        """Staging dirs, trash, pointer temp links and versions no name points to."""
        out: list[Leftover] = []
        now = time.time()
        for ns in [validate_namespace(namespace)] if namespace else self.namespaces():
            try:
                ns_fd = self._ns_fd(ns, ns)
            except RekindleError:
                continue
            try:
                live = set()
                for name in os.listdir(ns_fd):
                    if not name.startswith("."):
                        with contextlib.suppress(RekindleError, OSError):
                            live.add(self.current_version(ns_fd, name))
                for entry in sorted(os.listdir(ns_fd)):
                    kind = _leftover_kind(entry, live)
                    if kind is None:
                        continue
                    st = os.stat(entry, dir_fd=ns_fd, follow_symlinks=False)
                    owner, size = None, 0
                    if stat.S_ISDIR(st.st_mode):
                        with contextlib.suppress(OSError):
                            fd = os.open(entry, _DIR_FLAGS, dir_fd=ns_fd)
                            try:
                                owner = _read_owner(fd) if kind == "staging" else None
                                size = _tree_bytes(fd)
                            finally:
                                os.close(fd)
                    created = owner.created if owner else st.st_mtime
                    out.append(Leftover(ns, entry, kind, size, owner, max(0.0, now - created)))
            finally:
                os.close(ns_fd)
        return out

    # ------------------------------------------------------------------ removing
    def remove_version(self, ns_fd: int, version: str, wait: float = 0.0) -> bool:
        """Remove a version dir unless a reader holds it (then leave it for a later sweep)."""
        try:
            dir_fd = os.open(version, _DIR_FLAGS, dir_fd=ns_fd)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                os.unlink(version, dir_fd=ns_fd)
                return True
            raise
        try:
            lock = _exclusive(dir_fd, wait)
            if lock is None:
                log.info("version %s is being read; leaving it for a later sweep", version)
                return False
            trash = f"{TRASH_PREFIX}{version.lstrip('.')}-{secrets.token_hex(4)}"
            try:
                os.rename(version, trash, src_dir_fd=ns_fd, dst_dir_fd=ns_fd)
            finally:
                if lock >= 0:
                    os.close(lock)
            shutil.rmtree(trash, dir_fd=ns_fd, ignore_errors=True)
            return True
        finally:
            os.close(dir_fd)

    def delete(self, namespace: str, name: str, wait: float = 0.0) -> None:
        """Remove ``namespace/name``: the name first (atomically), then its version. Refuses
        (StoreError) when a restore is reading it and ``wait`` seconds did not see it finish."""
        validate_namespace(namespace)
        validate_name(name)
        label = f"{namespace}/{name}"
        ns_fd = self._ns_fd(namespace, label)
        try:
            try:
                version = self.current_version(ns_fd, name)
            except ArtifactRejected:
                version = None  # a broken name: remove whatever is there
            if version is not None:
                dir_fd = os.open(version, _DIR_FLAGS, dir_fd=ns_fd)
                try:
                    lock = _exclusive(dir_fd, wait)
                    if lock is None:
                        raise StoreError(f"delete {label}: a restore is reading it; retry later "
                                         "or pass --wait SECONDS")
                    try:
                        os.unlink(name, dir_fd=ns_fd)
                    finally:
                        if lock >= 0:
                            os.close(lock)
                finally:
                    os.close(dir_fd)
                self.remove_version(ns_fd, version)
            else:
                try:
                    st = os.stat(name, dir_fd=ns_fd, follow_symlinks=False)
                except FileNotFoundError:
                    raise ArtifactNotFound(f"artifact {label} not found in {self.root}") from None
                if stat.S_ISDIR(st.st_mode):
                    trash = f"{TRASH_PREFIX}{name}-{secrets.token_hex(8)}"
                    os.rename(name, trash, src_dir_fd=ns_fd, dst_dir_fd=ns_fd)
                    shutil.rmtree(trash, dir_fd=ns_fd, ignore_errors=True)
                else:
                    os.unlink(name, dir_fd=ns_fd)
            os.fsync(ns_fd)
        except OSError as exc:
            raise StoreError(f"delete {label}: {exc}") from exc
        finally:
            os.close(ns_fd)
        log.info("deleted artifact %s", label)

    def sweep(self, namespace: str | None = None, stale_after: float = STALE_AFTER,
              grace: float = GRACE) -> builtins.list[Leftover]:
        """Remove what is provably abandoned; returns what was removed."""
        removed = []
        for item in self.leftovers(namespace):
            if not self._abandoned(item, stale_after, grace):
                continue
            ns_fd = self._ns_fd(item.namespace, item.namespace)
            try:
                if item.kind == "link":
                    os.unlink(item.entry, dir_fd=ns_fd)
                elif item.kind in ("unreferenced-version", "trash"):
                    if not self.remove_version(ns_fd, item.entry):
                        continue
                else:
                    shutil.rmtree(item.entry, dir_fd=ns_fd, ignore_errors=True)
                removed.append(item)
                log.info("swept %s %s/%s (%d bytes)", item.kind, item.namespace, item.entry, item.bytes)
            except OSError as exc:
                log.warning("cannot sweep %s/%s: %s", item.namespace, item.entry, exc)
            finally:
                os.close(ns_fd)
        return removed

    @staticmethod
    def _abandoned(item: Leftover, stale_after: float, grace: float) -> bool:
        if item.kind == "staging":
            if item.owner is not None and item.owner.provably_dead():
                return True
            return item.age > stale_after
        if item.kind == "trash":
            return True  # renamed away by a remover; its lock check guards readers
        return item.age > grace

    def prune(self, namespace: str | None = None, older_than: float | None = None,
              keep_last: int | None = None) -> builtins.list[str]:
        """Delete artifacts whose current version is older than ``older_than`` seconds, and
        versions beyond the newest ``keep_last`` of a name; never one a restore is reading."""
        done: list[str] = []
        now_us = time.time_ns() // 1000
        for ns in [validate_namespace(namespace)] if namespace else self.namespaces():
            try:
                ns_fd = self._ns_fd(ns, ns)
            except RekindleError:
                continue
            try:
                by_name: dict[str, list[tuple[int, str]]] = {}
                for entry in os.listdir(ns_fd):
                    m = _VERSION_RE.fullmatch(entry)
                    if m:
                        by_name.setdefault(m.group("name"), []).append((int(m.group("gen")), entry))
                for name, versions in sorted(by_name.items()):
                    try:
                        current = self.current_version(ns_fd, name) if is_valid_name(name) else None
                    except ArtifactRejected:
                        current = None
                    if older_than is not None and current is not None:
                        if now_us - _generation_of(current) > older_than * 1e6:
                            try:
                                self.delete(ns, name)
                                done.append(f"{ns}/{name}")
                            except StoreError as exc:
                                log.info("prune: %s", exc)
                            continue
                    if keep_last is not None:
                        for _gen, version in sorted(versions, reverse=True)[max(keep_last, 1):]:
                            if version != current and self.remove_version(ns_fd, version):
                                done.append(f"{ns}/{version}")
            finally:
                os.close(ns_fd)
        return done


def _leftover_kind(entry: str, live: set[str | None]) -> str | None:
    if entry.startswith(STAGING_PREFIX):
        return "staging"
    if entry.startswith(TRASH_PREFIX):
        return "trash"
    if entry.startswith(LINK_PREFIX):
        return "link"
    if entry.startswith(VERSION_PREFIX) and entry not in live:
        return "unreferenced-version"
    return None
