"""The HMAC key that signs artifact manifests: read it safely, create it only when asked.

Contract:

- :func:`read_key` ``(path) -> bytes``: the key's directory is opened once (O_DIRECTORY) and the
  key is resolved beneath it (:func:`runtime.fs.openat2.open_beneath`), so the symlinks kubelet makes
  for a Secret volume (``hmac.key -> ..data/hmac.key``, ``..data -> ..<timestamp>``) are followed,
  while an absolute symlink or a ``..`` that leaves the directory is refused. The key is first
  opened O_PATH and checked with fstat: only a regular file is ever opened for reading, and that
  open adds O_NONBLOCK (a FIFO swapped in meanwhile cannot hang us) and checks again. The file must
  be owned by our euid, not group/world accessible (kubelet's default Secret mode 0644 is not:
  the chart sets defaultMode 0400), and exactly 32 bytes.
- :func:`create_key` ``(path) -> bytes``: writes 32 random bytes, mode 0600, atomically (link of a
  fully written temp file in the same directory), never replacing what is there, then reads the
  key back through :func:`read_key`'s checks. Only ``rekindle plugin --create-key`` calls it.
- :func:`load_key` ``(path, create=False)``: read, or create when absent and ``create``.
- A missing key, or a missing directory, raises :class:`~runtime.errors.KeyMissing`; every other
  problem :class:`~runtime.errors.ConfigError`; each is one line that names the path.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat

from runtime.errors import ConfigError, KeyMissing
from runtime.fs.openat2 import open_beneath

log = logging.getLogger(__name__)

KEY_BYTES = 32

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symlink"}


def load_key(path: str | os.PathLike[str], *, create: bool = False) -> bytes:
    """The key at ``path``; when there is none and ``create`` is set, a new one."""
    try:
        return read_key(path)
    except KeyMissing:
        if not create:
            raise
    return create_key(path)


def read_key(path: str | os.PathLike[str]) -> bytes:
    """The 32-byte key at ``path``; KeyMissing or ConfigError otherwise."""
    full, directory, name = _split(path)
    dfd = _open_dir(full, directory)
    try:
        return _read_beneath(dfd, name, full, directory)
    finally:
        os.close(dfd)


def create_key(path: str | os.PathLike[str]) -> bytes:
    """Create the key at ``path`` unless something is already there; return the key at ``path``."""
    full, directory, name = _split(path)
    dfd = _open_dir(full, directory)
    try:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
        except OSError as exc:
            raise ConfigError(f"HMAC key {full}: cannot create it in {directory}: {exc.strerror}") from exc
        try:
            try:
                os.write(fd, secrets.token_bytes(KEY_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                # link, not rename: never replaces a key another process created meanwhile
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                log.info("created HMAC key %s", full)
            except FileExistsError:
                pass  # whatever is there now is checked below
        finally:
            os.unlink(tmp, dir_fd=dfd)
        os.fsync(dfd)
        return _read_beneath(dfd, name, full, directory)
    finally:
        os.close(dfd)


def _split(path: str | os.PathLike[str]) -> tuple[str, str, str]:
    full = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(full)
    if not name:
        raise ConfigError(f"HMAC key {full}: not a file path")
    return full, directory, name


def _open_dir(full: str, directory: str) -> int:
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise KeyMissing(full, f"directory {directory} does not exist") from exc
    except OSError as exc:
        raise ConfigError(f"HMAC key {full}: cannot open directory {directory}: {exc.strerror}") from exc


def _open_error(exc: OSError, full: str, directory: str) -> ConfigError:
    if exc.errno == errno.ENOENT:
        return KeyMissing(full)
    if exc.errno == errno.EXDEV:
        return ConfigError(f"HMAC key {full}: a symlink leads outside {directory} (refused)")
    if exc.errno == errno.ELOOP:
        return ConfigError(f"HMAC key {full}: a symlink loop, or a /proc magic link (refused)")
    return ConfigError(f"HMAC key {full}: cannot open: {exc.strerror}")


def _check(st: os.stat_result, full: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a file")
        raise ConfigError(f"HMAC key {full}: is {kind}, not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(f"HMAC key {full}: mode {stat.S_IMODE(st.st_mode):04o} is group/world accessible "
                          "(want 0400 or 0600)")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"HMAC key {full}: owned by uid {st.st_uid}, not {os.geteuid()}")


def _open_checked(dfd: int, name: str, flags: int, full: str, directory: str) -> tuple[int, os.stat_result]:
    try:
        fd = open_beneath(dfd, name, flags)
    except OSError as exc:
        raise _open_error(exc, full, directory) from exc
    try:
        st = os.fstat(fd)
        _check(st, full)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _read_beneath(dfd: int, name: str, full: str, directory: str) -> bytes:
    # O_PATH first: a FIFO, socket or device is named in the error without ever being opened.
    probe, _ = _open_checked(dfd, name, os.O_PATH, full, directory)
    os.close(probe)
    fd, _ = _open_checked(dfd, name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY, full, directory)
    try:
        data = os.read(fd, KEY_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"HMAC key {full}: cannot read: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise ConfigError(f"HMAC key {full}: {len(data)} bytes, want {KEY_BYTES}")
    return data
