"""Metrics from outcomes, the stub and the Kubernetes reporter; labels from bounded sets only."""

from __future__ import annotations

import math

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nri_plugin.metrics import Metrics
from nri_plugin.outcomes import Outcome, OutcomeKind


def outcome(kind: OutcomeKind, reason: str = "", **kw) -> Outcome:
    return Outcome(kind, "restore", "ns", "p", "uid", "c", "cid", "a", reason=reason, **kw)


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_outcomes_durations_and_bytes(tmp_path):
    m = Metrics(store_path=str(tmp_path))
    m.publish(outcome(OutcomeKind.RESTORED, timings={"stage": 0.3, "criu_restore": 2.9, "total": 3.3},
                      bytes=5 << 20))
    m.publish(outcome(OutcomeKind.PUBLISHED, timings={"criu_dump": 1.0, "publish": 0.2}, bytes=7 << 20))
    m.publish(outcome(OutcomeKind.COLD_START, "artifact ns/a not found in /s"))
    m.publish(outcome(OutcomeKind.COLD_START, "criu restore failed: (-1) with a path /var/x/12345, log at /y"))
    assert value(m, "rekindle_outcomes_total", outcome="restored", reason="none") == 1
    assert value(m, "rekindle_outcomes_total", outcome="published", reason="none") == 1
    assert value(m, "rekindle_outcomes_total", outcome="cold_start", reason="not_found") == 1
    assert value(m, "rekindle_outcomes_total", outcome="cold_start", reason="criu") == 1
    assert value(m, "rekindle_restore_phase_duration_seconds_count", phase="criu_restore") == 1
    assert value(m, "rekindle_restore_duration_seconds_sum") == 3.3
    assert value(m, "rekindle_restore_phase_duration_seconds_count", phase="total") is None
    # no "total" in the timings: the sum of the phases
    assert math.isclose(value(m, "rekindle_checkpoint_duration_seconds_sum"), 1.2)
    assert value(m, "rekindle_checkpoint_phase_duration_seconds_sum", phase="publish") == 0.2
    assert value(m, "rekindle_restored_bytes_total") == 5 << 20
    assert value(m, "rekindle_published_bytes_total") == 7 << 20
    assert value(m, "rekindle_store_free_bytes") > 0
    text = generate_latest(m.registry).decode()
    assert "/var/x" not in text and "not found" not in text  # free text never becomes a label


def test_connection_handlers_and_dropped_reports():
    m = Metrics()
    assert value(m, "rekindle_nri_connected") == 0
    m.connection(True, False)
    assert (value(m, "rekindle_nri_connected"), value(m, "rekindle_nri_synchronized")) == (1, 0)
    m.connection(True, True)
    assert value(m, "rekindle_nri_synchronized") == 1
    m.handler("create_container", 0.004, None)
    m.handler("create_container", 1.7, "overrun")
    assert value(m, "rekindle_nri_handler_duration_seconds_count", handler="create_container") == 2
    assert value(m, "rekindle_nri_handler_failures_total", handler="create_container", kind="overrun") == 1
    assert value(m, "rekindle_kubernetes_reports_dropped_total", reason="queue_full") == 0  # present from start
    m.report_dropped("queue_full")
    m.report_sent("event")
    assert value(m, "rekindle_kubernetes_reports_dropped_total", reason="queue_full") == 1
    assert value(m, "rekindle_kubernetes_reports_sent_total", kind="event") == 1


def test_store_free_bytes_is_nan_without_a_store(tmp_path):
    assert math.isnan(value(Metrics(store_path=str(tmp_path / "missing")), "rekindle_store_free_bytes"))


def _families(m: Metrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}


def test_build_info_is_one_series_at_one():
    from nri_plugin.metrics import BuildInfo, package_version
    m = Metrics(build=BuildInfo(version="1.2.3", criu="4.2.1", driver="580.95.05"))
    assert value(m, "rekindle_build_info", version="1.2.3", criu="4.2.1", driver="580.95.05") == 1
    (sample,) = _families(m)["rekindle_build_info"].samples
    assert sample.value == 1
    # unknown parts say so instead of an empty label
    d = Metrics().registry.get_sample_value
    assert d("rekindle_build_info", {"version": package_version(), "criu": "unknown", "driver": "none"}) == 1


def test_no_created_series_in_the_exposition():
    m = Metrics()
    m.publish(outcome(OutcomeKind.RESTORED, timings={"criu_restore": 1.0}))
    m.handler("create_container", 0.004, None)
    m.report_sent("event")
    text = generate_latest(m.registry).decode()
    assert "rekindle_outcomes_total" in text and "rekindle_restore_duration_seconds_bucket" in text
    assert "_created" not in text, [line for line in text.splitlines() if "_created" in line][:3]


def test_total_and_phase_durations_are_separate_families():
    m = Metrics()
    m.publish(outcome(OutcomeKind.RESTORED, timings={"stage": 1.0, "criu_restore": 2.0, "total": 3.5}))
    fams = _families(m)
    total = fams["rekindle_restore_duration_seconds"]
    phases = fams["rekindle_restore_phase_duration_seconds"]
    assert total.type == phases.type == "histogram"
    assert {tuple(s.labels) for s in total.samples} <= {(), ("le",)}  # no phase label at all
    assert {s.labels["phase"] for s in phases.samples} == {"stage", "criu_restore"}
    # summing the phase family adds the phases only, never the whole flow on top
    assert sum(s.value for s in phases.samples if s.name.endswith("_sum")) == 3.0
    assert value(m, "rekindle_restore_duration_seconds_sum") == 3.5


def test_store_size_and_free_share(tmp_path):
    m = Metrics(store_path=str(tmp_path))
    size, free = value(m, "rekindle_store_size_bytes"), value(m, "rekindle_store_free_bytes")
    assert size > 0 and 0 <= free <= size
