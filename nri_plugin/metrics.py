"""Prometheus metrics of the plugin, in one registry of its own (never the global one).

``Metrics`` is an ``OutcomeSink`` (outcomes, durations by phase, bytes) and a stub observer
(NRI connection state, handler latency); the Kubernetes reporter counts what it drops through
``report_dropped``. Every label value comes from a fixed set (enums, phase and handler names
of this code), never from free text, so the series stay bounded.

Exposed by ``nri_plugin.httpd`` at ``/metrics``:

  rekindle_build_info{version,criu,driver}        gauge, always 1: the plugin's version, CRIU's, the
                                                  CUDA driver's ("none" on a node without one)
  rekindle_restore_duration_seconds               histogram: whole restores
  rekindle_checkpoint_duration_seconds            histogram: whole checkpoints (ready to published)
  rekindle_restore_phase_duration_seconds{phase}      histogram, one series per phase of a restore
  rekindle_checkpoint_phase_duration_seconds{phase}   histogram, one series per phase of a checkpoint
  rekindle_outcomes_total{outcome,reason}         counter (reason: outcomes.ReasonClass)
  rekindle_restored_bytes_total                   counter: artifact bytes restored
  rekindle_published_bytes_total                  counter: artifact bytes published
  rekindle_store_free_bytes                       gauge, read at scrape time (free to non-root)
  rekindle_store_size_bytes                       gauge, read at scrape time (the filesystem's size)
  rekindle_nri_connected, rekindle_nri_synchronized   gauges (0/1)
  rekindle_nri_handler_duration_seconds{handler}  histogram
  rekindle_nri_handler_failures_total{handler,kind}   counter (kind: error, overrun)
  rekindle_kubernetes_reports_sent_total{kind}    counter (kind: event, condition)
  rekindle_kubernetes_reports_dropped_total{reason}   counter (queue_full, api_unavailable, rejected)
  rekindle_housekeeping_failures_total{step}      counter (store_sweep, restore_copies, logs, status)
  rekindle_store_bad_leftovers                    gauge: leftovers past the walk's bounds, last sweep

The totals and the phases are separate families, so that a sum over a family's series never
adds a whole flow to its own parts. No ``*_created`` series: a scraper gets nothing from them
but twice the series of every counter and histogram.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from .outcomes import NOT_PHASES, Outcome, OutcomeKind

if TYPE_CHECKING:
    from .prewarm_state import Status as PrewarmStatus

# Process-wide in prometheus_client; nothing of ours wants them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Seconds: handler replies are due within 2 s; restores of GPU artifacts take minutes.
HANDLER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.6, 2.0, 5.0)
PREWARM_STATES = ("absent", "warming", "warm", "refused")  # nri_plugin.prewarm_state.State
HOUSEKEEPING_STEPS = ("store_sweep", "restore_copies", "logs", "status")  # nri_plugin.agent's steps
FLOW_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def package_version() -> str:
    try:
        return metadata.version("rekindle")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


@dataclass(frozen=True)
class BuildInfo:
    """What runs on this node; one value per label per process, so one series."""

    version: str = ""
    criu: str = ""
    driver: str = ""  # the CUDA driver's version, "" when the node has none

    def labels(self) -> tuple[str, str, str]:
        return (self.version or package_version(), self.criu or "unknown", self.driver or "none")


class Metrics:
    def __init__(self, store_path: str | None = None, registry: CollectorRegistry | None = None,
                 build: BuildInfo = BuildInfo()) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.build_info = Gauge("rekindle_build_info", "1, labelled with the versions running on this node",
                                ["version", "criu", "driver"], registry=r)
        self.build_info.labels(*build.labels()).set(1)
        self.restore_seconds = Histogram(
            "rekindle_restore_duration_seconds", "Duration of whole restores", buckets=FLOW_BUCKETS, registry=r)
        self.checkpoint_seconds = Histogram(
            "rekindle_checkpoint_duration_seconds", "Duration of whole checkpoints, ready to published",
            buckets=FLOW_BUCKETS, registry=r)
        self.restore_phase_seconds = Histogram(
            "rekindle_restore_phase_duration_seconds", "Duration of the phases of restores, by phase",
            ["phase"], buckets=FLOW_BUCKETS, registry=r)
        self.checkpoint_phase_seconds = Histogram(
            "rekindle_checkpoint_phase_duration_seconds", "Duration of the phases of checkpoints, by phase",
            ["phase"], buckets=FLOW_BUCKETS, registry=r)
        self.outcomes = Counter(
            "rekindle_outcomes", "Final outcomes of annotated containers, by outcome and reason class",
            ["outcome", "reason"], registry=r)
        self.restored_bytes = Counter("rekindle_restored_bytes", "Artifact bytes restored into containers",
                                      registry=r)
        self.published_bytes = Counter("rekindle_published_bytes", "Artifact bytes published by checkpoints",
                                       registry=r)
        self.store_free = Gauge("rekindle_store_free_bytes", "Free bytes on the artifact store's filesystem",
                                registry=r)
        self.store_free.set_function(lambda: _statvfs_bytes(store_path, free=True))
        self.store_size = Gauge("rekindle_store_size_bytes", "Size of the artifact store's filesystem",
                                registry=r)
        self.store_size.set_function(lambda: _statvfs_bytes(store_path, free=False))
        self.nri_connected = Gauge("rekindle_nri_connected", "1 while registered with the runtime over NRI",
                                   registry=r)
        self.nri_synchronized = Gauge("rekindle_nri_synchronized",
                                      "1 once the runtime synchronized the plugin on this connection", registry=r)
        self.handler_seconds = Histogram(
            "rekindle_nri_handler_duration_seconds", "Time from an NRI request to the plugin's reply, by handler",
            ["handler"], buckets=HANDLER_BUCKETS, registry=r)
        self.handler_failures = Counter(
            "rekindle_nri_handler_failures", "Handlers answered empty (fail-open), by handler and kind",
            ["handler", "kind"], registry=r)
        self.reports_sent = Counter("rekindle_kubernetes_reports_sent",
                                    "Events and pod-condition patches accepted by the API server", ["kind"],
                                    registry=r)
        self.reports_dropped = Counter(
            "rekindle_kubernetes_reports_dropped",
            "Events and pod-condition patches given up (queue full, API unavailable, rejected)", ["reason"],
            registry=r)
        self.housekeeping_failures = Counter(
            "rekindle_housekeeping_failures", "Housekeeping steps that failed (the others still ran), by step",
            ["step"], registry=r)
        self.store_bad_leftovers = Gauge(
            "rekindle_store_bad_leftovers",
            "Store leftovers whose tree is past the walk's bounds (too deep, too many entries), last sweep",
            registry=r)
        self.prewarm_state = Gauge(
            "rekindle_prewarm_state", "1 for each marked artifact's pre-warm state on this node (absent, warming, "
            "warm, refused), 0 for the others", ["artifact", "state"], registry=r)
        self.prewarm_bytes = Gauge("rekindle_prewarm_bytes",
                                   "Bulk bytes of a marked artifact's entry written so far on this node", ["artifact"],
                                   registry=r)
        self.prewarm_rate = Gauge("rekindle_prewarm_rate_bytes",
                                  "Bytes a second a marked artifact's warm-up writes (pauses for restores not counted)",
                                  ["artifact"], registry=r)
        self._prewarmed: set[str] = set()
        for outcome in (OutcomeKind.RESTORED, OutcomeKind.PUBLISHED):  # at 0 from the first scrape
            self.outcomes.labels(outcome.value, "none")
        for reason in ("queue_full", "api_unavailable", "rejected"):
            self.reports_dropped.labels(reason)
        for step in HOUSEKEEPING_STEPS:
            self.housekeeping_failures.labels(step)

    def prewarm(self, states: Sequence[PrewarmStatus]) -> None:
        """Each marked artifact's state on this node (``nri_plugin.prewarm``); one no longer marked goes."""
        now = {s.artifact for s in states}
        for gone in self._prewarmed - now:
            for st in PREWARM_STATES:
                self.prewarm_state.remove(gone, st)
            self.prewarm_bytes.remove(gone)
            self.prewarm_rate.remove(gone)
        for s in states:
            for st in PREWARM_STATES:
                self.prewarm_state.labels(s.artifact, st).set(1 if s.state.value == st else 0)
            self.prewarm_bytes.labels(s.artifact).set(s.bytes)
            self.prewarm_rate.labels(s.artifact).set(s.rate)
        self._prewarmed = now

    # ------------------------------------------------------------------ OutcomeSink
    def publish(self, outcome: Outcome) -> None:
        self.outcomes.labels(outcome.kind.value, outcome.reason_class.value).inc()
        if outcome.kind is OutcomeKind.RESTORED:
            self._durations(self.restore_seconds, self.restore_phase_seconds, outcome)
            self.restored_bytes.inc(outcome.bytes)
        elif outcome.kind is OutcomeKind.PUBLISHED:
            self._durations(self.checkpoint_seconds, self.checkpoint_phase_seconds, outcome)
            self.published_bytes.inc(outcome.bytes)

    @staticmethod
    def _durations(total: Histogram, phases: Histogram, outcome: Outcome) -> None:
        total.observe(outcome.seconds)  # the flow's "total" timing, else the sum of its phases
        for phase, seconds in outcome.timings.items():
            if phase not in NOT_PHASES:
                phases.labels(phase).observe(seconds)

    # ------------------------------------------------------------------ stub observer
    def connection(self, connected: bool, synchronized: bool) -> None:
        self.nri_connected.set(1 if connected else 0)
        self.nri_synchronized.set(1 if synchronized else 0)

    def handler(self, name: str, seconds: float, failure: str | None) -> None:
        self.handler_seconds.labels(name).observe(seconds)
        if failure is not None:
            self.handler_failures.labels(name, failure).inc()

    # ------------------------------------------------------------------ Kubernetes reporter
    def report_sent(self, kind: str) -> None:
        self.reports_sent.labels(kind).inc()

    def report_dropped(self, reason: str) -> None:
        self.reports_dropped.labels(reason).inc()

    # ------------------------------------------------------------------ housekeeping
    def housekeeping_failed(self, step: str) -> None:
        self.housekeeping_failures.labels(step).inc()


def _statvfs_bytes(path: str | None, free: bool) -> float:
    if not path:
        return math.nan
    try:
        st = os.statvfs(path)
    except OSError:
        return math.nan
    return float((st.f_bavail if free else st.f_blocks) * st.f_frsize)
