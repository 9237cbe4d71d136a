"""A pre-warmed artifact's state on this node, and the ``--prewarm`` list's parsing.

Kept apart from :mod:`nri_plugin.prewarm` (the looking and writing) so that the settings and
the metrics can name these small types without importing the pre-warmer and what it needs.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass

from runtime import names


class State(str, enum.Enum):
    ABSENT = "absent"      # no entry (not published, not looked at yet, or evicted since)
    WARMING = "warming"    # queued or being written
    WARM = "warm"          # the entry of the version the name points to is complete
    REFUSED = "refused"    # not written: ``reason`` says why (the bound, a bad version, ...)


@dataclass
class Status:
    artifact: str  # namespace/name
    state: State = State.ABSENT
    version: str = ""
    bytes: int = 0  # bulk bytes verified and written so far (warming), or the entry's
    total: int = 0
    rate: float = 0.0  # bytes a second, time paused for restores not counted
    paused: bool = False  # waiting for a restore to end
    entry_bytes: int = 0  # what its entry takes in the cache (warm)
    reason: str = ""

    def to_obj(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "state": self.state.value, "rate": round(self.rate, 1)}


def parse_names(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``namespace/name`` items (the setting) as pairs; raises ValueError naming a bad one."""
    out = []
    for item in items:
        ns, sep, name = item.strip().partition("/")
        if not sep or not names.is_dns_label(ns) or not names.is_artifact_name(name):
            raise ValueError(f"not namespace/name: {item!r}")
        if (ns, name) not in out:
            out.append((ns, name))
    return tuple(out)
