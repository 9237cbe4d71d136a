"""Prefetch scheduling: a pod annotated to restore gets its artifact read ahead, bounded.

``Prefetcher.start(pod)`` is called from RunPodSandbox (it only queues: a handler never waits on
the store); at most ``max_running`` prefetches read at once, each on ``threads`` threads, in the
prefetcher's own pool. ``cancel(pod_uid)`` (StopPodSandbox/RemovePodSandbox, or the restore
itself starting) stops one early. Errors are logged and forgotten: a prefetch is an optimisation.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from runtime import names, prefetch
from runtime.errors import RekindleError
from runtime.store import ArtifactStore

log = logging.getLogger(__name__)

RESTORE = "rekindle.dev/restore"


class Prefetcher:
    def __init__(self, store: ArtifactStore, key: bytes, *, max_running: int = 2, threads: int = 16) -> None:
        self.store, self.key, self.threads = store, key, threads
        self._pool = ThreadPoolExecutor(max_workers=max_running, thread_name_prefix="rekindle-prefetcher")
        self._cancel: dict[str, threading.Event] = {}
        self._go: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def start(self, pod_uid: str, namespace: str, annotations: dict[str, str]) -> bool:
        name = annotations.get(RESTORE, "")
        if not (name and names.is_artifact_name(name) and names.is_dns_label(namespace)):
            return False
        with self._lock:
            if pod_uid in self._cancel:
                return False
            cancel = self._cancel[pod_uid] = threading.Event()
            go = self._go[pod_uid] = threading.Event()
            go.set()
        self._pool.submit(self._run, pod_uid, namespace, name, cancel, go)
        return True

    def pause(self, pod_uid: str, paused: bool) -> None:
        """Hold the pod's prefetch reads (while its restore runs CRIU) or let them go on."""
        with self._lock:
            go = self._go.get(pod_uid)
        if go is not None:
            (go.clear if paused else go.set)()

    def on_phase(self, pod_uid: str, phase: str) -> None:
        """The restore's phase hook: CRIU's own reads go first."""
        self.pause(pod_uid, phase == "criu_restore")

    def cancel(self, pod_uid: str) -> None:
        with self._lock:
            event = self._cancel.get(pod_uid)
        if event is not None:
            event.set()

    def _run(self, pod_uid: str, namespace: str, name: str, cancel: threading.Event,
             go: threading.Event) -> None:
        try:
            if cancel.is_set():
                return
            with self.store.open(namespace, name, self.key) as artifact:
                prefetch.warm(artifact, cancel, self.threads, go=go)
        except RekindleError as exc:
            log.info("prefetch of %s/%s skipped: %s", namespace, name, exc)
        except Exception:  # noqa: BLE001 - an optimisation never takes the plugin down
            log.exception("prefetch of %s/%s failed", namespace, name)
        finally:
            with self._lock:
                self._cancel.pop(pod_uid, None)
                self._go.pop(pod_uid, None)

    def shutdown(self) -> None:
        with self._lock:
            for event in self._cancel.values():
                event.set()
            for event in self._go.values():
                event.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
