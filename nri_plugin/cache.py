"""The plugin's node cache: where it lives, how large it may grow, and its one writer.

A restore that found no entry of its version hands over what the entry is written from
(``runtime.restore.CacheWork``); :class:`CacheWriter` writes it later on its own single thread
(one entry at a time, each version once), after opening the version again and checking it is
the very one restored (manifest id). The writer never runs inside a handler or a restore.
With ``--cache-tmpfs`` the plugin mounts a ``huge=always`` tmpfs at the cache's directory in its
own mount namespace (so mapped ranges get 2 MiB pages); it goes away with the plugin's
container, and the pages a restored process maps stay until it unmaps them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from runtime import libc
from runtime.errors import RekindleError
from runtime.pages import nodecache
from runtime.pages.mapping import MapMode
from runtime.restore import CacheWork
from runtime.store import ArtifactStore

from .config import Settings

log = logging.getLogger(__name__)


def cache_bytes(settings: Settings) -> int:
    """The byte bound: ``--cache-bytes``, or when it is -1 (auto) a quarter of the node's
    memory, and with ``--cache-tmpfs`` no more than the plugin's memory limit leaves (the
    tmpfs's pages are charged to it)."""
    if settings.cache.bytes >= 0:
        return settings.cache.bytes
    try:
        auto = nodecache.meminfo().get("MemTotal", 0) // 4
    except OSError:
        return 0
    cg = nodecache.cgroup_memory() if settings.cache.tmpfs else None
    if cg is not None:
        auto = max(0, min(auto, cg[0] - nodecache.CGROUP_SPARE))
    return auto


def cache_dir(settings: Settings) -> str:
    return settings.cache.dir or os.path.join(settings.state_dir, "cache")


def _mount_tmpfs(path: str, size: int) -> bool:
    opts = f"mode=0700,huge=always,size={max(size, 1 << 20)}".encode()
    if libc.function("mount")(b"rekindle-cache", os.fsencode(path), b"tmpfs", 0, opts) != 0:
        log.warning("node cache: no tmpfs mounted at %s (%s); using the directory as it is",
                    path, os.strerror(libc.errno()))
        return False
    log.info("node cache: tmpfs (huge=always, %d MiB) mounted at %s", size >> 20, path)
    return True


def open_cache(settings: Settings) -> nodecache.NodeCache:
    """The node cache as configured (disabled when its bound is 0); swept of what a killed
    writer left."""
    cache = nodecache.NodeCache(cache_dir(settings), cache_bytes(settings), settings.cache.entries)
    if not cache.enabled:
        return cache
    try:
        os.makedirs(cache.root, mode=0o700, exist_ok=True)
        if settings.cache.tmpfs and not os.path.ismount(cache.root):
            _mount_tmpfs(cache.root, cache.max_bytes)
        cache.prepare()
        cache.sweep()
    except OSError as exc:
        log.warning("node cache at %s unusable (%s): off", cache.root, exc)
        return nodecache.NodeCache(cache.root, 0)
    return cache


class CacheWriter:
    def __init__(self, cache: nodecache.NodeCache, store: ArtifactStore, key: bytes) -> None:
        self.cache, self.store, self.key = cache, store, key
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rekindle-cache-writer")
        self._queued: set[str] = set()
        self._lock = threading.Lock()

    def submit(self, work: CacheWork) -> bool:
        """Queue ``work`` unless its entry exists or is queued already. An entry its restore
        began (``work.premade``: the cache holds its key for it alone) is always taken, unless it
        was abandoned already: it is the writer's from its ``EntryBuild.claim`` on."""
        if work.premade is None:
            if not self.cache.enabled or self.cache.has(work.manifest_id, work.mode):
                return False
            with self._lock:
                if work.manifest_id in self._queued:
                    return False
                self._queued.add(work.manifest_id)
        elif not work.premade.claim():
            return False
        try:
            self._pool.submit(self._write, work)
        except RuntimeError:  # shut down
            if work.premade is not None:
                work.premade.abandon()  # the writer's: nobody else removes it
            with self._lock:
                self._queued.discard(work.manifest_id)
            return False
        return True

    def warm(self, manifest_id: str, job: Callable[[], object]) -> bool:
        """Queue a pre-warm's ``job`` (``nri_plugin.prewarm``: it writes the entry of version
        ``manifest_id`` with :meth:`NodeCache.write`) on this one writer, unless that version's
        entry is queued already (by a restore, or an earlier look)."""
        with self._lock:
            if manifest_id in self._queued:
                return False
            self._queued.add(manifest_id)

        def run() -> None:
            try:
                job()
            except Exception:  # noqa: BLE001 - a cache is an optimisation: never the plugin's end
                log.exception("pre-warm of %s failed", manifest_id)
            finally:
                with self._lock:
                    self._queued.discard(manifest_id)
        try:
            self._pool.submit(run)
        except RuntimeError:  # shut down
            with self._lock:
                self._queued.discard(manifest_id)
            return False
        return True

    def _write(self, work: CacheWork) -> None:
        try:
            with self.store.open(work.namespace, work.name, self.key) as artifact:
                if artifact.manifest_id != work.manifest_id:
                    log.info("%s/%s changed since its restore: not cached", work.namespace, work.name)
                    return
                artifact.yield_to_deletes()  # a cache is never why a delete is refused
                self.cache.write(artifact, work.files, work.spans, work.mode, premade=work.premade)
        except (OSError, RekindleError) as exc:
            log.warning("%s/%s: not cached on this node: %s", work.namespace, work.name, exc)
        except Exception:  # noqa: BLE001 - a cache is an optimisation: never the plugin's end
            log.exception("%s/%s: cache write failed", work.namespace, work.name)
        finally:
            if work.premade is not None:
                work.premade.abandon()  # a no-op once written
            else:
                with self._lock:
                    self._queued.discard(work.manifest_id)

    def idle(self, timeout: float) -> bool:
        """Wait until nothing is queued (tests, shutdown)."""
        done = threading.Event()
        self._pool.submit(done.set)
        return done.wait(timeout)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def map_mode(settings: Settings) -> MapMode:
    return MapMode(settings.cache.map_ranges.value)
