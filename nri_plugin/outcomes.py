"""Outcomes: what finally happened to an annotated container, told to whoever listens.

The plugin records every decision in the container's status file (``runtime.status``).
``Reporter`` observes those writes; for a record in a final phase it builds one ``Outcome``
(restored, restored but exited at once, cold start, failed closed, checkpoint published, checkpoint failed,
skipped) and hands it to each
``OutcomeSink`` (metrics, Kubernetes Events and pod condition). Each outcome is reported once
per container instance, however often its record is rewritten.

Sinks are called on the writer's thread (an NRI handler's, the event loop's or an engine
thread's): ``publish`` must return at once and never raise into the caller; a sink that does
raise is logged and skipped.

An outcome's ``reason_class`` (``runtime.errors.Reason``, a small fixed set: metric labels stay
bounded whatever a CRIU or store error says) is the one its error carried, recorded in the status
(``ContainerStatus.reason_class``); ``classify`` guesses it from the words only for the rest
(an unexpected exception, the plugin's own skip texts, records written before the field). The
reason text itself goes only into Events, logs and status.

No Kubernetes or Prometheus import here: this module is pure data and formatting.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from runtime.errors import Reason
from runtime.status import ContainerStatus, Phase

log = logging.getLogger(__name__)


class OutcomeKind(Enum):
    RESTORED = "restored"
    RESTORE_EXITED = "restore_exited"      # restored, and the process died right after
    COLD_START = "cold_start"
    RESTORE_FAILED = "restore_failed"      # failed closed (rekindle.dev/on-restore-failure: fail)
    PUBLISHED = "published"
    CHECKPOINT_FAILED = "checkpoint_failed"
    SKIPPED = "skipped"


ReasonClass = Reason  # (its old name here)


# Ordered: the first class whose keyword occurs in the reason wins. The texts are Rekindle's
# own messages (runtime.errors and the reasons the checks build); tests pin them.
_KEYWORDS: tuple[tuple[ReasonClass, tuple[str, ...]], ...] = (
    (ReasonClass.ANNOTATION, ("annotation ",)),
    (ReasonClass.ARTIFACT_EXISTS, ("is already published",)),
    (ReasonClass.SEVERAL_CONTAINERS, ("several containers",)),
    (ReasonClass.NOT_SOURCE_CONTAINER, ("not the artifact's source container",)),
    (ReasonClass.ALREADY_ATTEMPTED, ("already attempted",)),
    (ReasonClass.AGENT_RESTART, ("agent restarted",)),
    (ReasonClass.EXITED, ("exited right after the restore",)),
    (ReasonClass.TIMEOUT, ("overran", "timed out", "timeout")),
    (ReasonClass.NOT_FOUND, ("not found in", "not found: no store", "is gone")),
    (ReasonClass.PRIVILEGE, ("less privileged", "source runs as", "source gid", "groups the target lacks",
                             "capabilities the target lacks", "privileged", "seccomp", "no_new_privileges",
                             "user namespaces differ", "masks paths", "read-only that the source",
                             "device cgroup", "sysctls differ", "AppArmor", "SELinux", "CRIU cannot confine")),
    (ReasonClass.INCOMPATIBLE, ("incompatible", "differs", "older than the artifact", "CRIU version unknown",
                                "no CUDA driver", "architecture")),
    (ReasonClass.INTEGRITY, ("bad signature", "content changed", "digest", "manifest", "unsafe path",
                             "incomplete", "generation", "not a regular file", "points to",
                             "not a published name", "shrank", "restore plan")),
    (ReasonClass.CRIU, ("criu ",)),
    (ReasonClass.CUDA, ("cuCheckpoint", "CUDA", "cuda")),
    (ReasonClass.STORE, ("store", "artifact ")),
    (ReasonClass.RUNTIME, ("containerd", "container ", "entrypoint", "control dir")),
)


def classify(reason: str) -> ReasonClass:
    """The class of a failure or skip reason; ``NONE`` for an empty reason."""
    if not reason:
        return ReasonClass.NONE
    for cls, words in _KEYWORDS:
        if any(w in reason for w in words):
            return cls
    return ReasonClass.OTHER


# Short phase names for one-line summaries; the status file keeps the full names.
_SHORT = {"criu_restore": "criu", "cuda_restore": "cuda", "criu_dump": "criu", "cuda_checkpoint": "cuda",
          "rootfs_apply": "rootfs", "rootfs_capture": "rootfs", "cuda_resume_source": "cuda resume"}
# Phases shorter than this are left out of a summary (they are in the status file).
_SUMMARY_MIN_SECONDS = 0.05
# Timings that are no phase of the flow: the source's time from its start to ready (a checkpoint's
# record and manifest), and that figure as a restore read it from its artifact.
COLD_START = "cold_start"
SOURCE_COLD_START = "source_cold_start"
NOT_PHASES = frozenset({"total", COLD_START, SOURCE_COLD_START})


def slower_than_cold(timings: Mapping[str, float]) -> str:
    """A restore that took at least as long as its source's cold start (from the container's
    start to ready, recorded at checkpoint): the note that says so with both figures, so that the
    annotation can be dropped. "" when it was faster, or either figure is unknown."""
    total, cold = timings.get("total", 0.0), timings.get(SOURCE_COLD_START, 0.0)
    if total <= 0 or cold <= 0 or total < cold:
        return ""
    return (f"the restore took {total:.1f} s, no faster than the source's cold start of {cold:.1f} s "
            "(its start to ready): a cold start would do as well, the restore annotation can be dropped")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    role: str                # "checkpoint", "restore" or "" (unknown: malformed annotations)
    namespace: str
    pod: str
    pod_uid: str
    container: str
    container_id: str
    artifact: str
    reason: str = ""
    timings: Mapping[str, float] = field(default_factory=dict)
    bytes: int = 0
    reason_kind: str = ""  # the Reason its error carried ("": none said)

    @property
    def reason_class(self) -> Reason:
        if self.reason_kind:
            try:
                return Reason(self.reason_kind)
            except ValueError:
                pass
        return classify(self.reason)

    @property
    def seconds(self) -> float:
        if "total" in self.timings:
            return float(self.timings["total"])
        return float(sum(v for k, v in self.timings.items() if k != "wait_ready" and k not in NOT_PHASES))

    def phases(self) -> str:
        """``stage 0.3 s, criu 2.9 s, fill 0.5 s`` (phases of at least 0.05 s)."""
        parts = [f"{_SHORT.get(k, k)} {v:.1f} s" for k, v in self.timings.items()
                 if k not in NOT_PHASES and v >= _SUMMARY_MIN_SECONDS]
        return ", ".join(parts)

    def summary(self) -> str:
        """One line for an Event or a log: what happened, from what, how long, why."""
        label = f"{self.namespace}/{self.artifact}" if self.artifact else "(no artifact)"
        phases = self.phases()
        if self.kind is OutcomeKind.RESTORED:
            slow = slower_than_cold(self.timings)
            return (f"from {label} in {self.seconds:.1f} s" + (f": {phases}" if phases else "")
                    + (f"; {slow}" if slow else ""))
        if self.kind is OutcomeKind.PUBLISHED:
            size = f" ({_size(self.bytes)})" if self.bytes else ""
            return f"{label}{size} in {self.seconds:.1f} s" + (f": {phases}" if phases else "")
        if self.kind is OutcomeKind.RESTORE_EXITED:
            return f"container {self.container} was restored from {label} and died: {self.reason}"
        if self.kind is OutcomeKind.RESTORE_FAILED:
            return (f"container {self.container} failed closed instead of restoring {label} "
                    f"(the original command did not run): {self.reason}")
        if self.kind is OutcomeKind.COLD_START:
            return f"container {self.container} started cold instead of restoring {label}: {self.reason}"
        if self.kind is OutcomeKind.CHECKPOINT_FAILED:
            return f"checkpoint of container {self.container} to {label} failed: {self.reason}"
        return f"container {self.container} left alone: {self.reason}"


def outcome_of(status: ContainerStatus) -> Outcome | None:
    """The outcome a status record stands for, or None while work is under way."""
    role = status.role
    if status.phase is Phase.RESTORED:
        kind = OutcomeKind.RESTORED
    elif status.phase is Phase.RESTORE_EXITED:
        kind = OutcomeKind.RESTORE_EXITED
    elif status.phase is Phase.PUBLISHED:
        kind = OutcomeKind.PUBLISHED
    elif status.phase is Phase.SKIPPED:
        kind = OutcomeKind.SKIPPED
    elif status.phase is Phase.RESTORE_FAILED:
        kind = OutcomeKind.RESTORE_FAILED
    elif status.phase is Phase.CHECKPOINT_FAILED:
        kind = OutcomeKind.CHECKPOINT_FAILED
    elif status.phase in (Phase.COLD_START, Phase.IGNORED):
        if role == "checkpoint":
            kind = OutcomeKind.CHECKPOINT_FAILED
        elif role == "restore":
            kind = OutcomeKind.COLD_START
        else:
            return None
    else:
        return None
    return Outcome(kind=kind, role=role, namespace=status.namespace, pod=status.pod, pod_uid=status.pod_uid,
                   container=status.container, container_id=status.container_id, artifact=status.artifact,
                   reason=status.reason, timings=dict(status.timings), bytes=status.bytes,
                   reason_kind=status.reason_class)


class OutcomeSink(Protocol):
    def publish(self, outcome: Outcome) -> None: ...


class Reporter:
    """A ``StatusBook`` observer: each final record becomes one outcome for every sink."""

    MEMORY = 4096  # container instances remembered, to report each outcome once

    def __init__(self, sinks: Iterable[OutcomeSink] = ()) -> None:
        self.sinks = list(sinks)
        self._seen: OrderedDict[tuple[str, str, str, str], None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, sink: OutcomeSink) -> None:
        self.sinks.append(sink)

    def __call__(self, status: ContainerStatus) -> None:
        outcome = outcome_of(status)
        if outcome is None:
            return
        key = (status.pod_uid, status.container, status.container_id, status.phase.value)
        with self._lock:
            if key in self._seen:
                return
            self._seen[key] = None
            while len(self._seen) > self.MEMORY:
                self._seen.popitem(last=False)
        log.info("%s/%s:%s: %s: %s", outcome.namespace, outcome.pod, outcome.container, outcome.kind.value,
                 outcome.summary(), extra={"outcome": outcome.kind.value, "artifact": outcome.artifact,
                                           "reason": outcome.reason_class.value, "seconds": outcome.seconds})
        for sink in self.sinks:
            try:
                sink.publish(outcome)
            except Exception:  # noqa: BLE001 - one broken sink must not silence the others
                log.exception("outcome sink %s failed", type(sink).__name__)
