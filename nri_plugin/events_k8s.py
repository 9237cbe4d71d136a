"""Outcomes as Kubernetes Events on the pod, and the pod condition ``rekindle.dev/Restored``.

An ``OutcomeSink``: ``publish`` turns an outcome into reports (a core/v1 Event; for a restore,
also a strategic-merge patch of the pod's status conditions) and puts them on a bounded queue
without waiting. One worker thread sends them with the official client. Nothing here runs on
the event loop or in an NRI handler, and nothing waits for the API server there:
  - a full queue drops the report (``on_drop("queue_full")``);
  - a transport error, 429 or 5xx is retried ``attempts`` times with exponential backoff, then
    dropped (``on_drop("api_unavailable")``); any other 4xx is dropped at once (``"rejected"``),
    as is a pod that is gone or was replaced (the status patch carries the pod's UID, which the
    API server checks, as the kubelet's own status patches do);
  - every call has a connect and read timeout.
Reports are best effort by design: the status file on the node (``rekindle status``) is the
record; Events and the condition are how it shows up in ``kubectl describe pod``.

The Event is the legacy core/v1 shape the kubelet writes (``source``, first/last timestamp,
``count``), so ``kubectl describe`` and ``kubectl get events`` show it everywhere; its
involvedObject names the container (``spec.containers{NAME}``). Configuration: in-cluster
service account (the chart mounts a token only with ``events.enabled``), or a kubeconfig file.
RBAC: create/patch events; get and patch pods/status.

The client is an optional dependency (``rekindle[kubernetes]``; the plugin image has it): it is
imported only where it is used, and ``client_missing`` says whether it can be.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from runtime.errors import ConfigError

from .outcomes import Outcome, OutcomeKind, ReasonClass

log = logging.getLogger(__name__)

CONDITION = "rekindle.dev/Restored"
COMPONENT = "rekindle"
REPORTING_COMPONENT = "rekindle.dev/nri-plugin"
MAX_MESSAGE = 1024
SMP = "application/strategic-merge-patch+json"

EVENTS: dict[OutcomeKind, tuple[str, str]] = {
    OutcomeKind.RESTORED: ("Normal", "Restored"),
    OutcomeKind.COLD_START: ("Warning", "ColdStart"),
    OutcomeKind.RESTORE_FAILED: ("Warning", "RestoreFailed"),
    OutcomeKind.RESTORE_EXITED: ("Warning", "RestoreExited"),
    OutcomeKind.PUBLISHED: ("Normal", "CheckpointPublished"),
    OutcomeKind.CHECKPOINT_FAILED: ("Warning", "CheckpointFailed"),
    OutcomeKind.SKIPPED: ("Normal", "Skipped"),
}


@dataclass(frozen=True)
class Report:
    kind: str                 # "event" or "condition"
    namespace: str
    pod: str
    body: dict[str, Any]


def _time(now: datetime.datetime) -> str:
    return now.astimezone(datetime.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def _event_name(pod: str, now: datetime.datetime) -> str:
    # As the kubelet names its events: <object>.<unix nanoseconds in hex>; at most 253 characters.
    stamp = f"{int(now.timestamp() * 1e9):x}"
    return f"{pod[:253 - len(stamp) - 1].rstrip('.-')}.{stamp}"


def _message(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."


def event_body(outcome: Outcome, node: str, now: datetime.datetime) -> dict[str, Any]:
    kind, reason = EVENTS[outcome.kind]
    stamp = _time(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": _event_name(outcome.pod, now), "namespace": outcome.namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": outcome.pod,
                           "namespace": outcome.namespace, "uid": outcome.pod_uid,
                           "fieldPath": f"spec.containers{{{outcome.container}}}"},
        "type": kind,
        "reason": reason,
        "message": _message(outcome.summary()),
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": REPORTING_COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def condition_reason(outcome: Outcome) -> str:
    if outcome.kind is OutcomeKind.RESTORED:
        return "Restored"
    cls = outcome.reason_class
    return "".join(w.capitalize() for w in (cls if cls is not ReasonClass.NONE else ReasonClass.OTHER).value.split("_"))


def condition_patch(outcome: Outcome, now: datetime.datetime) -> dict[str, Any] | None:
    """The status patch for a restore's outcome (None for anything else)."""
    if outcome.kind not in (OutcomeKind.RESTORED, OutcomeKind.COLD_START, OutcomeKind.RESTORE_EXITED,
                            OutcomeKind.RESTORE_FAILED):
        return None
    return {
        "metadata": {"uid": outcome.pod_uid},  # precondition: never patch a newer pod of that name
        "status": {"conditions": [{
            "type": CONDITION,
            "status": "True" if outcome.kind is OutcomeKind.RESTORED else "False",
            "reason": condition_reason(outcome),
            "message": _message(outcome.summary()),
            "lastTransitionTime": _time(now),
        }]},
    }


def reports_for(outcome: Outcome, node: str, now: datetime.datetime) -> list[Report]:
    out = [Report("event", outcome.namespace, outcome.pod, event_body(outcome, node, now))]
    patch = condition_patch(outcome, now)
    if patch is not None and outcome.pod_uid:
        out.append(Report("condition", outcome.namespace, outcome.pod, patch))
    return out


INSTALL_HINT = "pip install 'rekindle[kubernetes]' (the plugin image has it)"


def client_missing() -> str | None:
    """Why the Kubernetes client cannot be imported here; None when it can."""
    try:
        import kubernetes.client  # noqa: F401
        import kubernetes.config  # noqa: F401
    except ImportError as exc:
        return str(exc) or type(exc).__name__
    return None


class Unavailable(Exception):
    """The API server could not be reached or asked us to come back later: retry."""


class Rejected(Exception):
    """The API server refused the report (RBAC, validation, the pod is gone): do not retry."""


class Sender(Protocol):
    def send(self, report: Report, timeout: tuple[float, float]) -> None: ...


class ApiSender:
    """Sends reports with the official client; maps its errors to ``Unavailable``/``Rejected``."""

    RETRY_STATUSES = {0, 408, 429, 500, 502, 503, 504}

    def __init__(self, core_v1: Any) -> None:
        self.api = core_v1

    def send(self, report: Report, timeout: tuple[float, float]) -> None:
        from kubernetes.client import CoreV1Event
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError
        try:
            if report.kind == "event":
                # This client sends no Content-Type on a create unless told (the API server would
                # assume JSON; say it).
                self.api.create_namespaced_event(report.namespace, CoreV1Event.from_dict(report.body),
                                                 _headers={"Content-Type": "application/json"},
                                                 _request_timeout=timeout)
            else:
                self.api.patch_namespaced_pod_status(report.pod, report.namespace, report.body,
                                                     _content_type=SMP, _request_timeout=timeout)
        except ApiException as exc:
            status = int(exc.status or 0)
            detail = f"HTTP {status} {exc.reason or ''}".strip()
            if status in self.RETRY_STATUSES:
                raise Unavailable(detail) from None
            raise Rejected(detail) from None
        except (HTTPError, OSError) as exc:
            raise Unavailable(f"{type(exc).__name__}: {exc}") from None
        except ValueError as exc:  # the client's own validation of the body: a bug here, not transient
            raise Rejected(f"invalid {report.kind}: {exc}") from None


def connect(kubeconfig: str = "") -> ApiSender:
    """An ``ApiSender`` from the in-cluster service account, or from a kubeconfig file."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException
    cfg = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            config.load_incluster_config(client_configuration=cfg)
    except (ConfigException, OSError, ValueError) as exc:
        where = kubeconfig or "the in-cluster service account"
        raise ConfigError(f"cannot configure the Kubernetes client from {where}: {exc} (the chart mounts "
                          "a service account token only with events.enabled)") from exc
    cfg.retries = 0  # ours are bounded and back off; urllib3's would not
    return ApiSender(client.CoreV1Api(client.ApiClient(cfg)))


_STOP = object()


class KubeReporter:
    """An ``OutcomeSink``: a bounded queue drained by one worker thread."""

    def __init__(self, sender: Sender, node: str, *, queue_size: int = 256, attempts: int = 4,
                 backoff: float = 0.5, max_backoff: float = 8.0, timeout: tuple[float, float] = (3.0, 10.0),
                 on_sent: Callable[[str], None] = lambda _kind: None,
                 on_drop: Callable[[str], None] = lambda _reason: None,
                 clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.timezone.utc)) -> None:
        self.sender = sender
        self.node = node
        self.attempts = attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.timeout = timeout
        self.on_sent = on_sent
        self.on_drop = on_drop
        self.clock = clock
        self.dropped = 0
        self.sent = 0
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rekindle-k8s-reporter", daemon=True)

    def start(self) -> KubeReporter:
        self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        """Stop retrying; send what is queued once each, for at most ``timeout`` seconds."""
        self._stop.set()
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ OutcomeSink
    def publish(self, outcome: Outcome) -> None:
        for report in reports_for(outcome, self.node, self.clock()):
            try:
                self._queue.put_nowait(report)
            except queue.Full:
                self._drop(report, "queue_full", "the report queue is full")

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            assert isinstance(item, Report)
            try:
                self._send(item)
            except Exception:  # noqa: BLE001 - the worker must outlive any one report
                log.exception("sending %s for %s/%s failed", item.kind, item.namespace, item.pod)
                self._drop(item, "rejected", "unexpected error")

    def _send(self, report: Report) -> None:
        delay = self.backoff
        last = ""
        for attempt in range(1, self.attempts + 1):
            try:
                self.sender.send(report, self.timeout)
            except Rejected as exc:
                self._drop(report, "rejected", str(exc))
                return
            except Unavailable as exc:
                last = str(exc)
                if attempt == self.attempts or self._stop.wait(delay):
                    break
                delay = min(delay * 2, self.max_backoff)
                continue
            self.sent += 1
            self.on_sent(report.kind)
            return
        self._drop(report, "api_unavailable", last)

    def _drop(self, report: Report, reason: str, detail: str) -> None:
        self.dropped += 1
        self.on_drop(reason)
        log.warning("%s/%s: %s not sent (%s): %s", report.namespace, report.pod, report.kind, reason, detail,
                    extra={"namespace": report.namespace, "pod": report.pod, "reason": reason})
