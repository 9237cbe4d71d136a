"""Outcomes reported to Kubernetes: Events and the rekindle.dev/Restored condition, sent with the
official client (through a kubeconfig) to an http.server in this process that plays the API
server and records each request. Every object sent is checked against the Kubernetes API's own
schemas (kubernetes-validate). The reporter never blocks its caller, retries a bounded number
of times, and counts what it drops."""

from __future__ import annotations

import copy
import time

import pytest

from nri_plugin.events_k8s import CONDITION, KubeReporter, connect
from nri_plugin.metrics import Metrics
from nri_plugin.outcomes import Outcome, OutcomeKind, Reporter
from runtime.errors import ConfigError
from runtime.status import ContainerStatus, Phase, StatusBook

from .fake_apiserver import FakeApiServer

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")

K8S_VERSION = "1.33"
UID = "6f0d3c1e-8a52-4d7b-9a33-0c1f2e3d4b5a"
RESTORE_TIMINGS = {"open": 0.01, "inspect": 0.02, "stage": 0.3, "rootfs_apply": 0.04, "criu_restore": 2.9,
                   "fill": 0.5, "cuda_restore": 0.4, "total": 4.1}


def outcome(kind: OutcomeKind, reason: str = "", role: str = "restore", **kw) -> Outcome:
    return Outcome(kind=kind, role=role, namespace="team-a", pod="qwen-0", pod_uid=UID, container="server",
                   container_id="c0ffee", artifact="qwen-7b", reason=reason, **kw)


def validate_event(body: dict) -> None:
    kubernetes_validate.validate(body, K8S_VERSION, strict=True)


def validate_status_patch(patch: dict) -> None:
    """The patch applied to a minimal valid pod is still a valid pod."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "qwen-0", "namespace": "team-a", "uid": UID},
           "spec": {"containers": [{"name": "server", "image": "img:1"}]},
           "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    merged = copy.deepcopy(pod)
    merged["metadata"].update(patch.get("metadata", {}))
    merged["status"]["conditions"] += patch["status"]["conditions"]
    assert set(patch) <= {"metadata", "status"} and set(patch["status"]) == {"conditions"}
    kubernetes_validate.validate(merged, K8S_VERSION, strict=True)


@pytest.fixture
def api(tmp_path):
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def reporter(api, tmp_path):
    metrics = Metrics()
    rep = KubeReporter(connect(str(api.kubeconfig(tmp_path / "kubeconfig"))), "node-1", backoff=0.05,
                       on_sent=metrics.report_sent, on_drop=metrics.report_dropped).start()
    rep.metrics = metrics  # type: ignore[attr-defined]
    yield rep
    rep.close()


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def wait_sample(metrics: Metrics, name: str, want: float, timeout: float = 10.0, **labels: str) -> float:
    """The counter once it reaches ``want`` (it moves after the server's answer is read)."""
    deadline = time.monotonic() + timeout
    while (got := sample(metrics, name, **labels)) < want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def test_restored_sends_a_normal_event_and_a_true_condition(api, reporter):
    reporter.publish(outcome(OutcomeKind.RESTORED, timings=RESTORE_TIMINGS, bytes=17 << 30))
    event, patch = api.wait_for(2)
    assert (event.method, event.path) == ("POST", "/api/v1/namespaces/team-a/events")
    assert event.content_type == "application/json"
    assert event.auth == "Bearer test-token"
    validate_event(event.body)
    assert (event.body["type"], event.body["reason"]) == ("Normal", "Restored")
    assert event.body["message"] == ("from team-a/qwen-7b in 4.1 s: stage 0.3 s, criu 2.9 s, fill 0.5 s, "
                                     "cuda 0.4 s")
    assert event.body["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "qwen-0",
                                            "namespace": "team-a", "uid": UID,
                                            "fieldPath": "spec.containers{server}"}
    assert event.body["source"] == {"component": "rekindle", "host": "node-1"}
    assert event.body["metadata"]["name"].startswith("qwen-0.")
    assert (patch.method, patch.path) == ("PATCH", "/api/v1/namespaces/team-a/pods/qwen-0/status")
    assert patch.content_type == "application/strategic-merge-patch+json"
    validate_status_patch(patch.body)
    assert patch.body["metadata"] == {"uid": UID}  # never patches a newer pod of the same name
    (cond,) = patch.body["status"]["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == (CONDITION, "True", "Restored")
    assert wait_sample(reporter.metrics, "rekindle_kubernetes_reports_sent_total", 1, kind="event") == 1
    assert wait_sample(reporter.metrics, "rekindle_kubernetes_reports_sent_total", 1, kind="condition") == 1


def test_cold_start_sends_a_warning_and_a_false_condition_with_the_reason(api, reporter):
    reason = "artifact team-a/qwen-7b not found in /var/lib/rekindle/store"
    reporter.publish(outcome(OutcomeKind.COLD_START, reason))
    event, patch = api.wait_for(2)
    validate_event(event.body)
    validate_status_patch(patch.body)
    assert (event.body["type"], event.body["reason"]) == ("Warning", "ColdStart")
    assert reason in event.body["message"]
    (cond,) = patch.body["status"]["conditions"]
    assert (cond["status"], cond["reason"]) == ("False", "NotFound")
    assert reason in cond["message"]


@pytest.mark.parametrize("kind, reason, etype, ereason", [
    (OutcomeKind.PUBLISHED, "", "Normal", "CheckpointPublished"),
    (OutcomeKind.CHECKPOINT_FAILED, "criu dump failed: (-52) log at /x", "Warning", "CheckpointFailed"),
    (OutcomeKind.SKIPPED, "artifact team-a/qwen-7b is already published (created x)", "Normal", "Skipped"),
], ids=["published", "failed", "skipped"])
def test_source_outcomes_send_an_event_and_no_condition(api, reporter, kind, reason, etype, ereason):
    reporter.publish(outcome(kind, reason, role="checkpoint", bytes=64 << 20,
                             timings={"inspect": 0.1, "criu_dump": 1.5, "publish": 0.4, "total": 2.1}))
    (event,) = api.wait_for(1)
    validate_event(event.body)
    assert (event.body["type"], event.body["reason"]) == (etype, ereason)
    if kind is OutcomeKind.PUBLISHED:
        assert event.body["message"] == "team-a/qwen-7b (64.0 MiB) in 2.1 s: inspect 0.1 s, criu 1.5 s, publish 0.4 s"
    else:
        assert reason in event.body["message"]
    reporter.close()  # sends what is queued: nothing else follows (no condition for a source)
    assert len(api.requests) == 1


def test_long_messages_are_cut_to_1024_characters(api, reporter):
    reporter.publish(outcome(OutcomeKind.COLD_START, "x" * 5000))
    event, patch = api.wait_for(2)
    validate_event(event.body)
    assert len(event.body["message"]) == 1024 and event.body["message"].endswith("...")
    assert len(patch.body["status"]["conditions"][0]["message"]) == 1024


def test_api_down_is_retried_a_bounded_number_of_times_then_dropped_and_counted(api, tmp_path):
    api.answer = 503
    metrics = Metrics()
    rep = KubeReporter(connect(str(api.kubeconfig(tmp_path / "kc"))), "node-1", attempts=3, backoff=0.05,
                       on_drop=metrics.report_dropped).start()
    try:
        rep.publish(outcome(OutcomeKind.PUBLISHED, role="checkpoint"))
        api.wait_for(3)
        assert wait_sample(metrics, "rekindle_kubernetes_reports_dropped_total", 1, reason="api_unavailable") == 1
        assert len(api.requests) == 3  # attempts, not more: the report is given up
    finally:
        rep.close()


def test_unreachable_api_is_dropped_and_counted(tmp_path):
    with FakeApiServer() as gone:
        kubeconfig = gone.kubeconfig(tmp_path / "kc")
    metrics = Metrics()  # the server is closed: connections are refused
    rep = KubeReporter(connect(str(kubeconfig)), "node-1", attempts=2, backoff=0.05,
                       on_drop=metrics.report_dropped).start()
    try:
        rep.publish(outcome(OutcomeKind.RESTORED, timings=RESTORE_TIMINGS))
        assert wait_sample(metrics, "rekindle_kubernetes_reports_dropped_total", 2, reason="api_unavailable") == 2
    finally:
        rep.close()


@pytest.mark.parametrize("code", [403, 404, 409, 422], ids=["forbidden", "pod-gone", "uid-conflict", "invalid"])
def test_a_rejected_report_is_not_retried(api, tmp_path, code):
    api.answer = code
    metrics = Metrics()
    rep = KubeReporter(connect(str(api.kubeconfig(tmp_path / "kc"))), "node-1", backoff=0.05,
                       on_drop=metrics.report_dropped).start()
    try:
        rep.publish(outcome(OutcomeKind.COLD_START, "annotation rekindle.dev/restore: bad"))
        api.wait_for(2)
        assert wait_sample(metrics, "rekindle_kubernetes_reports_dropped_total", 2, reason="rejected") == 2
        assert len(api.requests) == 2  # the event and the patch, once each: both given up
    finally:
        rep.close()


def test_publish_never_waits_for_a_hanging_api_and_a_full_queue_drops(api, tmp_path):
    api.hold = 3.0  # every request hangs
    metrics = Metrics()
    rep = KubeReporter(connect(str(api.kubeconfig(tmp_path / "kc"))), "node-1", queue_size=2, attempts=1,
                       timeout=(1.0, 5.0), on_drop=metrics.report_dropped).start()
    try:
        t0 = time.monotonic()
        for _ in range(5):  # 10 reports: 1 in flight, 2 queued, the rest dropped
            rep.publish(outcome(OutcomeKind.RESTORED, timings=RESTORE_TIMINGS))
        assert time.monotonic() - t0 < 0.1
        assert sample(metrics, "rekindle_kubernetes_reports_dropped_total", reason="queue_full") >= 7
    finally:
        rep.close(timeout=0.5)


def test_status_records_flow_through_the_reporter_once_per_container(api, reporter, tmp_path):
    """The plugin's path: a status write -> Reporter -> Events (each outcome once)."""
    book = StatusBook(tmp_path / "state")
    book.observe(Reporter([reporter]))
    rec = ContainerStatus(namespace="team-a", pod="qwen-0", container="server", role="restore",
                          artifact="qwen-7b", phase=Phase.RESTORING, container_id="c0ffee", pod_uid=UID)
    book.write(rec)           # not an outcome
    rec.phase, rec.timings = Phase.RESTORED, dict(RESTORE_TIMINGS)
    book.write(rec)
    book.write(rec)           # rewritten: still one outcome
    reqs = api.wait_for(2)
    reporter.close()  # whatever was queued is sent by now
    assert len(api.requests) == 2 and reqs[0].body["reason"] == "Restored"


def test_no_service_account_is_a_config_error(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="in-cluster service account"):
        connect()


def test_every_request_is_one_the_charts_rbac_grants(api, reporter):
    """The chart grants create on events and patch on pods/status, nothing else: every outcome
    sends only those (no get of a pod's status, no patch of an Event)."""
    kinds = [OutcomeKind.RESTORED, OutcomeKind.COLD_START, OutcomeKind.PUBLISHED, OutcomeKind.CHECKPOINT_FAILED]
    for kind in kinds:
        reporter.publish(outcome(kind, "why", **({"role": "checkpoint"} if kind in kinds[2:] else {})))
    api.wait_for(6)
    reporter.close()
    assert {(r.method, r.path.rsplit("/", 1)[-1] if r.method == "POST" else "status") for r in api.requests} == {
        ("POST", "events"), ("PATCH", "status")}
    assert all(r.path == "/api/v1/namespaces/team-a/events" for r in api.requests if r.method == "POST")
    assert all(r.path.endswith("/status") for r in api.requests if r.method == "PATCH")
