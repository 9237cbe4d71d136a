"""Per-container status records: what Rekindle decided for a container, and why.

One JSON file per container at ``<state>/status/<namespace>/<pod>/<container>.json``, rewritten
atomically at each phase change (and, while a checkpoint or restore runs, with its live
``progress`` at most every ~0.5 s), so ``rekindle status`` and a node operator can see why a pod
started cold, how far a running restore is, or how long each phase took. Components are
validated by the caller (pod namespace/name and container name come from Kubernetes and are
DNS names).

Observers (``StatusBook.observe``) hear every record after it is written, on the writer's
thread: they must be quick and must not block (the plugin's outcome reporting uses this seam).
An observer that raises is logged and otherwise ignored.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from runtime import names

log = logging.getLogger(__name__)

class Phase(str, Enum):
    IGNORED = "ignored"            # malformed annotations: left alone
    WAITING_READY = "waiting-ready"
    CHECKPOINTING = "checkpointing"
    PUBLISHED = "published"
    CHECKPOINT_FAILED = "checkpoint-failed"
    RESTORE_PENDING = "restore-pending"
    RESTORING = "restoring"
    RESTORED = "restored"
    RESTORE_EXITED = "restore-exited"  # restored, then the process died at once (it never ran on)
    COLD_START = "cold-start"
    RESTORE_FAILED = "restore-failed"  # failed, and the pod fails closed: its container exits, never starts cold
    SKIPPED = "skipped"            # left alone on purpose (not this container, artifact exists)

    @property
    def final(self) -> bool:
        """An outcome: nothing more happens for this container until it is created again."""
        return self in _FINAL


_FINAL = {Phase.IGNORED, Phase.PUBLISHED, Phase.CHECKPOINT_FAILED, Phase.RESTORED, Phase.RESTORE_EXITED,
          Phase.COLD_START, Phase.RESTORE_FAILED, Phase.SKIPPED}


@dataclass
class Progress:
    """Live progress of a running checkpoint or restore."""

    phase: str
    bytes_done: int = 0
    bytes_total: int = 0
    rate: float = 0.0          # bytes per second since the phase started
    phase_started_at: float = 0.0


# Phases after which nothing more happens to a container's record.
FINAL_PHASES = frozenset({Phase.IGNORED, Phase.PUBLISHED, Phase.CHECKPOINT_FAILED, Phase.RESTORED,
                          Phase.RESTORE_EXITED, Phase.COLD_START, Phase.RESTORE_FAILED})


@dataclass
class ContainerStatus:
    namespace: str
    pod: str
    container: str
    role: str = ""
    artifact: str = ""
    phase: Phase = Phase.IGNORED
    reason: str = ""
    container_id: str = ""
    pod_uid: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    updated_at: float = 0.0
    progress: Progress | None = None   # only while checkpointing or restoring
    bytes: int = 0                     # what the artifact stores (its holes take nothing), once published or restored
    reason_class: str = ""             # runtime.errors.Reason of a failure, when its error said ("": by its words)
    note: str = ""                     # a remark on a success (a restore no faster than a cold start)
    route: str = ""                    # a restore's route: "<kind>: <path> (<reason>)" (runtime.route)

    def to_json(self) -> str:
        d = asdict(self)
        d["phase"] = self.phase.value
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ContainerStatus:
        d = json.loads(text)
        d["phase"] = Phase(d["phase"])
        if d.get("progress") is not None:
            d["progress"] = Progress(**d["progress"])
        return cls(**d)


Observer = Callable[[ContainerStatus], Any]


class StatusBook:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.root = Path(state_dir) / "status"
        self._observers: list[Observer] = []

    def observe(self, observer: Observer) -> None:
        """Call ``observer(record)`` after every write (on the writer's thread; keep it quick)."""
        self._observers.append(observer)

    def _path(self, namespace: str, pod: str, container: str) -> Path:
        for part in (namespace, pod, container):
            if not names.is_status_component(part):
                raise ValueError(f"unusable status path component {part!r}")
        return self.root / namespace / pod / f"{container}.json"

    def write(self, status: ContainerStatus) -> None:
        status.updated_at = time.time()
        path = self._path(status.namespace, status.pod, status.container)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(status.to_json())
        os.replace(tmp, path)
        for observer in self._observers:
            try:
                observer(status)
            except Exception:  # noqa: BLE001 - reporting must never undo or fail a record
                log.exception("status observer failed for %s/%s:%s", status.namespace, status.pod,
                              status.container)

    def record(self, status: ContainerStatus) -> bool:
        """:meth:`write`, for callers a status failure must not stop (an NRI handler, a job):
        an unusable name or a full disk is logged, and False returned."""
        try:
            self.write(status)
        except (OSError, ValueError) as exc:
            log.error("%s/%s:%s: cannot record status: %s", status.namespace, status.pod, status.container, exc)
            return False
        return True

    def read(self, namespace: str, pod: str, container: str) -> ContainerStatus | None:
        return self.read_path(self._path(namespace, pod, container))

    @staticmethod
    def read_path(path: Path) -> ContainerStatus | None:
        try:
            return ContainerStatus.from_json(path.read_text())
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def wait(self, namespace: str, pod: str, container: str, phases: set[Phase],
             timeout: float, poll: float = 0.1) -> ContainerStatus | None:
        """The record once it reaches one of ``phases``; the last one seen (or None) on timeout."""
        deadline = time.monotonic() + timeout
        last = None
        while True:
            last = self.read(namespace, pod, container) or last
            if last is not None and last.phase in phases or time.monotonic() >= deadline:
                return last
            time.sleep(poll)

    def list(self) -> list[ContainerStatus]:
        out = []
        for path in sorted(self.root.glob("*/*/*.json")):
            try:
                out.append(ContainerStatus.from_json(path.read_text()))
            except (ValueError, KeyError, TypeError):
                continue
        return out
