"""The artifact store: ``<root>/<namespace>/<name>/``, published atomically, read defensively.

Contract:

- Names are validated before any path is built: a namespace is a DNS-1123 label (1-63 of
  ``[a-z0-9]([-a-z0-9]*[a-z0-9])?``), an artifact name is 1-63 of
  ``[a-z0-9]([-a-z0-9.]*[a-z0-9])?``. Anything else raises :class:`StoreError`. Entries whose
  name starts with ``.`` (staging and trash dirs) are never artifacts.
- :meth:`ArtifactStore.stage` yields a :class:`Staging` dir ``<ns>/.staging-<name>-<random>/`` on
  the store's filesystem; it is removed on exception or when left unpublished.
  :meth:`Staging.publish` hashes every file, writes ``manifest.json`` and its signature, fsyncs
  files and dirs, then swaps the dir in by rename (old artifact renamed to ``.trash-*`` first).
  A reader sees the old artifact, no artifact, or the new one; never a partial one.
- :meth:`ArtifactStore.open` is cheap (it runs inside an NRI handler): it refuses symlinks on the
  way (below the store root), checks the signature before parsing, and refuses a manifest whose
  namespace/name differ from its location. :meth:`Artifact.verify_files` is the expensive part:
  it hashes every listed file and refuses missing, extra, changed or unsafe ones.
- A file's ``sha256`` is the plain digest of its content up to 64 MiB; above that it is the
  sha256 of a tag and the digests of its 64 MiB pieces, which are hashed in parallel (a GPU
  checkpoint is tens of GiB in a few files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

from runtime.errors import ArtifactNotFound, ArtifactRejected, RekindleError, StoreError
from runtime.manifest import MAX_MANIFEST_BYTES as MAX_MANIFEST
from runtime.manifest import FileEntry, Manifest, sign, verify

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SIGNATURE = "manifest.json.sig"
MAX_SIG_BYTES = 256
_CHUNK = 1 << 20
_NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def validate_namespace(namespace: str) -> str:
    if len(namespace) > 63 or not _NAMESPACE_RE.fullmatch(namespace):
        raise StoreError(f"invalid namespace {namespace!r}: want a DNS-1123 label")
    return namespace


def validate_name(name: str) -> str:
    if len(name) > 63 or not _NAME_RE.fullmatch(name):
        raise StoreError(f"invalid artifact name {name!r}: want 1-63 of [a-z0-9.-], "
                         "starting and ending with [a-z0-9]")
    return name


def _fsync_dir(path: str) -> None:
    fd = os.open(path, _DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


# Files larger than one piece get a two-level digest: the sha256 of the sha256s of their
# 64 MiB pieces, hashed in parallel. GPU checkpoints are tens of GiB in a few files; one
# sequential sha256 (~1.5 GB/s) would add seconds to every restore.
PIECE = 64 << 20
_PIECE_TAG = b"rekindle-pieces-v1\n"
_WORKERS = min(16, os.cpu_count() or 1)


def _hash_range(fd: int, offset: int, length: int) -> bytes:
    digest, done = hashlib.sha256(), 0
    while done < length:
        data = os.pread(fd, min(_CHUNK, length - done), offset + done)
        if not data:
            raise OSError(errno.EIO, "file shrank while hashing")
        digest.update(data)  # releases the GIL for large buffers: threads hash in parallel
        done += len(data)
    return digest.digest()


def _hash_fd(fd: int) -> tuple[int, str]:
    """(size, digest): plain sha256 up to PIECE bytes, else sha256(tag + piece digests)."""
    size = os.fstat(fd).st_size
    if size <= PIECE:
        digest, got = hashlib.sha256(), 0
        while chunk := os.pread(fd, _CHUNK, got):
            digest.update(chunk)
            got += len(chunk)
        return got, digest.hexdigest()
    offsets = range(0, size, PIECE)
    with ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="rekindle-hash") as pool:
        pieces = list(pool.map(lambda off: _hash_range(fd, off, min(PIECE, size - off)), offsets))
    return size, hashlib.sha256(_PIECE_TAG + b"".join(pieces)).hexdigest()


def _read_capped(dir_fd: int, name: str, cap: int, label: str) -> bytes:
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ArtifactRejected(label, f"incomplete: no {name}") from None
    except OSError as exc:
        raise ArtifactRejected(label, f"{name}: {_why(exc)}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArtifactRejected(label, f"{name} is not a regular file")
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


@dataclass(frozen=True, slots=True)
class Artifact:
    """A published artifact whose signature and location were checked by ``open``."""

    path: str
    manifest: Manifest

    @property
    def label(self) -> str:
        return f"{self.manifest.namespace}/{self.manifest.name}"

    def verify_files(self) -> None:
        """Stream-hash every listed file; raise ArtifactRejected naming the first bad one."""
        listed = {f.path for f in self.manifest.files}
        try:
            root = os.open(self.path, _DIR_FLAGS)
        except OSError as exc:
            raise ArtifactRejected(self.label, f"artifact dir: {_why(exc)}") from exc
        try:
            for entry in self.manifest.files:
                self._check_file(root, entry)
            for rel in _walk_files(root):
                if rel not in listed and rel not in (MANIFEST, SIGNATURE):
                    raise ArtifactRejected(self.label, f"file {rel}: not in the manifest")
        except OSError as exc:
            raise ArtifactRejected(self.label, f"cannot read artifact: {exc}") from exc
        finally:
            os.close(root)

    def _check_file(self, root: int, entry: FileEntry) -> None:
        parts = entry.path.split("/")
        if (entry.path.startswith("/") or "\0" in entry.path
                or any(p in ("", ".", "..") for p in parts) or entry.path in (MANIFEST, SIGNATURE)):
            raise ArtifactRejected(self.label, f"file {entry.path!r}: unsafe path in manifest")
        fds: list[int] = []
        try:
            cur = root
            for part in parts[:-1]:
                cur = os.open(part, _DIR_FLAGS, dir_fd=cur)
                fds.append(cur)
            fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=cur)
            fds.append(fd)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ArtifactRejected(self.label, f"file {entry.path}: not a regular file")
            size, digest = _hash_fd(fd)
        except FileNotFoundError:
            raise ArtifactRejected(self.label, f"file {entry.path}: missing") from None
        except OSError as exc:
            raise ArtifactRejected(self.label, f"file {entry.path}: {_why(exc)}") from exc
        finally:
            for fd in fds:
                os.close(fd)
        if size != entry.size or digest != entry.sha256:
            raise ArtifactRejected(self.label, f"file {entry.path}: content changed "
                                   f"(size {size}, want {entry.size})")


@dataclass(frozen=True, slots=True)
class Listing:
    """One entry of :meth:`ArtifactStore.list`: a manifest, or the reason it is broken."""

    namespace: str
    name: str
    manifest: Manifest | None
    problem: str | None


class Staging:
    """A staging dir; use as a context manager and call :meth:`publish` inside it."""

    def __init__(self, store: ArtifactStore, namespace: str, name: str) -> None:
        self.namespace, self.name = namespace, name
        self.parent = os.path.join(store.root, namespace)
        os.makedirs(self.parent, mode=0o700, exist_ok=True)
        if os.path.islink(self.parent):
            raise StoreError(f"store namespace dir {self.parent} is a symlink")
        self.path = os.path.join(self.parent, f".staging-{name}-{secrets.token_hex(8)}")
        os.mkdir(self.path, 0o700)
        self.published: Artifact | None = None

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if os.path.lexists(self.path):
            if exc is None and self.published is None:
                log.warning("staging %s left unpublished; removing it", self.path)
            shutil.rmtree(self.path, ignore_errors=True)

    def publish(self, manifest: Manifest, key: bytes) -> Artifact:
        """Record every file in the manifest, sign it, and swap the staging dir in."""
        if (manifest.namespace, manifest.name) != (self.namespace, self.name):
            raise StoreError(f"manifest names {manifest.namespace}/{manifest.name}, staging is "
                             f"for {self.namespace}/{self.name}")
        try:
            files = self._hash_and_sync()
            manifest = dataclasses.replace(manifest, files=tuple(files))
            data = manifest.to_json()
            _write_file(os.path.join(self.path, MANIFEST), data)
            _write_file(os.path.join(self.path, SIGNATURE), sign(data, key).encode())
            _fsync_dir(self.path)
            final = os.path.join(self.parent, self.name)
            trash = os.path.join(self.parent, f".trash-{self.name}-{secrets.token_hex(8)}")
            had_old = True
            try:
                os.rename(final, trash)
            except FileNotFoundError:
                had_old = False
            try:
                os.rename(self.path, final)
            except OSError:
                if had_old:
                    with contextlib.suppress(OSError):
                        os.rename(trash, final)
                raise
            _fsync_dir(self.parent)
        except OSError as exc:
            raise StoreError(f"publish {self.namespace}/{self.name}: {exc}") from exc
        if had_old:
            shutil.rmtree(trash, ignore_errors=True)
        log.info("published artifact %s/%s (%d files)", self.namespace, self.name, len(files))
        self.published = Artifact(final, manifest)
        return self.published

    def _hash_and_sync(self) -> list[FileEntry]:
        files: list[FileEntry] = []
        dirs = {self.path}
        for rel in _walk_files_path(self.path):
            if rel in (MANIFEST, SIGNATURE):
                continue
            path = os.path.join(self.path, rel)
            parts = rel.split("/")[:-1]
            dirs.update(os.path.join(self.path, *parts[:i]) for i in range(1, len(parts) + 1))
            fd = os.open(path, _FILE_FLAGS)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise StoreError(f"staging entry {rel} is not a regular file")
                size, digest = _hash_fd(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            files.append(FileEntry(path=rel, size=size, sha256=digest))
        for d in dirs:
            _fsync_dir(d)
        return files


def _walk_files_path(path: str) -> Iterator[str]:
    fd = os.open(path, _DIR_FLAGS)
    try:
        yield from _walk_files(fd)
    finally:
        os.close(fd)


class ArtifactStore:
    """Artifacts under ``root`` (trusted: configured by the node admin)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def stage(self, namespace: str, name: str) -> Staging:
        validate_namespace(namespace)
        validate_name(name)
        try:
            return Staging(self, namespace, name)
        except OSError as exc:
            raise StoreError(f"cannot stage {namespace}/{name} in {self.root}: {exc}") from exc

    def open(self, namespace: str, name: str, key: bytes) -> Artifact:
        """Check signature and location of ``namespace/name``; cheap (reads the manifest only)."""
        validate_namespace(namespace)
        validate_name(name)
        label = f"{namespace}/{name}"
        sig, data = self._read_manifest(namespace, name, label, with_sig=True)
        verify(data, sig.decode("ascii", "replace"), key, artifact=label)
        manifest = Manifest.from_json(data, artifact=label)
        if (manifest.namespace, manifest.name) != (namespace, name):
            raise ArtifactRejected(label, f"manifest names {manifest.namespace}/{manifest.name}, "
                                   f"found at {label}")
        return Artifact(os.path.join(self.root, namespace, name), manifest)

    def _read_manifest(self, namespace: str, name: str, label: str,
                       with_sig: bool) -> tuple[bytes, bytes]:
        """Signature and manifest bytes read from one directory. When a replace moved that
        directory away while we read it, read the new one (a bounded retry)."""
        for attempt in range(3):
            with contextlib.ExitStack() as stack:
                fd = self._open_dir(stack, namespace, name, label)
                try:
                    sig = _read_capped(fd, SIGNATURE, MAX_SIG_BYTES, label) if with_sig else b""
                    return sig, _read_capped(fd, MANIFEST, MAX_MANIFEST, label)
                except ArtifactRejected:
                    if attempt == 2 or self._still_current(fd, namespace, name):
                        raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _still_current(self, fd: int, namespace: str, name: str) -> bool:
        """Whether ``fd`` is still the directory published as ``namespace/name``."""
        try:
            now = os.lstat(os.path.join(self.root, namespace, name))
        except OSError:
            return False
        return os.path.samestat(now, os.fstat(fd))

    def _open_dir(self, stack: contextlib.ExitStack, namespace: str, name: str,
                  label: str) -> int:
        cur = -1
        try:
            cur = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            stack.callback(os.close, cur)
            for part in (namespace, name):
                cur = os.open(part, _DIR_FLAGS, dir_fd=cur)
                stack.callback(os.close, cur)
        except FileNotFoundError:
            raise ArtifactNotFound(f"artifact {label} not found in {self.root}") from None
        except OSError as exc:
            raise ArtifactRejected(label, f"path: {_why(exc)}") from exc
        return cur

    def list(self, namespace: str | None = None, key: bytes | None = None) -> list[Listing]:
        """Every artifact (of one namespace), broken ones with their problem; with ``key`` the
        signature is checked too, without it the manifest is only parsed."""
        out: list[Listing] = []
        namespaces = [validate_namespace(namespace)] if namespace else self._children(self.root)
        for ns in namespaces:
            ns_path = os.path.join(self.root, ns)
            if not os.path.isdir(ns_path) or os.path.islink(ns_path):
                if namespace is None:
                    out.append(Listing(ns, "", None, "namespace entry is not a directory"))
                continue
            for name in self._children(ns_path):
                out.append(self._describe(ns, name, key))
        return out

    def _children(self, path: str) -> list[str]:
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
                return Listing(ns, name, self.open(ns, name, key).manifest, None)
            _, data = self._read_manifest(ns, name, f"{ns}/{name}", with_sig=False)
            return Listing(ns, name, Manifest.from_json(data, artifact=f"{ns}/{name}"), None)
        except RekindleError as exc:
            return Listing(ns, name, None, str(exc))
        except OSError as exc:
            return Listing(ns, name, None, f"unreadable: {exc}")

    def delete(self, namespace: str, name: str) -> None:
        """Remove ``namespace/name`` (renamed away first, so it disappears atomically)."""
        validate_namespace(namespace)
        validate_name(name)
        parent = os.path.join(self.root, namespace)
        if os.path.islink(parent):
            raise StoreError(f"store namespace dir {parent} is a symlink")
        trash = os.path.join(parent, f".trash-{name}-{secrets.token_hex(8)}")
        try:
            os.rename(os.path.join(parent, name), trash)
            _fsync_dir(parent)
        except FileNotFoundError:
            raise ArtifactNotFound(f"artifact {namespace}/{name} not found in {self.root}") from None
        except OSError as exc:
            raise StoreError(f"delete {namespace}/{name}: {exc}") from exc
        if os.path.islink(trash) or not os.path.isdir(trash):
            os.unlink(trash)
        else:
            shutil.rmtree(trash)
        log.info("deleted artifact %s/%s", namespace, name)

