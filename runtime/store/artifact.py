"""One published version of an artifact, open: read only through its directory fd, verified.

:class:`Artifact` is what ``ArtifactStore.open`` hands out: the version's directory fd, its
manifest (signature, location and generation checked) and a shared lock on it. Bytes are used
only as verified: :meth:`Artifact.copy_verified` copies a listed file into a private node-local
file while hashing it and refuses a mismatch; :meth:`Artifact.open_file` hands out an fd for
callers that hash exactly the bytes they consume (the bulk page fill, ``runtime.pages.bulk``).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from runtime.digests import WORKERS, hash_fd
from runtime.errors import ArtifactRejected
from runtime.fs.fdfs import DIR_FLAGS, FILE_FLAGS, safe_parts, why
from runtime.manifest import FileEntry, Manifest


class Vanished(Exception):
    """The version a name pointed to went away while being opened (a replace raced us)."""

    def __init__(self, cause: ArtifactRejected | None = None) -> None:
        super().__init__(str(cause or "gone"))
        self.cause = cause


class Artifact:
    """One version of an artifact, opened by ``ArtifactStore.open``: its directory fd, its
    manifest (signature and location checked) and a shared lock. Use as a context manager, or
    call :meth:`close`."""

    def __init__(self, label: str, version: str, dir_fd: int, lock_fd: int, manifest: Manifest,
                 manifest_id: str = "") -> None:
        self.label = label
        self.version = version
        self.manifest = manifest
        # sha256 of the signed manifest bytes: two opens read the same version only if
        # both the version name and this match (a name alone can be re-made by a store writer)
        self.manifest_id = manifest_id
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

    def yield_to_deletes(self) -> None:
        """Drop the shared lock (keep the directory fd): a reader that must not hold up a
        delete or a prune (the node cache's writer). Files it opens after a delete began are
        missing (ArtifactRejected); what it reads is verified as ever."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def stored_bytes(self) -> int:
        """What the manifest's files take on the store (holes take nothing; a file that cannot
        be read counts its size): the bytes a restore of this version reads at most."""
        total = 0
        for f in self.manifest.files:
            try:
                fd = self.open_file(f.path)
            except (ArtifactRejected, OSError):
                total += f.size
                continue
            try:
                total += min(os.fstat(fd).st_blocks * 512, f.size)
            finally:
                os.close(fd)
        return total

    def entry(self, path: str) -> FileEntry:
        try:
            return self._entries[path]
        except KeyError:
            raise ArtifactRejected(self.label, f"file {path}: not in the manifest") from None

    def open_file(self, path: str) -> int:
        """A read-only fd of listed file ``path``, opened below the version's dir fd without
        following any symlink. The caller must verify what it reads (size and digest)."""
        self.entry(path)
        parts = safe_parts(path)
        if parts is None:
            raise ArtifactRejected(self.label, f"file {path!r}: unsafe path in manifest")
        fds: list[int] = []
        try:
            cur = self._dir_fd
            for part in parts[:-1]:
                cur = os.open(part, DIR_FLAGS, dir_fd=cur)
                fds.append(cur)
            fd = os.open(parts[-1], FILE_FLAGS, dir_fd=cur)
        except FileNotFoundError:
            raise ArtifactRejected(self.label, f"file {path}: missing") from None
        except OSError as exc:
            raise ArtifactRejected(self.label, f"file {path}: {why(exc)}") from exc
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

    def copy_verified(self, path: str, dest: str, source: Callable[[str], int] | None = None) -> None:
        """Copy ``path`` to the private file ``dest`` while hashing; refuse a mismatch (and
        remove ``dest``). Only ``dest`` may be used afterwards. ``source``: opens the copy to
        read instead of the store's (the node cache's), verified all the same."""
        try:
            src = (source or self.open_file)(path)
        except OSError as exc:
            raise ArtifactRejected(self.label, f"file {path}: {why(exc)}") from exc
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

    def materialize(self, dest_dir: str, skip: Callable[[str], bool] = lambda _p: False,
                    source: Callable[[str], int] | None = None) -> int:
        """Copy every listed file not ``skip``ped into ``dest_dir`` (private, created 0700),
        verifying each, several files at once; returns the bytes copied. ``source``: as for
        :meth:`copy_verified`."""
        os.makedirs(dest_dir, mode=0o700, exist_ok=True)
        jobs = []
        for f in self.manifest.files:
            if skip(f.path):
                continue
            parts = safe_parts(f.path)
            if parts is None:
                raise ArtifactRejected(self.label, f"file {f.path!r}: unsafe path in manifest")
            os.makedirs(os.path.join(dest_dir, *parts[:-1]), mode=0o700, exist_ok=True)
            jobs.append((f, os.path.join(dest_dir, *parts)))
        with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rekindle-stage") as pool:
            list(pool.map(lambda job: self.copy_verified(job[0].path, job[1], source), jobs))
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
