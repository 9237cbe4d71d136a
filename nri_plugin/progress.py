"""Live progress of a running checkpoint or restore, into the container's status record.

The engine calls ``ProgressRecorder(phase, bytes_done, bytes_total)`` from its threads: at
each phase start with (0, 0), during a bulk phase with byte counts (from several fill threads at
once), and ``("complete", n, n)`` at the end with the artifact's size. The recorder writes the
status record at each phase change and otherwise at most every ``interval`` seconds, with the
rate since the phase started, so ``rekindle status`` can show "fill 3.1 of 17.6 GiB, 1.8 GB/s"
without a status write per 64 MiB piece. It never raises into the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from runtime.status import Progress

log = logging.getLogger(__name__)

INTERVAL = 0.5
COMPLETE = "complete"


class ProgressRecorder:
    def __init__(self, write: Callable[[Progress], None], *, interval: float = INTERVAL,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self._write = write
        self._interval = interval
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._phase = ""
        self._phase_started = 0.0
        self._last_write = 0.0
        self.total_bytes = 0   # the artifact's size, once the engine says "complete"

    def __call__(self, phase: str, done: int, total: int) -> None:
        try:
            self._record(phase, done, total)
        except Exception:  # noqa: BLE001 - progress is a view; it must never fail the work
            log.exception("recording progress failed")

    def _record(self, phase: str, done: int, total: int) -> None:
        now = self._clock()
        with self._lock:
            if phase == COMPLETE:
                self.total_bytes = total
                return
            changed = phase != self._phase
            if changed:
                self._phase, self._phase_started = phase, now
            elif now - self._last_write < self._interval and done < total:
                return
            self._last_write = now
            elapsed = now - self._phase_started
            progress = Progress(phase=phase, bytes_done=done, bytes_total=total,
                                rate=round(done / elapsed, 1) if elapsed > 0 and done else 0.0,
                                phase_started_at=round(self._wall() - elapsed, 3))
            # Written under the lock: fill threads must not reorder their records.
            self._write(progress)
