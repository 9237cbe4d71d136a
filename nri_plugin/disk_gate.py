"""The node's disk, restores first: a gate that restores (and their prefetches) hold while they
read, and that a pre-warm waits at before each chunk (``nri_plugin.prewarm``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class DiskGate:
    """Restores running on this node; a warm-up waits while there is one."""

    def __init__(self) -> None:
        self._running = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def restore(self) -> Iterator[None]:
        with self._cond:
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def busy(self) -> bool:
        with self._cond:
            return self._running > 0

    def wait_idle(self, stop: threading.Event, poll: float = 0.5) -> None:
        with self._cond:
            while self._running > 0 and not stop.is_set():
                self._cond.wait(poll)
