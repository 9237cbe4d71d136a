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
- Digests: ``runtime.digests``; the open version: ``runtime.store.artifact``; fd-relative file
  operations and the OFD locks: ``runtime.fs.fdfs``.
- Leaks: a staging dir records its owner (``runtime.proc.owner``); ``runtime.store.gc`` lists what is
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
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType

from runtime import layout, names
from runtime.digests import Hashed, hash_fd
from runtime.errors import ArtifactNotFound, ArtifactRejected, RekindleError, StoreError
from runtime.fs.fdfs import (
    DIR_FLAGS,
    FILE_FLAGS,
    exclusive,
    ofd_lock,
    open_regular,
    read_capped,
    remove_tree,
    rename_noreplace,
    same_inode,
    tree_bytes,
    walk_files_path,
    why,
    write_file,
)
from runtime.manifest import MAX_MANIFEST_BYTES as MAX_MANIFEST
from runtime.manifest import FileEntry, Manifest, sign, verify
from runtime.proc.owner import OWNER, write_owner_at
from runtime.store.artifact import Artifact, Vanished

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
    stored_bytes: int = 0  # what the version takes on the store's file system (holes take none)


class Staging:
    """An artifact built in a private node-local dir, then published into the store through fds.

    ``path`` is a fresh directory under ``private_root`` (node-local, root-only: nobody else can
    write there), where CRIU dumps and the capture writes by path. Nothing is written into the
    shared store before :meth:`publish`, and what it writes there goes through directory fds only:
    the store's staging dir is created exclusively (``mkdirat``) and held by fd, every file in it
    is created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` below that fd (or moved in with
    ``renameat2(RENAME_NOREPLACE)``), so a symlink, hard link or directory planted or swapped in
    the store meanwhile is never written through. Digests are of the private bytes. Use as a
    context manager; on exit both dirs are removed unless published."""

    def __init__(self, store: ArtifactStore, namespace: str, name: str, private_root: str | None = None) -> None:
        self.store = store
        self.namespace, self.name = namespace, name
        root = private_root or tempfile.gettempdir()
        _check_private(root)
        self.path = tempfile.mkdtemp(prefix=f"staging-{namespace}-{name}-", dir=root)  # mode 0700
        self.entry: str | None = None  # the staging dir's name in the store, while it exists
        self._entry_stat: os.stat_result | None = None
        self.published: Listing | None = None

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None and self.published is None:
            log.warning("staging %s/%s left unpublished; removing it", self.namespace, self.name)
        shutil.rmtree(self.path, ignore_errors=True)
        if self.entry is not None:
            self._remove_entry()

    def _remove_entry(self) -> None:
        """Remove our staging dir from the store, only if the name still holds our directory."""
        assert self.entry is not None and self._entry_stat is not None
        try:
            ns_fd = self.store._ns_fd(self.namespace, f"{self.namespace}/{self.name}")
        except RekindleError:
            return
        try:
            st = os.stat(self.entry, dir_fd=ns_fd, follow_symlinks=False)
            if same_inode(st, self._entry_stat):
                remove_tree(ns_fd, self.entry)
        except Exception as exc:  # noqa: BLE001 - whatever was planted there, the sweep takes it later
            log.warning("staging %s/%s: cannot remove %s from the store (%s); left for the sweep",
                        self.namespace, self.name, self.entry, exc)
        finally:
            os.close(ns_fd)
        self.entry = None

    def publish(self, manifest: Manifest, key: bytes, known: Iterable[Hashed] = ()) -> Manifest:
        """Record every file in the manifest, sign it, and switch the name to this version.
        ``known``: digests made of private files while they were written (runtime.pages.tailhash);
        a file moved in that is the very inode, at the very size, is not read again."""
        if (manifest.namespace, manifest.name) != (self.namespace, self.name):
            raise StoreError(f"manifest names {manifest.namespace}/{manifest.name}, staging is "
                             f"for {self.namespace}/{self.name}")
        label = f"{self.namespace}/{self.name}"
        ns_fd = self.store._ns_fd(self.namespace, label, create=True)
        try:
            try:
                previous = self.store.current_version(ns_fd, self.name)
            except ArtifactRejected:
                previous = None  # whatever sits at the name is moved away by _switch
            entry = f"{STAGING_PREFIX}{self.name}-{secrets.token_hex(8)}"
            os.mkdir(entry, 0o700, dir_fd=ns_fd)  # EEXIST if planted: fail, never reuse
            st_fd = os.open(entry, DIR_FLAGS, dir_fd=ns_fd)
            try:
                self.entry, self._entry_stat = entry, os.fstat(st_fd)
                write_owner_at(st_fd)
                files = _transfer(self.path, st_fd, label, {(k.dev, k.ino): k for k in known})
                generation = max(time.time_ns() // 1000, generation_of(previous) + 1)
                manifest = dataclasses.replace(manifest, files=tuple(files), generation=generation)
                data = manifest.to_json()
                write_file(MANIFEST, data, dir_fd=st_fd, exclusive=True)
                write_file(SIGNATURE, sign(data, key).encode(), dir_fd=st_fd, exclusive=True)
                os.fsync(st_fd)
                version = f"{VERSION_PREFIX}{self.name}-{generation}-{secrets.token_hex(8)}"
                rename_noreplace(ns_fd, entry, ns_fd, version)
                self.entry = version
                # The owner record goes only once the dir is a version: a staging dir killed at
                # any moment before keeps it, so the sweep knows it is dead.
                os.unlink(OWNER, dir_fd=st_fd)
                # The name must hold the very dir we wrote: one swapped in meanwhile is never
                # pointed at (its files are not ours, whatever they say).
                try:
                    now = os.stat(version, dir_fd=ns_fd, follow_symlinks=False)
                except FileNotFoundError:
                    now = None
                if now is None or not same_inode(now, self._entry_stat):
                    self.entry = None
                    raise StoreError(f"publish {label}: the staging dir was moved or replaced in the "
                                     "store while it was published; not published")
                replaced = self._pointed(ns_fd)  # read again: a publish racing ours may have switched
                self._switch(ns_fd, version)
                self.entry = None
                os.fsync(ns_fd)
            finally:
                os.close(st_fd)
        except OSError as exc:
            os.close(ns_fd)
            raise StoreError(f"publish {label}: {exc}") from exc
        except BaseException:
            os.close(ns_fd)
            raise
        try:
            # What the name pointed to before ours, and ours if a racing publish switched the
            # name after us: no name points to them again (each publisher switches once), so
            # they go now, not after the sweep's grace (a reader's lock still keeps one).
            pointed = self._pointed(ns_fd)
            for stale in dict.fromkeys((previous, replaced, version if pointed is not None else None)):
                if stale and stale != pointed:
                    self.store.remove_version(ns_fd, stale)
        finally:
            os.close(ns_fd)
        log.info("published artifact %s/%s generation %d (%d files)", self.namespace, self.name,
                 generation, len(files))
        self.published = Listing(self.namespace, self.name, manifest, None, version)
        return manifest

    def _pointed(self, ns_fd: int) -> str | None:
        """The version the name points to now; None for anything else there."""
        try:
            return self.store.current_version(ns_fd, self.name)
        except (ArtifactRejected, OSError):
            return None

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


def _remove_quietly(ns_fd: int, name: str) -> None:
    """Remove a tree the store no longer names; what cannot go now is left for the sweep."""
    try:
        remove_tree(ns_fd, name)
    except (OSError, RekindleError) as exc:
        log.warning("cannot remove %s from the store yet (%s); left for the sweep", name, exc)


def _check_private(root: str) -> None:
    """``root`` must be a real directory that only root (or this user) can write: the checkpoint
    writes there by path, and CRIU follows what it finds."""
    try:
        st = os.lstat(root)
    except OSError as exc:
        raise StoreError(f"private staging root {root}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid()) or (
            st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise StoreError(f"private staging root {root} is not a directory only its owner can write")


def _transfer(src_root: str, dst_fd: int, label: str,
              known: Mapping[tuple[int, int], Hashed] | None = None) -> list[FileEntry]:
    """Move or copy the private tree ``src_root`` into the store dir ``dst_fd``; the files' entries.

    Every file is hashed from its private bytes: hashed (a ``known`` digest of that very inode
    and size stands for the hash), then moved in with a no-replace rename when the store is on
    the same file system, else copied while hashed into a file created exclusively. Never
    hashed once it is in the store: another writer of the store could have rewritten it."""
    known = known or {}
    files: list[FileEntry] = []
    dirs: dict[str, int] = {"": os.dup(dst_fd)}
    dst_dev = os.fstat(dst_fd).st_dev
    try:
        for rel in walk_files_path(src_root):
            if rel in (MANIFEST, SIGNATURE, OWNER):
                continue
            parent, base = os.path.split(rel)
            pfd = _dst_dir(dirs, parent)
            src_dir = os.path.join(src_root, parent)
            fd = os.open(os.path.join(src_dir, base), FILE_FLAGS)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise StoreError(f"staging entry {rel} is not a regular file")
                moved = False
                if st.st_dev == dst_dev:
                    # Hashed while private, and only then moved in: once in the store, another
                    # writer of it can rewrite the file, and what it wrote must never be signed.
                    ahead = known.get((st.st_dev, st.st_ino))
                    if ahead is not None and ahead.matches(st):
                        size, digest = ahead.size, ahead.digest
                    else:
                        size, digest = hash_fd(fd)
                    os.fsync(fd)
                    moved = _move(src_dir, base, pfd)
                if not moved:
                    out = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  0o600, dir_fd=pfd)
                    try:
                        size, digest = hash_fd(fd, out)
                        os.fsync(out)
                    finally:
                        os.close(out)
            finally:
                os.close(fd)
            files.append(FileEntry(path=rel, size=size, digest=digest))
        for d in dirs.values():
            os.fsync(d)
    finally:
        for d in dirs.values():
            os.close(d)
    return files


def _dst_dir(dirs: dict[str, int], rel: str) -> int:
    """The store-side fd of directory ``rel`` (made exclusively, parents first)."""
    if rel in dirs:
        return dirs[rel]
    parent, base = os.path.split(rel)
    pfd = _dst_dir(dirs, parent)
    os.mkdir(base, 0o700, dir_fd=pfd)
    dirs[rel] = os.open(base, DIR_FLAGS, dir_fd=pfd)
    return dirs[rel]


def _move(src_dir: str, base: str, dst_fd: int) -> bool:
    """Rename a private file into the store dir; False where only a copy can do it."""
    src_fd = os.open(src_dir, DIR_FLAGS)
    try:
        rename_noreplace(src_fd, base, dst_fd, base)
        return True
    except OSError as exc:
        if exc.errno == errno.EXDEV:  # another mount of the same file system
            return False
        raise
    finally:
        os.close(src_fd)


def generation_of(version: str | None) -> int:
    m = VERSION_RE.fullmatch(version or "")
    return int(m.group("gen")) if m else 0


class ArtifactStore:
    """Artifacts under ``root`` (the root itself is trusted: configured by the node admin)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def stage(self, namespace: str, name: str, private_root: str | None = None) -> Staging:
        """A staging for ``namespace/name`` whose files are built under ``private_root`` (a
        node-local dir nobody else can write; default the temp dir)."""
        validate_namespace(namespace)
        validate_name(name)
        try:
            return Staging(self, namespace, name, private_root)
        except OSError as exc:
            raise StoreError(f"cannot stage {namespace}/{name} in {self.root}: {exc}") from exc

    # ------------------------------------------------------------------ reading
    def _ns_fd(self, namespace: str, label: str, create: bool = False) -> int:
        if create:
            try:
                os.makedirs(self.root, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"store {self.root}: {exc}") from exc
        try:
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ArtifactNotFound(f"artifact {label} not found: no store at {self.root}") from None
        except OSError as exc:
            raise StoreError(f"store {self.root}: {exc}") from exc
        try:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(namespace, 0o700, dir_fd=root)
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

    def open(self, namespace: str, name: str, key: bytes, version: str | None = None) -> Artifact:
        """Open the version ``namespace/name`` points to now; cheap (reads the manifest only).

        A version replaced and removed between reading the name and locking it is not an
        error: the name is read again (a few times) and the new version opened. With
        ``version`` (an :attr:`Artifact.version` seen earlier), that version and no other:
        ArtifactNotFound once it is gone, whatever the name points to now."""
        validate_namespace(namespace)
        validate_name(name)
        label = f"{namespace}/{name}"
        ns_fd = self._ns_fd(namespace, label)
        try:
            if version is not None:
                m = VERSION_RE.fullmatch(version)
                if m is None or m.group("name") != name:
                    raise ArtifactRejected(label, f"{version!r} is not a version of {name}")
                try:
                    return self._open_version(ns_fd, version, label, key, namespace, name)
                except Vanished as vanished:
                    if vanished.cause is not None:
                        raise vanished.cause from None
                    raise ArtifactNotFound(f"artifact {label}: version {version} is gone") from None
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
        got = self._read_listing(ns, name, key)
        if not got.version:
            return got
        return dataclasses.replace(got, stored_bytes=self._stored_bytes(ns, got.version))

    def _stored_bytes(self, ns: str, version: str) -> int:
        """The allocated bytes of a version dir (0 when it cannot be read: only a figure)."""
        try:
            ns_fd = os.open(os.path.join(self.root, ns), DIR_FLAGS)
            try:
                dir_fd = os.open(version, DIR_FLAGS, dir_fd=ns_fd)
            finally:
                os.close(ns_fd)
            try:
                return tree_bytes(dir_fd)
            finally:
                os.close(dir_fd)
        except (OSError, RekindleError):
            return 0

    def _read_listing(self, ns: str, name: str, key: bytes | None) -> Listing:
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
        """Remove a version (or trash) dir unless a reader holds it (then leave it for a later
        sweep): renamed to trash under the exclusive lock, then removed without recursion."""
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
            trash = (version if version.startswith(TRASH_PREFIX)
                     else f"{TRASH_PREFIX}{version.lstrip('.')}-{secrets.token_hex(4)}")
            try:
                if trash != version:
                    os.rename(version, trash, src_dir_fd=ns_fd, dst_dir_fd=ns_fd)
            finally:
                if lock >= 0:
                    os.close(lock)
        finally:
            os.close(dir_fd)
        _remove_quietly(ns_fd, trash)
        return True

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
                    _remove_quietly(ns_fd, trash)
                else:
                    os.unlink(name, dir_fd=ns_fd)
            os.fsync(ns_fd)
        except OSError as exc:
            raise StoreError(f"delete {label}: {exc}") from exc
        finally:
            os.close(ns_fd)
        log.info("deleted artifact %s", label)

