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
- Digests: ``runtime.digests``; the open version: ``runtime.artifact``; fd-relative file
  operations and the OFD locks: ``runtime.fdfs``.
- Leaks: a staging dir records its owner (``runtime.owner``); ``runtime.store_gc`` lists what is
  left over and sweeps or prunes it.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from types import TracebackType

from runtime import layout, names
from runtime.artifact import Artifact, Vanished
from runtime.digests import hash_fd
from runtime.fdfs import (DIR_FLAGS, FILE_FLAGS, exclusive, fsync_dir, ofd_lock, open_regular, read_capped,
                          walk_files_path, why, write_file)
from runtime.errors import ArtifactNotFound, ArtifactRejected, RekindleError, StoreError
from runtime.manifest import MAX_MANIFEST_BYTES as MAX_MANIFEST
from runtime.manifest import FileEntry, Manifest, sign, verify
from runtime.owner import OWNER, write_owner

log = logging.getLogger(__name__)

MANIFEST = layout.MANIFEST
SIGNATURE = layout.SIGNATURE
MAX_SIG_BYTES = 256
_CHUNK = 1 << 20
VERSION_RE = re.compile(r"\.version-(?P<name>.+)-(?P<gen>[0-9]{1,20})-(?P<rand>[0-9a-f]{16})")
STAGING_PREFIX, VERSION_PREFIX, TRASH_PREFIX, LINK_PREFIX = ".staging-", ".version-", ".trash-", ".link-"


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


@dataclass(frozen=True, slots=True)
class Listing:
    """One entry of :meth:`ArtifactStore.list`: a manifest, or the reason it is bad."""

    namespace: str
    name: str
    manifest: Manifest | None
    problem: str | None
    version: str = ""


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
        try:
            write_owner(self.path)
        except BaseException:
            # Not even the owner record fits (a full store): without one, the sweep would keep
            # this dir for a day.
            shutil.rmtree(self.path, ignore_errors=True)
            raise
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
            ns_fd = os.open(self.parent, DIR_FLAGS)
        except OSError as exc:
            raise StoreError(f"publish {self.namespace}/{self.name}: {exc}") from exc
        try:
            try:
                previous = self.store.current_version(ns_fd, self.name)
            except ArtifactRejected:
                previous = None  # whatever sits at the name is moved away by _switch
            files = self._hash_and_sync()
            generation = max(time.time_ns() // 1000, generation_of(previous) + 1)
            manifest = dataclasses.replace(manifest, files=tuple(files), generation=generation)
            data = manifest.to_json()
            write_file(os.path.join(self.path, MANIFEST), data)
            write_file(os.path.join(self.path, SIGNATURE), sign(data, key).encode())
            os.unlink(os.path.join(self.path, OWNER))
            fsync_dir(self.path)
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
        for rel in walk_files_path(self.path):
            if rel in (MANIFEST, SIGNATURE, OWNER):
                continue
            path = os.path.join(self.path, rel)
            parts = rel.split("/")[:-1]
            dirs.update(os.path.join(self.path, *parts[:i]) for i in range(1, len(parts) + 1))
            fd = os.open(path, FILE_FLAGS)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise StoreError(f"staging entry {rel} is not a regular file")
                size, digest = hash_fd(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            files.append(FileEntry(path=rel, size=size, digest=digest))
        for d in dirs:
            fsync_dir(d)
        return files




def generation_of(version: str | None) -> int:
    m = VERSION_RE.fullmatch(version or "")
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
            return os.open(namespace, DIR_FLAGS, dir_fd=root)
        except FileNotFoundError:
            raise ArtifactNotFound(f"artifact {label} not found in {self.root}") from None
        except OSError as exc:
            raise ArtifactRejected(label, f"namespace dir: {why(exc)}") from exc
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
        m = VERSION_RE.fullmatch(target)
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
                except Vanished as vanished:
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
                dir_fd = os.open(version, DIR_FLAGS, dir_fd=ns_fd)
            except FileNotFoundError:
                raise Vanished() from None
            except OSError as exc:
                raise ArtifactRejected(label, f"version {version}: {why(exc)}") from exc
            lock_fd, data = self._read_locked(dir_fd, label)
            sig = read_capped(dir_fd, SIGNATURE, MAX_SIG_BYTES, label)
            verify(data, sig.decode("ascii", "replace"), key, artifact=label)
            manifest = Manifest.from_json(data, artifact=label)
            if (manifest.namespace, manifest.name) != (namespace, name):
                raise ArtifactRejected(label, f"manifest names {manifest.namespace}/{manifest.name}, "
                                       f"found at {label}")
            if manifest.generation != generation_of(version):
                raise ArtifactRejected(label, f"manifest generation {manifest.generation} does not "
                                       f"match its version {version}")
            return Artifact(label, version, dir_fd, lock_fd, manifest,
                            manifest_id=hashlib.sha256(data).hexdigest())
        except BaseException as exc:
            for fd in (lock_fd, dir_fd):
                if fd >= 0:
                    os.close(fd)
            if isinstance(exc, ArtifactRejected) and ("incomplete" in exc.reason or exc.reason == "being removed"):
                raise Vanished(exc) from exc  # a remover may have taken it apart under us
            raise

    @staticmethod
    def _read_locked(dir_fd: int, label: str) -> tuple[int, bytes]:
        """The manifest's bytes, read through the fd that holds the version's shared lock."""
        fd = open_regular(dir_fd, MANIFEST, label)
        try:
            # Never wait here (this runs inside NRI handlers): a writer lock means a remover
            # is taking this version away.
            if not ofd_lock(fd, fcntl.F_RDLCK, wait=False):
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
    def namespaces(self) -> builtins.list[str]:
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

    def _children(self, path: str) -> builtins.list[str]:  # list: the method above shadows it
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
                dir_fd = os.open(version, DIR_FLAGS, dir_fd=ns_fd)
                try:
                    data = read_capped(dir_fd, MANIFEST, MAX_MANIFEST, f"{ns}/{name}")
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

    # ------------------------------------------------------------------ removing
    def remove_version(self, ns_fd: int, version: str, wait: float = 0.0) -> bool:
        """Remove a version dir unless a reader holds it (then leave it for a later sweep)."""
        try:
            dir_fd = os.open(version, DIR_FLAGS, dir_fd=ns_fd)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                os.unlink(version, dir_fd=ns_fd)
                return True
            raise
        try:
            lock = exclusive(dir_fd, wait)
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
                dir_fd = os.open(version, DIR_FLAGS, dir_fd=ns_fd)
                try:
                    lock = exclusive(dir_fd, wait)
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

