"""Prefetch scheduling: a pod annotated to restore gets its artifact staged and read ahead, bounded.

``Prefetcher.start(pod)`` is called from RunPodSandbox (it only queues: a handler never waits on
the store); at most ``max_running`` prefetches run at once, in the prefetcher's own pool. Each
first stages the artifact (its small files copied into a private node-local directory while
hashed, exactly what the restore's ``stage`` phase does), then reads the bulk pages into the page
cache on ``threads`` threads. The restore, once its container starts, ``take``s the staged copy
if it is of the very version it opened (name and manifest bytes), and so skips that phase.
``cancel(pod_uid)`` (StopPodSandbox/RemovePodSandbox) stops a prefetch early and removes what
was staged and not taken. Copies waiting to be taken are bounded per node and per namespace
(count and bytes): past either, a pod's restore stages for itself. Errors are logged and forgotten: a prefetch is an optimisation.
A prefetch is a restore's reads done early: while it reads it holds ``reading`` (the node's
:class:`~nri_plugin.disk_gate.DiskGate`), so a pre-warm waits for it as for a restore.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from runtime import layout, names
from runtime.errors import RekindleError
from runtime.fs.fdfs import remove_tree_path
from runtime.housekeeping import STAGED_PREFIX  # swept like a restore's copies once its owner is dead
from runtime.proc.owner import write_owner
from runtime.store import Artifact, ArtifactStore, readahead

log = logging.getLogger(__name__)

RESTORE = "rekindle.dev/restore"
TAKE_WAIT = 300.0  # a staging under way is waited for: the restore would repeat the same reads
# Staged copies wait on the node's disk until their container starts; pods that never start
# (an image that never pulls) must not fill it: past these, a restore stages for itself. Per
# namespace too: one tenant's pods that never start must not take every copy the node allows.
MAX_STAGED = 4
MAX_STAGED_BYTES = 4 << 30
MAX_STAGED_PER_NAMESPACE = 2
MAX_STAGED_BYTES_PER_NAMESPACE = 2 << 30
BEGIN_WAIT = 2.0  # a prefetch queued on an idle pool is about to begin: worth waiting for


@dataclass
class _Staged:
    version: str
    manifest_id: str
    work: str  # its ``private`` subdirectory holds the verified copies
    bytes: int = 0


@dataclass
class _Pod:
    namespace: str
    cancel: threading.Event = field(default_factory=threading.Event)
    running: bool = True
    claimed: bool = False  # the restore came: a staging not begun yet is not begun
    staging: bool = False  # a copy is being staged, or waits to be taken
    staged_bytes: int = 0
    began: threading.Event = field(default_factory=threading.Event)  # staging began, or never will
    staged_ready: threading.Event = field(default_factory=threading.Event)
    staged: _Staged | None = None


def _remove(work: str) -> None:
    """Remove a staged copy's work dir (errors logged: the sweep takes it once its owner is dead)."""
    try:
        remove_tree_path(work)
    except (OSError, RekindleError) as exc:
        log.warning("cannot remove the staged copy %s: %s", work, exc)


def _over(held: list[_Pod], size: int, max_count: int, max_bytes: int) -> bool:
    """Whether one more copy of ``size`` bytes beside ``held`` passes either bound."""
    return len(held) >= max_count or sum(p.staged_bytes for p in held) + size > max_bytes


class Prefetcher:
    def __init__(self, store: ArtifactStore, key: bytes, *, max_running: int = 2, threads: int = readahead.THREADS,
                 staging_dir: str | None = None, max_staged: int = MAX_STAGED,
                 max_staged_bytes: int = MAX_STAGED_BYTES,
                 max_staged_per_namespace: int = MAX_STAGED_PER_NAMESPACE,
                 max_staged_bytes_per_namespace: int = MAX_STAGED_BYTES_PER_NAMESPACE,
                 cached: Callable[[Artifact], bool] | None = None,
                 reading: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext) -> None:
        self.store, self.key, self.threads = store, key, threads
        self.reading = reading  # held while a prefetch reads: a restore's reads, which a pre-warm yields to
        self.cached = cached  # whether the node cache holds that version whole, as its restore maps it
        self.staging_dir = staging_dir  # None: read ahead only, no staging
        self.max_running = max_running
        self.max_staged, self.max_staged_bytes = max_staged, max_staged_bytes
        self.max_staged_per_namespace = max_staged_per_namespace
        self.max_staged_bytes_per_namespace = max_staged_bytes_per_namespace
        self._active = 0  # prefetches begun and not ended
        self._pool = ThreadPoolExecutor(max_workers=max_running, thread_name_prefix="rekindle-prefetcher")
        self._pods: dict[str, _Pod] = {}
        self._lock = threading.Lock()

    def start(self, pod_uid: str, namespace: str, annotations: dict[str, str]) -> bool:
        name = annotations.get(RESTORE, "")
        if not (name and names.is_artifact_name(name) and names.is_dns_label(namespace)):
            return False
        with self._lock:
            if pod_uid in self._pods:
                return False
            pod = self._pods[pod_uid] = _Pod(namespace)
        self._pool.submit(self._run, pod_uid, pod, namespace, name)
        return True

    def cancel(self, pod_uid: str) -> None:
        """The pod goes: stop reading, and remove a staged copy nobody took (on the pool: this
        runs in NRI handlers)."""
        with self._lock:
            pod = self._pods.pop(pod_uid, None)
            if pod is None:
                return
            pod.cancel.set()
            pod.claimed = True
            staged, pod.staged = pod.staged, None
        if staged is not None:
            try:
                self._pool.submit(_remove, staged.work)
            except RuntimeError:  # shut down: the sweep at the next start removes it (owner dead)
                pass

    def take(self, pod_uid: str, artifact: Artifact, wait: float = TAKE_WAIT) -> str | None:
        """The work dir of this pod's staged copy of exactly ``artifact``'s version (the caller
        owns it from now on: its ``private`` holds the verified copies), or None: restage."""
        with self._lock:
            pod = self._pods.get(pod_uid)
            if pod is None:
                return None
            idle = self._active < self.max_running
        if idle:  # its prefetch is about to begin (not queued behind other pods')
            pod.began.wait(BEGIN_WAIT)
        with self._lock:
            pod.claimed = True
            if not pod.staging:
                return None  # still queued, or not staging: the restore stages itself
            ready = pod.staged_ready
        if not ready.wait(wait):
            log.warning("%s: staged copy not ready after %.0fs; staging again", artifact.label, wait)
            return None
        with self._lock:
            staged, pod.staged = pod.staged, None
            pod.staging, pod.staged_bytes = False, 0  # no longer counts against the bounds
        if staged is None:
            return None
        if not artifact.manifest_id or (staged.version, staged.manifest_id) != (artifact.version, artifact.manifest_id):
            log.info("%s: the staged copy is of another version (%s); staging again", artifact.label, staged.version)
            _remove(staged.work)
            return None
        return staged.work

    def _stage(self, pod: _Pod, artifact: Artifact) -> None:
        if self.staging_dir is None:
            pod.began.set()
            return
        skipped = layout.staged_skip({f.path for f in artifact.manifest.files})
        size = sum(f.size for f in artifact.manifest.files if not skipped(f.path))
        with self._lock:
            held = [p for p in self._pods.values() if p.staging and p is not pod]
            own = [p for p in held if p.namespace == pod.namespace]
            full = _over(held, size, self.max_staged, self.max_staged_bytes)
            full_ns = _over(own, size, self.max_staged_per_namespace, self.max_staged_bytes_per_namespace)
            skip = pod.claimed or pod.cancel.is_set() or full or full_ns
            pod.staging = not skip
            pod.staged_bytes = 0 if skip else size
        pod.began.set()
        if (full or full_ns) and not pod.claimed:
            where, those = ("on the node", held) if full else (f"for namespace {pod.namespace}", own)
            log.info("%s: not staged ahead (%d copies, %d bytes wait %s already)", artifact.label,
                     len(those), sum(p.staged_bytes for p in those), where)
        if skip:
            return
        staged = None
        try:
            os.makedirs(self.staging_dir, exist_ok=True)
            work = tempfile.mkdtemp(prefix=f"{STAGED_PREFIX}{artifact.manifest.namespace}-{artifact.manifest.name}-",
                                    dir=self.staging_dir)
            write_owner(work)  # removed by the sweep if this process dies with it
            try:
                artifact.materialize(os.path.join(work, "private"), skip=skipped)
                staged = _Staged(artifact.version, artifact.manifest_id, work)
            except BaseException:
                _remove(work)
                raise
        finally:
            with self._lock:
                gone = pod.cancel.is_set()  # the pod went meanwhile: nobody will take it
                pod.staged = None if gone else staged
                if pod.staged is None:
                    pod.staging, pod.staged_bytes = False, 0  # failed, or gone: holds nothing
                pod.staged_ready.set()
        if staged is not None and gone:
            _remove(staged.work)
        elif staged is not None:
            log.info("staged %s for its restore", artifact.label)

    def _run(self, pod_uid: str, pod: _Pod, namespace: str, name: str) -> None:
        with self._lock:
            self._active += 1
        try:
            if pod.cancel.is_set():
                return
            with self.store.open(namespace, name, self.key) as artifact:
                if self.cached is not None and self.cached(artifact):
                    log.info("%s/%s: in the node cache, nothing to prefetch", namespace, name)
                    return
                with self.reading():
                    try:
                        self._stage(pod, artifact)
                    except (OSError, RekindleError) as exc:
                        log.info("staging %s/%s ahead skipped: %s", namespace, name, exc)
                    readahead.warm(artifact, pod.cancel, self.threads)
        except RekindleError as exc:
            log.info("prefetch of %s/%s skipped: %s", namespace, name, exc)
        except Exception:  # noqa: BLE001 - an optimisation never takes the plugin down
            log.exception("prefetch of %s/%s failed", namespace, name)
        finally:
            with self._lock:
                self._active -= 1
                pod.running = False
            pod.began.set()  # a take() waiting for a staging that never began
            pod.staged_ready.set()  # or for one that never finished

    def running(self) -> int:
        """Prefetches queued or under way."""
        with self._lock:
            return sum(p.running for p in self._pods.values())

    def shutdown(self) -> None:
        with self._lock:
            pods = list(self._pods.values())
            self._pods.clear()
        for pod in pods:
            pod.cancel.set()
            pod.began.set()
            pod.staged_ready.set()
            if pod.staged is not None:
                _remove(pod.staged.work)
        self._pool.shutdown(wait=False, cancel_futures=True)
