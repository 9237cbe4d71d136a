"""Per-container status records: what Rekindle decided for a container, and why.

One JSON file per container at ``<state>/status/<namespace>/<pod>/<container>.json``, rewritten
atomically at each phase change, so ``rekindle status`` and a node operator can see why a pod
started cold or how long each restore phase took. Components are validated by the caller
(pod namespace/name and container name come from Kubernetes and are DNS names).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


class Phase(str, Enum):
    IGNORED = "ignored"            # malformed annotations: left alone
    WAITING_READY = "waiting-ready"
    CHECKPOINTING = "checkpointing"
    PUBLISHED = "published"
    CHECKPOINT_FAILED = "checkpoint-failed"
    RESTORE_PENDING = "restore-pending"
    RESTORING = "restoring"
    RESTORED = "restored"
    COLD_START = "cold-start"


# Phases after which nothing more happens to a container's record.
FINAL_PHASES = frozenset({Phase.IGNORED, Phase.PUBLISHED, Phase.CHECKPOINT_FAILED, Phase.RESTORED,
                          Phase.COLD_START})


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

    def to_json(self) -> str:
        d = asdict(self)
        d["phase"] = self.phase.value
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ContainerStatus:
        d = json.loads(text)
        d["phase"] = Phase(d["phase"])
        return cls(**d)


class StatusBook:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.root = Path(state_dir) / "status"

    def _path(self, namespace: str, pod: str, container: str) -> Path:
        for part in (namespace, pod, container):
            if not _COMPONENT.fullmatch(part):
                raise ValueError(f"unusable status path component {part!r}")
        return self.root / namespace / pod / f"{container}.json"

    def write(self, status: ContainerStatus) -> None:
        status.updated_at = time.time()
        path = self._path(status.namespace, status.pod, status.container)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(status.to_json())
        os.replace(tmp, path)

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
