"""Outcomes: status records -> one outcome per container instance; reason texts -> a bounded
set of classes (the texts are the ones Rekindle's own errors and checks produce)."""

from __future__ import annotations

import pytest

from nri_plugin import guards
from nri_plugin.outcomes import Outcome, OutcomeKind, ReasonClass, Reporter, classify, outcome_of
from nri_plugin.policy import Intent, Role
from nri_plugin.stub import HandlerOverrun
from runtime.errors import AnnotationError, ArtifactNotFound, ArtifactRejected, CriuError, CudaError
from runtime.status import ContainerStatus, Phase

_INTENT = Intent(Role.CHECKPOINT, "m")


def _existing() -> str:
    """The reason ``guards.existing_artifact`` gives for a published artifact."""
    import tempfile

    from runtime.store.volume import ArtifactStore
    from tests.unit.test_store import KEY, publish
    with tempfile.TemporaryDirectory() as tmp:
        store = ArtifactStore(tmp)
        publish(store, "team-a", "m")
        reason = guards.existing_artifact(store, KEY, "team-a", _INTENT)
    assert reason
    return reason


def _manifest_source(container: str):
    class Src:
        pass

    class M:
        source = Src()
    M.source.container = container
    return M


@pytest.mark.parametrize("reason, cls", [
    ("", ReasonClass.NONE),
    (str(AnnotationError("rekindle.dev/restore", "artifact name must be 1-63 of [a-z0-9.-], got '../x'")),
     ReasonClass.ANNOTATION),
    (str(ArtifactNotFound("artifact team-a/qwen not found in /var/lib/rekindle/store")), ReasonClass.NOT_FOUND),
    (str(ArtifactNotFound("artifact team-a/qwen not found: no store at /s")), ReasonClass.NOT_FOUND),
    ("a restore was already attempted for this pod (restored); not retrying", ReasonClass.ALREADY_ATTEMPTED),
    ("incompatible: CUDA driver differs: artifact 580.1, node 570.2", ReasonClass.INCOMPATIBLE),
    (str(ArtifactRejected("team-a/qwen", "image differs: artifact a:1, target a:2")), ReasonClass.INCOMPATIBLE),
    ("target container is less privileged than the source: source has capabilities the target lacks: "
     "CAP_SYS_ADMIN", ReasonClass.PRIVILEGE),
    (str(ArtifactRejected("team-a/qwen", "source runs as uid 0, target as uid 1000")), ReasonClass.PRIVILEGE),
    (str(ArtifactRejected("team-a/qwen", "bad signature")), ReasonClass.INTEGRITY),
    (str(ArtifactRejected("team-a/qwen", "file criu/pages-1.img: content changed (size 10, sha256 ab)")),
     ReasonClass.INTEGRITY),
    (str(HandlerOverrun("create_container", 1.6)), ReasonClass.TIMEOUT),
    ("the agent restarted during the restore", ReasonClass.AGENT_RESTART),
    (_existing(), ReasonClass.ARTIFACT_EXISTS),
    (guards.other_containers(_INTENT, "c1", [("c1", "app"), ("c2", "istio-proxy")]), ReasonClass.SEVERAL_CONTAINERS),
    (guards.source_container_mismatch(Intent(Role.RESTORE, "m"), "istio-proxy", _manifest_source("server")),
     ReasonClass.NOT_SOURCE_CONTAINER),
    (str(CriuError("restore", "(-1) see log", "/var/lib/rekindle/logs/restore.log")), ReasonClass.CRIU),
    (str(CudaError("cuCheckpointProcessRestore", 999, "CUDA_ERROR_UNKNOWN")), ReasonClass.CUDA),
    ("no containerd API to swap the entrypoint with", ReasonClass.RUNTIME),
    ("something nobody foresaw", ReasonClass.OTHER),
], ids=lambda v: v.value if isinstance(v, ReasonClass) else None)
def test_reasons_fall_into_bounded_classes(reason, cls):
    assert classify(reason) is cls


def _status(phase: Phase, role: str = "restore", reason: str = "", **kw) -> ContainerStatus:
    return ContainerStatus(namespace="ns", pod="p", container="c", role=role, artifact="a", phase=phase,
                           reason=reason, container_id="cid", pod_uid="uid", **kw)


@pytest.mark.parametrize("phase, role, kind", [
    (Phase.RESTORED, "restore", OutcomeKind.RESTORED),
    (Phase.COLD_START, "restore", OutcomeKind.COLD_START),
    (Phase.PUBLISHED, "checkpoint", OutcomeKind.PUBLISHED),
    (Phase.CHECKPOINT_FAILED, "checkpoint", OutcomeKind.CHECKPOINT_FAILED),
    (Phase.COLD_START, "checkpoint", OutcomeKind.CHECKPOINT_FAILED),   # a source that failed at create
    (Phase.IGNORED, "restore", OutcomeKind.COLD_START),                 # a malformed restore pod
    (Phase.IGNORED, "checkpoint", OutcomeKind.CHECKPOINT_FAILED),
    (Phase.IGNORED, "", None),                                          # nothing recognisable asked for
    (Phase.SKIPPED, "restore", OutcomeKind.SKIPPED),
    (Phase.RESTORING, "restore", None),
    (Phase.WAITING_READY, "checkpoint", None),
    (Phase.CHECKPOINTING, "checkpoint", None),
    (Phase.RESTORE_PENDING, "restore", None),
])
def test_final_phases_are_outcomes(phase, role, kind):
    out = outcome_of(_status(phase, role))
    assert (out.kind if out else None) is kind


def test_summaries_name_artifact_time_and_phases():
    o = Outcome(OutcomeKind.RESTORED, "restore", "team-a", "p", "u", "server", "cid", "qwen-7b",
                timings={"open": 0.01, "stage": 0.31, "criu_restore": 2.94, "fill": 0.5, "cuda_restore": 0.36,
                         "total": 4.12})
    assert o.summary() == "from team-a/qwen-7b in 4.1 s: stage 0.3 s, criu 2.9 s, fill 0.5 s, cuda 0.4 s"
    o = Outcome(OutcomeKind.COLD_START, "restore", "team-a", "p", "u", "server", "cid", "qwen-7b", reason="why")
    assert o.summary() == "container server started cold instead of restoring team-a/qwen-7b: why"


class Sink:
    def __init__(self) -> None:
        self.got: list[Outcome] = []

    def publish(self, outcome: Outcome) -> None:
        self.got.append(outcome)


class Broken:
    def publish(self, outcome: Outcome) -> None:
        raise RuntimeError("boom")


def test_reporter_reports_each_outcome_once_and_survives_a_broken_sink():
    sink = Sink()
    rep = Reporter([Broken(), sink])
    rep(_status(Phase.RESTORING))
    rep(_status(Phase.RESTORED, timings={"total": 1.0}))
    rep(_status(Phase.RESTORED, timings={"total": 1.0}))        # the same record rewritten
    rep(_status(Phase.COLD_START, reason="later cold start"))    # a new phase of that container
    assert [o.kind for o in sink.got] == [OutcomeKind.RESTORED, OutcomeKind.COLD_START]
    other = _status(Phase.RESTORED)
    other.container_id = "cid2"                                  # the container was re-created
    rep(other)
    assert len(sink.got) == 3
