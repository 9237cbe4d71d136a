"""The node's transparent huge page setting, switched to ``always`` around the driver's CUDA
checkpoint (``--checkpoint-thp always``; off by default: the switch is node-wide).

Why: under ``madvise`` the driver's own host copy of device memory gets no huge pages, and no
process can ask for them on the driver's behalf (6.18 has no per-process ``always``). Measured on
the H200, 16.8 GiB: the CUDA checkpoint took 5.0-5.7 s at ``always`` against 7.6-8.9 s at
``madvise``. While the switch lasts (the seconds of the CUDA checkpoint), any process on the
node that faults in anonymous memory may get huge pages too.

Several checkpoints at once share one switch (counted). The value found is recorded in the
plugin's state dir before the switch, so a plugin killed mid-checkpoint puts it back at its next
start (:meth:`ThpSwitch.recover`); a plugin stopped (SIGTERM: an upgrade, an uninstall) puts it
back as it exits (:func:`put_back`), so an uninstall does not leave the node at ``always``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
MODES = ("always", "madvise", "never")


def read_mode(knob: str = ENABLED) -> str:
    """The selected mode: sysfs shows ``always [madvise] never``."""
    with open(knob) as f:
        text = f.read()
    if "[" in text:
        text = text[text.index("[") + 1:text.index("]")]
    mode = text.strip()
    if mode not in MODES:
        raise ValueError(f"{knob}: unexpected transparent huge page mode {mode!r}")
    return mode


def _write_mode(knob: str, mode: str) -> None:
    with open(knob, "w") as f:
        f.write(mode)


class ThpSwitch:
    """``with switch.always(): <CUDA checkpoint>``: the node's THP mode is ``always`` inside."""

    def __init__(self, record: str, knob: str = ENABLED) -> None:
        self.record = record  # the mode found, while switched
        self.knob = knob
        self._lock = threading.Lock()
        self._users = 0
        self._found: str | None = None

    @contextlib.contextmanager
    def always(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._switch_on()
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._switch_back()

    def _switch_on(self) -> None:
        try:
            found = read_mode(self.knob)
            if found == "always":
                return
            tmp = self.record + ".tmp"
            with open(tmp, "w") as f:
                f.write(found + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.record)
            _write_mode(self.knob, "always")
            self._found = found
            log.info("transparent huge pages: %s -> always for the CUDA checkpoint", found)
        except (OSError, ValueError) as exc:  # the checkpoint goes on, only slower
            log.warning("transparent huge pages left as they are: %s", exc)

    def _switch_back(self) -> None:
        found, self._found = self._found, None
        if found is None:
            return
        try:
            _write_mode(self.knob, found)
            os.unlink(self.record)
            log.info("transparent huge pages: back to %s", found)
        except OSError as exc:  # the record stays: the next start puts it back
            log.error("transparent huge pages: cannot put %s back (%s)", found, exc)

    def recover(self) -> str | None:
        """At start-up: put back a mode a killed plugin left switched; the mode put back, if any."""
        try:
            with open(self.record) as f:
                found = f.read().strip()
        except FileNotFoundError:
            return None
        if found not in MODES:
            log.error("transparent huge pages: ignoring %s (%r is no mode)", self.record, found[:20])
            os.unlink(self.record)
            return None
        _write_mode(self.knob, found)
        os.unlink(self.record)
        log.warning("transparent huge pages: put back to %s (a checkpoint was cut short)", found)
        return found



def put_back(record: str, knob: str = ENABLED) -> None:
    """Put back a mode recorded in ``record``, if any (at the plugin's start: one a killed
    plugin left switched; as it exits: one a checkpoint still held switched), never raising."""
    try:
        ThpSwitch(record, knob).recover()
    except OSError as exc:
        log.error("transparent huge pages: cannot put the recorded mode back: %s", exc)
