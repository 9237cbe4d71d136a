"""Readiness and liveness of the plugin process, as the kubelet's probes see them.

Ready: registered with the runtime over NRI and synchronized on the current connection (a
plugin that is up but not connected adjusts nothing: every annotated pod would start cold).
Not ready again as soon as the connection is lost, until the runtime has synchronized anew.

Live: the asyncio event loop still runs: ``beat()`` is called from a task on the loop every
``HEARTBEAT`` seconds; a loop that has not beaten for ``stall_after`` seconds is stuck (a
blocked handler path, a deadlock) and the kubelet should restart the plugin. Not being
connected to the runtime is not a liveness failure: restarting would not bring NRI back.

``Health`` is a stub observer (``connection``, ``handler``); its methods are thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

HEARTBEAT = 1.0
STALL_AFTER = 60.0


class Health:
    def __init__(self, stall_after: float = STALL_AFTER, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._stall_after = stall_after
        self._lock = threading.Lock()
        self._connected = False
        self._synchronized = False
        self._ever_connected = False
        self._last_beat = clock()  # start-up counts as a beat: the loop is about to start

    # ------------------------------------------------------------------ stub observer
    def connection(self, connected: bool, synchronized: bool) -> None:
        with self._lock:
            self._connected = connected
            self._synchronized = connected and synchronized
            self._ever_connected |= connected

    def handler(self, name: str, seconds: float, failure: str | None) -> None:
        pass

    # ------------------------------------------------------------------ liveness
    def beat(self) -> None:
        with self._lock:
            self._last_beat = self._clock()

    def live(self) -> tuple[bool, str]:
        with self._lock:
            quiet = self._clock() - self._last_beat
        if quiet > self._stall_after:
            return False, f"event loop stalled: no heartbeat for {quiet:.0f}s"
        return True, "event loop running"

    # ------------------------------------------------------------------ readiness
    def ready(self) -> tuple[bool, str]:
        with self._lock:
            connected, synchronized, ever = self._connected, self._synchronized, self._ever_connected
        if connected and synchronized:
            return True, "registered with the runtime and synchronized"
        if connected:
            return False, "registered with the runtime, waiting for Synchronize"
        if ever:
            return False, "lost the NRI connection; reconnecting"
        return False, "not registered with the runtime yet (is NRI enabled? see `rekindle doctor`)"
