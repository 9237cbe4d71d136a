"""NRI events, event masks, and what the connected runtime can do.

The mask bit of event N is ``1 << (N - 1)``. Runtimes validate the mask against *their* event
list: NRI 0.6/0.8 (containerd 1.7 – 2.1) reject any bit above 0x7FF, so the mask is always
explicit and capped by the runtime's NRI version. Sending 0 would mean "everything" — and on
NRI >= 0.10 also "validator", which breaks every create if unimplemented. Never send 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum


class Event(IntEnum):
    UNKNOWN = 0
    RUN_POD_SANDBOX = 1
    STOP_POD_SANDBOX = 2
    REMOVE_POD_SANDBOX = 3
    CREATE_CONTAINER = 4
    POST_CREATE_CONTAINER = 5
    START_CONTAINER = 6
    POST_START_CONTAINER = 7
    UPDATE_CONTAINER = 8
    POST_UPDATE_CONTAINER = 9
    STOP_CONTAINER = 10
    REMOVE_CONTAINER = 11
    UPDATE_POD_SANDBOX = 12
    POST_UPDATE_POD_SANDBOX = 13
    VALIDATE_CONTAINER_ADJUSTMENT = 14

    @property
    def bit(self) -> int:
        return 1 << (self.value - 1) if self.value else 0


def event_mask(events: set[Event]) -> int:
    mask = 0
    for ev in events:
        mask |= ev.bit
    return mask


def describe_mask(mask: int) -> str:
    names = [ev.name for ev in Event if ev.value and mask & ev.bit]
    return "|".join(names) or "none"


# Which NRI library each containerd release embeds (nri pkg/version/fallback.go).
_CONTAINERD_NRI = [
    ((1, 7, 0), (0, 3, 0)),
    ((1, 7, 7), (0, 4, 0)),
    ((1, 7, 14), (0, 6, 0)),
    ((1, 7, 16), (0, 6, 1)),
    ((1, 7, 26), (0, 8, 0)),
    ((2, 0, 0), (0, 8, 0)),
    ((2, 2, 0), (0, 10, 0)),
    ((2, 2, 1), (0, 11, 0)),
    ((2, 3, 0), (0, 12, 0)),
]
_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?", re.ASCII)


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """The runtime as announced in Configure, and the NRI version inferred from it."""

    name: str
    version: str
    nri: tuple[int, int, int]

    @classmethod
    def from_configure(cls, name: str, version: str, has_timeouts: bool) -> RuntimeInfo:
        return cls(name, version, infer_nri_version(name, version, has_timeouts))

    @property
    def valid_events(self) -> int:
        last = 15 if self.nri >= (0, 10, 0) else 12
        return (1 << (last - 1)) - 1

    @property
    def supports_args_adjustment(self) -> bool:
        """ContainerAdjustment.args exists from NRI 0.10 (containerd 2.2)."""
        return self.nri >= (0, 10, 0)

    def __str__(self) -> str:
        return f"{self.name} {self.version} (NRI {'.'.join(map(str, self.nri))})"


def infer_nri_version(name: str, version: str, has_timeouts: bool) -> tuple[int, int, int]:
    """Best guess of the runtime's NRI version; conservative when unsure.

    ConfigureRequest carries the timeouts from NRI 0.8 on, so their presence is a floor.
    """
    floor = (0, 8, 0) if has_timeouts else (0, 6, 0)
    m = _VERSION.match(version or "")
    if name != "containerd" or not m:
        return floor
    ver = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
    nri = floor
    for since, lib in _CONTAINERD_NRI:
        if ver >= since:
            nri = lib
    return max(nri, floor) if ver >= (1, 7, 0) else floor
