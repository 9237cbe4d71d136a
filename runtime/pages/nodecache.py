"""The node-local artifact cache: verified, sealed copies that later restores map or read.

Layout: ``<root>/v1/<key>/`` per artifact version (``key``: the signed manifest's id and the
map mode), written by one writer into ``.tmp-<key>-<pid>`` (with an owner record) and renamed
into place whole; only root on the node can reach ``<root>`` (0700). An entry holds

- ``fill-<pid>.bin``: each process's bulk file byte for byte, but holes in the chunks wholly
  inside a mapped range and in those that hold no range (the fill, the streamed serve and the
  chunk digests work on it unchanged: none of them reads such a chunk);
- ``map-<pid>-<vaddr>.bin``: one file per mapped range (``runtime.pages.mapping``), its bytes at
  ``vaddr % 2 MiB``;
- ``files/``: verified copies of the artifact's other files (CRIU's images, the layer);
- ``entry.json``: what it was made from (label, version, manifest id, the mapped ranges) and
  the identity of each bulk file once sealed (size, inode, ctime).

Every byte written was hashed against the signed digests first (the bulk files' chunk sums,
the manifest's digest of every other file). A written file is made read-only (0444); an entry whose files do not have the recorded identity any
more (changed, replaced, truncated) is dropped, never used, and so is a partial one (no
``entry.json``; swept once its writer is provably dead). A restore holds a shared lock on the
entry's directory while it uses it; eviction (least recently used first, to stay under the
byte and entry bounds) takes it exclusively, so an entry a restore uses is never evicted.
The bulk bytes of the entry are not hashed again when used (a mapped range is mapped, the rest
is copied from a read-only mapping of its fill file: ``runtime.pages.bulk.fill``'s ``sealed``):
the entry is trusted because only root can change it, and a change made through the file system
changes its ctime.

On a tmpfs, the first restore of a version that streams (``runtime.pages.stream``) makes the
entry as it runs (:meth:`NodeCache.begin`, ``runtime.pages.entry.EntryBuild``, which says who
has it at each step): the restored process maps each
range from its map file while the serve writes the file piece by piece, every chunk verified
first; once the restore is done, the writer adds the rest (the fill files, ``files/``) and seals
it (:meth:`NodeCache.write` with ``premade``), reading from the store only what is not mapped.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from runtime import layout, libc, strict_json
from runtime.digests import WORKERS, piece_ranges
from runtime.errors import Reason, RekindleError
from runtime.fs.fdfs import remove_tree, safe_parts
from runtime.layout import DIGEST_BYTES, SUM_CHUNK, BulkFile
from runtime.pages import bulk, chunks, uffd
from runtime.pages.entry import EntryBuild, Share, State
from runtime.pages.mapping import MapMode, Span
from runtime.proc.owner import read_owner, write_owner_at
from runtime.store import Artifact
from runtime.testpause import pause_for_test

log = logging.getLogger(__name__)

VERSION = "v1"
ENTRY = "entry.json"
FILES = "files"
TMP, EVICT = ".tmp-", ".evict-"
MAX_ENTRY_JSON = 1 << 20
TMPFS_MAGIC = 0x01021994
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_ENTRIES = 8
MIN_FREE = 0.10  # an entry is written only if this share of the node's memory (tmpfs) or disk stays free
CGROUP_SPARE = 2 << 30  # and this much of the plugin's memory limit (CRIU, the fill's buffers)


# A task holding either may open /proc/<pid>/map_files/<range> for writing: through its own
# MAP_SHARED mapping of an entry's file it would change what every later restore maps unhashed.
WRITES_MAPPED_FILES = frozenset({"CAP_SYS_ADMIN", "CAP_CHECKPOINT_RESTORE"})


def refused_for(capabilities: Sequence[str]) -> str | None:
    """Why a target with ``capabilities`` (its OCI spec's, every set) neither makes nor maps an
    entry, or None."""
    held = sorted(WRITES_MAPPED_FILES.intersection(capabilities))
    if not held:
        return None
    return (f"the target holds {', '.join(held)}, with which it could write a mapped entry through "
            "/proc/<pid>/map_files: restored without the node cache")


class CacheError(RekindleError):
    reason_class = Reason.STORE


def fill_name(pid: int) -> str:
    return f"fill-{pid}.bin"


@dataclass(frozen=True)
class Sealed:
    size: int
    ino: int
    ctime_ns: int


@dataclass(frozen=True)
class Record:
    """``entry.json``."""

    key: str
    label: str
    version: str
    manifest_id: str
    mode: str
    bytes: int
    spans: tuple[tuple[int, int, int, int], ...]  # (pid, vaddr, length, offset in its bulk file)
    files: dict[str, Sealed]
    created: float

    def span_list(self) -> list[Span]:
        return [Span(*s) for s in self.spans]


@dataclass(frozen=True)
class EntryInfo:
    key: str
    label: str
    version: str
    mode: str
    bytes: int
    last_used: float
    in_use: bool


def entry_key(manifest_id: str, mode: MapMode) -> str:
    return hashlib.sha256(f"rekindle-cache-v1\0{manifest_id}\0{mode.value}".encode()).hexdigest()[:32]


def range_chunks(f: BulkFile) -> list[tuple[int, int]]:
    """``(offset, end)`` of each run of whole SUM_CHUNKs of ``f`` that holds a byte of its
    ranges, by offset: all an entry copies of it (the rest is what CRIU keeps: punched out of
    the bulk file, or in an older artifact's, read by no restore)."""
    out: list[tuple[int, int]] = []
    for off, length in sorted((r.offset, r.length) for r in f.ranges if r.length):
        lo, hi = off // SUM_CHUNK * SUM_CHUNK, -(-(off + length) // SUM_CHUNK) * SUM_CHUNK
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def entry_bytes(artifact: Artifact, files: Sequence[BulkFile], spans: Sequence[Span] = (),
                sums: Mapping[str, bytes] | None = None) -> int:
    """What an entry of ``artifact`` with bulk ``files`` (``spans`` of them mapped) takes, at
    most (the bound's measure): the chunks of each fill file that hold a range (but the zero
    chunks its ``sums`` name: the copy leaves those holes), once more the part of each mapped
    span in a chunk it does not fill whole (written to both files), the other files."""
    others = sum(f.size for f in artifact.manifest.files if not layout.is_bulk_pages(f.path))
    fills = sum(_held_bytes(f, artifact.entry(f.path).size, (sums or {}).get(f.path)) for f in files)
    twice = sum(min(s.length, -s.offset % SUM_CHUNK + (s.offset + s.length) % SUM_CHUNK) for s in spans)
    return fills + twice + others


def _held_bytes(f: BulkFile, size: int, sums: bytes | None) -> int:
    """Bytes of ``f``'s chunks that hold a range and, by ``sums`` (its chunk digests), data."""
    total = 0
    for lo, hi in range_chunks(f):
        for off in range(lo, min(hi, size), SUM_CHUNK):
            length = min(SUM_CHUNK, size - off)
            i = off // SUM_CHUNK * DIGEST_BYTES
            if sums is None or not chunks.is_zero(sums[i:i + DIGEST_BYTES], length):
                total += length
    return total


def stored_sums(artifact: Artifact, files: Sequence[BulkFile]) -> dict[str, bytes]:
    """Each bulk file's chunk digests, checked (:func:`bulk.read_sums`); {} where one cannot be
    read: the bound then counts every chunk, and the copy refuses what does not verify."""
    try:
        return {f.path: bulk.read_sums(artifact, f) for f in files}
    except (OSError, RekindleError) as exc:
        log.info("%s: chunk digests not read for the cache's bound: %s", artifact.label, exc)
        return {}


def _seal(fd: int) -> Sealed:
    # Read-only, and its identity recorded: any change made through the file system (a write
    # needs the mode changed back, which changes the ctime) makes the entry unusable. Not
    # immutable: root can clear that flag as easily, and a cache dir a crash left behind
    # (or a test's) must stay removable by root's ``rm -rf``.
    os.fchmod(fd, 0o444)
    st = os.fstat(fd)
    return Sealed(st.st_size, st.st_ino, st.st_ctime_ns)


def cgroup_memory() -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup, None without a limit. A tmpfs's pages are
    charged to the cgroup of who wrote them: past its limit the writer is killed."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base = "/sys/fs/cgroup" + path
            names = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base = "/sys/fs/cgroup/memory" + path
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        # In a container the path /proc names is the host's; its own cgroup is mounted as the root.
        for root in (base, "/sys/fs/cgroup/memory" if controllers else "/sys/fs/cgroup"):
            try:
                with open(os.path.join(root, names[0])) as f:
                    text = f.read().strip()
                with open(os.path.join(root, names[1])) as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if text == "max" or int(text) >= 1 << 60:
                return None
            return int(text), usage
    return None


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            out[name] = int(rest.split()[0]) * 1024
    return out


class Held:
    """An entry open for one restore: a shared lock on its directory until :meth:`close`."""

    def __init__(self, record: Record, dir_fd: int) -> None:
        self.record = record
        self.dir_fd = dir_fd
        self._fds: dict[str, int] = {}

    def fd(self, name: str) -> int:
        """A read-only fd of bulk file ``name``, checked against its sealed identity."""
        if name in self._fds:
            return self._fds[name]
        want = self.record.files.get(name)
        if want is None:
            raise CacheError(f"cache entry {self.record.key}: no file {name}")
        fd = os.open(name, FILE_FLAGS, dir_fd=self.dir_fd)
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o7777 != 0o444
                or (st.st_size, st.st_ino, st.st_ctime_ns) != (want.size, want.ino, want.ctime_ns)):
            os.close(fd)
            raise CacheError(f"cache entry {self.record.key}: {name} changed since it was sealed")
        self._fds[name] = fd
        return fd

    def stat(self, name: str) -> os.stat_result:
        return os.fstat(self.fd(name))

    def open_copy(self, path: str) -> int:
        """A read-only fd of the cached copy of the artifact's file ``path`` (the caller
        verifies it against the manifest, as it would the store's)."""
        parts = safe_parts(path)
        if parts is None:
            raise CacheError(f"unsafe path {path!r}")
        cur, opened = os.open(FILES, DIR_FLAGS, dir_fd=self.dir_fd), []
        try:
            opened.append(cur)
            for part in parts[:-1]:
                cur = os.open(part, DIR_FLAGS, dir_fd=cur)
                opened.append(cur)
            return os.open(parts[-1], FILE_FLAGS, dir_fd=cur)
        finally:
            for d in opened:
                os.close(d)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self.dir_fd >= 0:
            os.close(self.dir_fd)  # the lock goes with it
            self.dir_fd = -1


@dataclass
class NodeCache:
    root: str
    max_bytes: int
    max_entries: int = MAX_ENTRIES
    min_free: float = MIN_FREE
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # room and eviction
    # Entries being written by this process, and the bytes they will take: each key once.
    _writing: dict[str, int] = field(default_factory=dict, repr=False)
    _building: dict[str, EntryBuild] = field(default_factory=dict, repr=False)  # made by streamed restores
    # Why the last write of an entry was not begun (the key's guard that said no), for its pre-warm.
    refused: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.dir = os.path.join(self.root, VERSION)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def prepare(self) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)

    def _open_root(self) -> int:
        return os.open(self.dir, DIR_FLAGS)

    # --- reading ---------------------------------------------------------------------------

    def _record(self, dir_fd: int, key: str) -> Record:
        fd = os.open(ENTRY, FILE_FLAGS, dir_fd=dir_fd)
        try:
            data = os.read(fd, MAX_ENTRY_JSON + 1)
        finally:
            os.close(fd)
        rec: Record = strict_json.from_obj(Record, strict_json.loads(data, max_bytes=MAX_ENTRY_JSON), ENTRY)
        if rec.key != key:
            raise CacheError(f"cache entry {key} says it is {rec.key}")
        return rec

    def hold(self, artifact: Artifact, mode: MapMode) -> Held | None:
        """The complete, unchanged entry of ``artifact``'s version, locked shared; None if
        there is none (a bad one is dropped)."""
        if not self.enabled:
            return None
        key = entry_key(artifact.manifest_id, mode)
        try:
            root = self._open_root()
        except OSError:
            return None
        try:
            try:
                dir_fd = os.open(key, DIR_FLAGS, dir_fd=root)
            except FileNotFoundError:
                return None
            fcntl.flock(dir_fd, fcntl.LOCK_SH)
            held = None
            try:
                if not os.path.samestat(os.fstat(dir_fd), os.stat(key, dir_fd=root, follow_symlinks=False)):
                    raise FileNotFoundError(key)  # evicted while we locked it
                rec = self._record(dir_fd, key)
                if rec.manifest_id != artifact.manifest_id or rec.version != artifact.version:
                    raise CacheError(f"cache entry {key} was made from another version")
                held = Held(rec, dir_fd)
                for name in rec.files:
                    held.fd(name)
                with contextlib.suppress(OSError):
                    os.utime(key, dir_fd=root, follow_symlinks=False)  # its last use, for the LRU
                return held
            except FileNotFoundError:
                os.close(dir_fd)
                return None
            except (OSError, ValueError, TypeError, KeyError, CacheError) as exc:
                if held is not None:
                    held.close()
                else:
                    os.close(dir_fd)
                log.warning("%s: node cache entry %s dropped: %s", artifact.label, key, exc)
                self._drop(root, key)
                return None
        finally:
            os.close(root)

    def has(self, manifest_id: str, mode: MapMode) -> bool:
        return self.enabled and os.path.exists(os.path.join(self.dir, entry_key(manifest_id, mode), ENTRY))

    # --- bounds and removal -----------------------------------------------------------------

    def forget(self, key: str) -> bool:
        """Remove entry ``key``, one this plugin would not use (it maps other ranges than a
        restore of its version would: made by another version of the plugin), so that the writer
        may make it again; False where a restore holds it or it is gone."""
        try:
            root = self._open_root()
        except OSError:
            return False
        try:
            return self._drop(root, key, wait=False)
        finally:
            os.close(root)

    def _drop(self, root: int, name: str, *, wait: bool = True) -> bool:
        """Remove entry ``name`` unless a restore holds it (``wait``: a bad entry is renamed
        away at once, holders keep their fds)."""
        try:
            dir_fd = os.open(name, DIR_FLAGS, dir_fd=root)
        except OSError:
            return False
        try:
            if not wait:
                try:
                    fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
            gone = f"{EVICT}{name}-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(name, gone, src_dir_fd=root, dst_dir_fd=root)
        except OSError:
            return False
        finally:
            os.close(dir_fd)
        self._remove(root, gone)
        return True

    def _remove(self, root: int, name: str) -> None:
        try:
            remove_tree(root, name)
        except OSError as exc:
            log.warning("node cache: %s not removed: %s", name, exc)

    def entries(self) -> list[EntryInfo]:
        out = []
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        for name in names:
            if name.startswith("."):
                continue
            try:
                dir_fd = os.open(os.path.join(self.dir, name), DIR_FLAGS)
            except OSError:
                continue
            try:
                rec = self._record(dir_fd, name)
                try:
                    fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    in_use = False
                except BlockingIOError:
                    in_use = True
                out.append(EntryInfo(name, rec.label, rec.version, rec.mode, rec.bytes,
                                     os.fstat(dir_fd).st_mtime, in_use))
            except (OSError, ValueError, TypeError, KeyError, CacheError):
                continue
            finally:
                os.close(dir_fd)
        return sorted(out, key=lambda e: -e.last_used)

    def used_bytes(self) -> int:
        return sum(e.bytes for e in self.entries())

    def has_room(self, need: int) -> bool:
        """Whether an entry of ``need`` bytes fits now without evicting another (a pre-warm's
        second try at a version the cache let go)."""
        entries = self.entries()
        with self._lock:
            writing = sum(self._writing.values())
        return (sum(e.bytes for e in entries) + writing + need <= self.max_bytes
                and len(entries) < self.max_entries and self._fits(need) is None)

    def _make_room(self, root: int, need: int, label: str = "") -> bool:
        entries = self.entries()
        total = sum(e.bytes for e in entries) + sum(self._writing.values())
        # Another version of the artifact written now is superseded by it: it goes first, then the
        # least recently used.
        for e in sorted(entries, key=lambda e: (e.label != label, e.last_used)):
            if total + need <= self.max_bytes and len(entries) < self.max_entries:
                break
            if self._drop(root, e.key, wait=False):
                log.info("node cache: evicted %s (%s, %.1f MiB)", e.key, e.label, e.bytes / 2**20)
                total -= e.bytes
                entries = [x for x in entries if x.key != e.key]
        return total + need <= self.max_bytes and len(entries) < self.max_entries

    def sweep(self) -> int:
        """Remove what a writer left unfinished (its owner provably dead) and evicted entries
        not removed yet; returns how many."""
        swept = 0
        try:
            root = self._open_root()
        except OSError:
            return 0
        try:
            for name in os.listdir(root):
                if name.startswith(EVICT):
                    self._remove(root, name)
                    swept += 1
                elif name.startswith(TMP):
                    try:
                        fd = os.open(name, DIR_FLAGS, dir_fd=root)
                    except OSError:
                        continue
                    try:
                        owner = read_owner(fd)
                    finally:
                        os.close(fd)
                    if owner is None or owner.provably_dead():
                        self._remove(root, name)
                        swept += 1
        finally:
            os.close(root)
        if swept:
            log.info("node cache: swept %d unfinished or evicted entries", swept)
        return swept

    # --- writing ----------------------------------------------------------------------------

    def _reserve(self, root: int, artifact: Artifact, files: Sequence[BulkFile], key: str,
                 spans: Sequence[Span] | None = None, mapped: Sequence[Span] = (),
                 sums: Mapping[str, bytes] | None = None) -> tuple[str, EntryBuild | None] | None:
        """Room for ``artifact``'s entry, and its unfinished directory made (the key reserved for
        this process's one writer of it); None when it exists, is being written, or does not fit.
        With ``spans``: the :class:`EntryBuild` its streamed restores make, registered at once (a
        restore that comes a moment later joins it, once its files are there). ``mapped``: the
        spans the entry maps, where it is made without them."""
        with self._lock:
            self.refused.pop(key, None)
            if key in self._writing or os.path.exists(os.path.join(self.dir, key, ENTRY)):
                self.refused[key] = "being written, or written already"
                return None
            need = entry_bytes(artifact, files, mapped if spans is None else spans, sums)
            why = self._fits(need)
            if why is not None:
                self.refused[key] = why
                return None
            if not self._make_room(root, need, artifact.label):
                why = (f"{need / 2**20:.1f} MiB past the cache's bounds ({self.max_bytes} bytes, "
                       f"{self.max_entries} entries; entries in use are not evicted)")
                log.info("%s: not cached on this node: %s", artifact.label, why)
                self.refused[key] = why
                return None
            tmp = f"{TMP}{key}-{os.getpid()}"
            if os.path.lexists(os.path.join(self.dir, tmp)):
                self._remove(root, tmp)
            os.mkdir(tmp, 0o700, dir_fd=root)
            self._writing[key] = need
            building = None
            if spans is not None:
                building = self._building[key] = EntryBuild(key, tmp, spans, self._abandon)
            return tmp, building

    def streams_into(self) -> str | None:
        """None when a streamed restore can make an entry as it runs (the cache is a tmpfs whose
        private mappings take minor faults), else why not."""
        if not self.enabled:
            return "no node cache"
        try:
            self.prepare()
            if fs_magic(self.dir) != TMPFS_MAGIC:
                return f"the node cache at {self.root} is no tmpfs"
        except OSError as exc:
            return f"the node cache at {self.root}: {exc}"
        return _minor_faults(self.dir)

    def join(self, artifact: Artifact, spans: Sequence[Span], mode: MapMode) -> Share | None:
        """A share of the entry of ``artifact``'s version that other streamed restores of this
        process are making now, mapping the same ``spans``; None when none is."""
        with self._lock:
            building = self._building.get(entry_key(artifact.manifest_id, mode))
        if building is None or building.spans != tuple(spans):
            return None
        share = building.join()
        if share is not None:
            log.info("%s: joining node cache entry %s, made by another restore as it runs", artifact.label,
                     building.key)
        return share

    def begin(self, artifact: Artifact, files: Sequence[BulkFile], spans: Sequence[Span],
              mode: MapMode) -> Share | None:
        """The entry of ``artifact``'s version, started for a streamed restore that maps
        ``spans`` from it as it writes them (its first share); None when it exists, is being
        written, does not fit, or the cache cannot take minor faults (:meth:`streams_into`)."""
        if not spans:
            return None
        why = self.streams_into()
        if why is not None:
            log.info("%s: the streamed restore does not make the cache entry as it runs: %s", artifact.label, why)
            return None
        key = entry_key(artifact.manifest_id, mode)
        root = self._open_root()
        try:
            got = self._reserve(root, artifact, files, key, spans, sums=stored_sums(artifact, files))
            if got is None:
                return None
            tmp, made = got
            if made is None:
                return None
            building = made
            try:
                dir_fd = os.open(tmp, DIR_FLAGS, dir_fd=root)
                try:
                    write_owner_at(dir_fd)
                    for sp in spans:
                        fd = os.open(sp.name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
                        try:
                            os.ftruncate(fd, sp.file_size)
                            ro = os.open(sp.name, FILE_FLAGS, dir_fd=dir_fd)
                        except BaseException:
                            os.close(fd)
                            raise
                        building.add_file(sp.name, fd, ro)
                finally:
                    os.close(dir_fd)
            except BaseException:
                building.abandon()
                raise
            log.info("%s: making node cache entry %s as it restores (%d range(s) mapped)", artifact.label, key,
                     len(spans))
            return building.open()
        finally:
            os.close(root)

    def _abandon(self, building: EntryBuild) -> None:
        # its ``discard``: what it left on disk removed, its key free again
        try:
            root = self._open_root()
        except OSError:
            root = -1
        try:
            if root >= 0:
                self._remove(root, building.tmp)
        finally:
            if root >= 0:
                os.close(root)
            self._unreserve(building.key)

    def _unreserve(self, key: str) -> None:
        with self._lock:
            self._writing.pop(key, None)
            self._building.pop(key, None)

    def write(self, artifact: Artifact, files: Sequence[BulkFile], spans: Sequence[Span], mode: MapMode,
              threads: int = WORKERS, premade: EntryBuild | None = None,
              pace: Callable[[int], None] | None = None) -> Record | None:
        """Write ``artifact``'s entry (its bulk ``files``, ``spans`` of them mapped later) unless
        it exists or does not fit; None when not written. Every byte is verified first.
        ``premade``: the entry a streamed restore began and wrote the map files of (no byte of
        a mapped range is read again), claimed by the writer: sealed here, or abandoned. ``pace(n)`` is called before
        each chunk of ``n`` bulk bytes is read (a pre-warm counts them, and waits there while a
        restore runs)."""
        if not self.enabled:
            if premade is not None:
                premade.abandon()
            return None
        key = entry_key(artifact.manifest_id, mode)
        self.prepare()
        root = self._open_root()
        try:
            if premade is not None:
                if (premade.key != key or premade.spans != tuple(spans) or premade.state is not State.WRITING
                        or not premade.book.whole()):
                    premade.abandon()
                    raise CacheError(f"{artifact.label}: the entry begun by its restore is not this one, or not whole")
                tmp = premade.tmp
            else:
                got = self._reserve(root, artifact, files, key, mapped=spans, sums=stored_sums(artifact, files))
                if got is None:
                    return None
                tmp = got[0]
            try:
                rec = self._write_into(root, tmp, key, artifact, files, spans, mode, threads, premade, pace)
                os.rename(tmp, key, src_dir_fd=root, dst_dir_fd=root)
            except BaseException:
                if premade is not None:
                    premade.abandon()  # removes it
                else:
                    self._remove(root, tmp)
                raise
            else:
                if premade is not None:
                    premade.seal()
            finally:
                self._unreserve(key)
            log.info("%s: cached on this node as %s: %.1f MiB, %d range(s) to map%s", artifact.label, key,
                     rec.bytes / 2**20, len(spans), " (written by its restore)" if premade is not None else "")
            return rec
        finally:
            os.close(root)

    def _fits(self, need: int) -> str | None:
        """None when ``need`` bytes more leave the memory (tmpfs) or disk guard's share free, else why not."""
        why = None
        try:
            if fs_magic(self.dir) == TMPFS_MAGIC:
                cg = cgroup_memory()
                mem = meminfo()
                if cg is not None and cg[1] + need > cg[0] - CGROUP_SPARE:
                    why = (f"{need / 2**20:.1f} MiB would not fit under this plugin's memory limit "
                           f"({cg[1] / 2**20:.1f} of {cg[0] / 2**20:.1f} MiB used)")
                elif mem.get("MemAvailable", 0) - need < self.min_free * mem.get("MemTotal", 0):
                    why = (f"{need / 2**20:.1f} MiB would leave too little memory free "
                           f"({mem.get('MemAvailable', 0) / 2**20:.1f} MiB available)")
            else:
                st = os.statvfs(self.dir)
                # df's view: what is used plus what this user may still take (f_blocks also
                # counts blocks reserved away from us, which on some hosts are most of the disk)
                avail = st.f_bavail * st.f_frsize
                usable = (st.f_blocks - st.f_bfree) * st.f_frsize + avail
                if avail - need < self.min_free * usable:
                    why = (f"{need / 2**20:.1f} MiB would leave less than {round(self.min_free * 100)}% of "
                           f"{self.dir} free ({avail / 2**20:.1f} of {usable / 2**20:.1f} MiB available)")
        except OSError as exc:
            why = f"the cache's file system: {exc}"
        if why is not None:
            log.info("node cache: %s", why)
        return why

    def _write_into(self, root: int, tmp: str, key: str, artifact: Artifact, files: Sequence[BulkFile],
                    spans: Sequence[Span], mode: MapMode, threads: int, premade: EntryBuild | None = None,
                    pace: Callable[[int], None] | None = None) -> Record:
        dir_fd = os.open(tmp, DIR_FLAGS, dir_fd=root)
        opened: list[int] = []
        try:
            if premade is None:
                write_owner_at(dir_fd)
            artifact.materialize(os.path.join(self.dir, tmp, FILES), skip=layout.is_bulk_pages)
            jobs: list[_Job] = []
            outs: dict[str, int] = {}
            for f in files:
                size = artifact.entry(f.path).size
                sums = bulk.read_sums(artifact, f)
                src = artifact.open_file(f.path)
                opened.append(src)
                if os.fstat(src).st_size != size:
                    raise CacheError(f"{artifact.label}: {f.path} is not the size the manifest says")
                mine = [s for s in spans if s.pid == f.pid]
                fill = os.open(fill_name(f.pid), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600,
                               dir_fd=dir_fd)
                opened.append(fill)
                os.ftruncate(fill, size)
                outs[fill_name(f.pid)] = fill
                maps = []
                for s in mine:
                    if premade is not None:  # written by the restore's serve: checked whole, not read again
                        m = os.open(s.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                        opened.append(m)
                        _check_premade(m, s)
                        outs[s.name] = m
                        maps.append((s.offset, s.offset + s.length, -1, s.file_offset))
                        continue
                    m = os.open(s.name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
                    opened.append(m)
                    os.ftruncate(m, s.file_size)
                    outs[s.name] = m
                    maps.append((s.offset, s.offset + s.length, m, s.file_offset))
                held = range_chunks(f)
                for off, length in piece_ranges(size):
                    if length:
                        jobs.append(_Job(src, sums, off, length, fill, sorted(maps), f.path, held, size, pace))
            with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="rekindle-cache") as pool:
                list(pool.map(_copy_piece, jobs))
            pause_for_test("cache-write")  # bulk bytes written, no entry.json yet
            sealed = {name: _seal(fd) for name, fd in outs.items()}
            used = sum(os.fstat(fd).st_blocks * 512 for fd in outs.values())
            used += sum(f.size for f in artifact.manifest.files if not layout.is_bulk_pages(f.path))
            rec = Record(key=key, label=artifact.label, version=artifact.version, manifest_id=artifact.manifest_id,
                         mode=mode.value, bytes=used,
                         spans=tuple((s.pid, s.vaddr, s.length, s.offset) for s in spans),
                         files=sealed, created=time.time())
            obj = strict_json.to_obj(rec)
            fd = os.open(ENTRY, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444, dir_fd=dir_fd)
            try:
                os.write(fd, strict_json.canonical_json(obj))
            finally:
                os.close(fd)
            return rec
        finally:
            for fd in opened:
                os.close(fd)
            os.close(dir_fd)


@functools.cache
def _minor_faults(directory: str) -> str | None:
    # asked once per directory: the kernel does not change under a running agent
    return uffd.probe_minor(directory)


def fs_magic(path: str) -> int:
    """The file system type of ``path`` (statfs's f_type)."""
    buf = ctypes.create_string_buffer(128)  # struct statfs: 120 bytes on 64-bit Linux
    libc.call("statfs", os.fsencode(path), buf, what="statfs")
    return int(struct.unpack_from("l", buf.raw, 0)[0])


@dataclass(frozen=True)
class _Job:
    src: int
    sums: bytes
    offset: int
    length: int
    fill: int
    maps: list[tuple[int, int, int, int]]  # (lo, hi, fd, file offset of lo); fd -1: written already
    path: str
    chunks: list[tuple[int, int]]  # the file's chunks that hold a range (range_chunks)
    size: int  # of the file, as its manifest says
    pace: Callable[[int], None] | None = None


def _check_premade(fd: int, span: Span) -> None:
    """A map file the restore's serve wrote: its size, and no hole in its range. The serve
    writes whole 2 MiB pieces of it, each only once verified; a piece it never wrote (the
    process died mid-serve) is a hole, and the entry is then not made."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size != span.file_size:
        raise CacheError(f"{span.name}: not the file its restore wrote")
    hole = os.lseek(fd, span.file_offset, os.SEEK_HOLE)
    if hole < span.file_size:
        raise CacheError(f"{span.name}: its restore did not write it all (a hole at {hole})")


def _copy_piece(job: _Job) -> None:
    pos, end = job.offset, job.offset + job.length
    while pos < end:
        want = min(SUM_CHUNK, end - pos)
        hi = pos + want
        i = bisect.bisect_right(job.chunks, (pos, 1 << 65)) - 1
        if i < 0 or job.chunks[i][1] <= pos:
            pos = hi  # holds no range (kept with CRIU): nothing to read, a hole in the fill file
            continue
        if any(lo <= pos and hi <= top and fd < 0 for lo, top, fd, _at in job.maps):
            pos = hi  # wholly in a range its restore wrote: nothing to read, a hole in the fill file
            continue
        if job.pace is not None:
            job.pace(want)
        data = bytearray(want)
        try:  # the one verified read (runtime.pages.chunks); a bad source is the store's fault here
            spent = chunks.read(job.src, pos, want, memoryview(data), job.sums, size=job.size, name=job.path)
        except chunks.IntegrityError as e:
            raise CacheError(str(e)) from e
        k = pos // SUM_CHUNK * DIGEST_BYTES
        if spent.zero == want or chunks.is_zero(job.sums[k:k + DIGEST_BYTES], want):
            pass  # a zero chunk (verified, or a hole in the source): a hole in the fill file, as the bound counts it
        elif not any(lo <= pos and hi <= top for lo, top, _fd, _at in job.maps):  # all but what is mapped
            os.pwrite(job.fill, data, pos)
        for lo, top, fd, at in job.maps:
            a, b = max(lo, pos), min(top, hi)
            if a < b and fd >= 0:
                os.pwrite(fd, memoryview(data)[a - pos:b - pos], at + (a - lo))
        pos = hi
