"""Phase timings of a checkpoint or restore: an ordered mapping of phase name to seconds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


class Timings(dict[str, float]):
    """``with t.phase("criu_restore"): ...`` records the phase's wall time; ``on_phase`` (if
    set) hears each phase start, for live progress."""

    on_phase: Callable[[str], None] | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.on_phase is not None:
            self.on_phase(name)
        t0 = time.monotonic()
        try:
            yield
        finally:
            self[name] = round(time.monotonic() - t0, 3)
            log.info("phase %s: %.3fs", name, self[name], extra={"phase": name, "seconds": self[name]})
