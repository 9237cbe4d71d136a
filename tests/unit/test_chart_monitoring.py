"""The chart's optional PrometheusRule and Grafana dashboard: off by default; every metric they
query is one the plugin really exports (a live registry of nri_plugin.metrics, parsed from its
exposition); the alerts fire, and stay silent, as meant under `promtool test rules` on series
labelled as the plugin labels them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extra")
pytest.importorskip("helm_sdkpy", reason="helm-sdkpy is in the test extra (see docs/install.md)")

from prometheus_client.exposition import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from nri_plugin.metrics import Metrics  # noqa: E402
from nri_plugin.outcomes import Outcome, OutcomeKind, ReasonClass  # noqa: E402
from tests.unit.chart_render import RenderError, by_kind, render  # noqa: E402

NAMESPACE = "kube-system"
ALERTS = {"RekindleColdStartRatioHigh", "RekindleRestoreFailures", "RekindleCheckpointFailures",
          "RekindleNRIDisconnected", "RekindleStoreNearlyFull"}
# Cold starts that are no failure of a restore: nothing to restore yet, a bad annotation, a
# restarted container, or reasons of the checkpoint side.
NOT_RESTORE_FAILURES = {"none", "annotation", "not_found", "already_attempted", "artifact_exists",
                        "several_containers", "not_source_container"}


@pytest.fixture(scope="module")
def default_render() -> dict:
    return render(namespace=NAMESPACE)


@pytest.fixture(scope="module")
def monitoring_render() -> dict:
    return render({"metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
                               "grafanaDashboard": {"enabled": True,
                                                    "annotations": {"grafana_folder": "Rekindle"}}}},
                  namespace=NAMESPACE)


def _rules(r: dict) -> dict[str, dict]:
    (pr,) = by_kind(r["objects"], "PrometheusRule")
    (group,) = pr["spec"]["groups"]
    return {rule["alert"]: rule for rule in group["rules"]}


def _dashboard(r: dict) -> dict:
    (cm,) = [c for c in by_kind(r["objects"], "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    return cm


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


# --- a live registry of the plugin's metrics --------------------------------------------------

def _outcome(kind: OutcomeKind, reason: str = "", **kw) -> Outcome:
    return Outcome(kind, "restore", "ns", "p", "uid", "c", "cid", "a", reason=reason, **kw)


@pytest.fixture(scope="module")
def exposition(tmp_path_factory) -> dict[str, list[dict[str, str]]]:
    """Sample name -> label sets, from the plugin's registry after one of everything."""
    m = Metrics(store_path=str(tmp_path_factory.mktemp("store")))
    m.publish(_outcome(OutcomeKind.RESTORED, timings={"criu_restore": 2.0, "total": 2.5}, bytes=1))
    m.publish(_outcome(OutcomeKind.PUBLISHED, timings={"criu_dump": 1.0}, bytes=1))
    m.publish(_outcome(OutcomeKind.COLD_START, "criu restore failed: (-1)"))
    m.publish(_outcome(OutcomeKind.COLD_START, "artifact ns/a not found in /s"))
    m.publish(_outcome(OutcomeKind.CHECKPOINT_FAILED, "cuda checkpoint failed: lock"))
    m.handler("create_container", 0.01, "overrun")
    m.connection(True, True)
    m.report_sent("event")
    out: dict[str, list[dict[str, str]]] = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append(dict(s.labels))
    return out


def _labels_of(exposition, name: str, **match: str) -> dict[str, str]:
    (labels,) = [ls for ls in exposition[name] if match.items() <= ls.items()]
    return labels


def _names(expr: str) -> set[str]:
    return set(re.findall(r"\brekindle_[a-z0-9_]+", expr))


# --- off by default -----------------------------------------------------------------------------

def test_off_by_default(default_render):
    assert by_kind(default_render["objects"], "PrometheusRule") == []
    assert [c["metadata"]["name"] for c in by_kind(default_render["objects"], "ConfigMap")] == ["rekindle"]


def test_no_rule_without_the_metrics_endpoint():
    r = render({"metrics": {"port": 0, "prometheusRule": {"enabled": True}}}, namespace=NAMESPACE)
    assert by_kind(r["objects"], "PrometheusRule") == []


# --- the PrometheusRule -------------------------------------------------------------------------

def test_rule_object_and_alerts(monitoring_render):
    (pr,) = by_kind(monitoring_render["objects"], "PrometheusRule")
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["metadata"]["labels"]["release"] == "kps"
    assert pr["metadata"]["namespace"] == NAMESPACE
    rules = _rules(monitoring_render)
    assert set(rules) == ALERTS
    for rule in rules.values():
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_rules_query_only_metrics_the_plugin_exports(monitoring_render, exposition):
    used = set().union(*(_names(r["expr"]) for r in _rules(monitoring_render).values()))
    assert used and used <= set(exposition), used - set(exposition)


def test_restore_failures_name_every_failing_reason_class(monitoring_render):
    """A new ReasonClass must be placed: a restore failure (alerted) or not."""
    expr = _rules(monitoring_render)["RekindleRestoreFailures"]["expr"]
    (listed,) = re.findall(r'reason=~"([^"]+)"', expr)
    failing = set(listed.split("|"))
    assert failing | NOT_RESTORE_FAILURES == {c.value for c in ReasonClass}
    assert not failing & NOT_RESTORE_FAILURES


def test_thresholds_and_alert_labels_come_from_the_values():
    r = render({"metrics": {"prometheusRule": {"enabled": True, "coldStartRatio": 0.8, "minRestores": 20,
                                               "storeFreeRatio": 0.25, "alertLabels": {"team": "ml"}}}},
               namespace=NAMESPACE)
    rules = _rules(r)
    assert "> 0.8" in rules["RekindleColdStartRatioHigh"]["expr"]
    assert ">= 20" in rules["RekindleColdStartRatioHigh"]["expr"]
    assert "< 0.25" in rules["RekindleStoreNearlyFull"]["expr"]
    assert all(rule["labels"]["team"] == "ml" for rule in rules.values())


@pytest.mark.parametrize("values, where", [
    ({"coldStartRatio": 1.5}, "coldStartRatio"),
    ({"coldStartRatio": 0}, "coldStartRatio"),
    ({"storeFreeRatio": 1}, "storeFreeRatio"),
    ({"minRestores": 0}, "minRestores"),
    ({"alertLabels": {"team": 1}}, "alertLabels"),
    ({"enabled": True, "for": "5m"}, "for"),
], ids=["ratio-above-1", "ratio-0", "free-ratio-1", "min-restores-0", "label-not-a-string", "unknown-key"])
def test_schema_refuses_rule_values(values, where):
    with pytest.raises(RenderError, match="schema") as exc:
        render({"metrics": {"prometheusRule": values}}, namespace=NAMESPACE)
    assert where in str(exc.value)


# --- the rules under promtool -------------------------------------------------------------------

PROMTOOL = shutil.which("promtool")


def _series(name: str, labels: dict[str, str], **extra: str) -> str:
    body = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, **extra}.items()))
    return f"{name}{{{body}}}"


def _promtool(tmp_path, rules: dict[str, dict], tests: list[dict]) -> subprocess.CompletedProcess:
    rule_file = tmp_path / "rules.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "rekindle", "rules": list(rules.values())}]}))
    test_file = tmp_path / "rules_test.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [rule_file.name], "evaluation_interval": "1m",
                                         "tests": tests}))
    return subprocess.run([PROMTOOL, "test", "rules", str(test_file)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)


def _without_annotations(rules: dict[str, dict]) -> dict[str, dict]:
    # promtool compares annotations too; these tests are about when alerts fire and their labels
    # (test_promtool_checks_the_rules covers the annotation templates).
    return {k: {f: v for f, v in r.items() if f != "annotations"} for k, r in rules.items()}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is missing (hack/install-deps.sh installs it)")
def test_promtool_checks_the_rules(monitoring_render, tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "rekindle",
                                                 "rules": list(_rules(monitoring_render).values())}]}))
    proc = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is missing (hack/install-deps.sh installs it)")
def test_alerts_fire_and_stay_silent_as_meant(monitoring_render, exposition, tmp_path):
    out = "rekindle_outcomes_total"
    restored = _labels_of(exposition, out, outcome="restored")
    criu = _labels_of(exposition, out, outcome="cold_start", reason="criu")
    not_found = _labels_of(exposition, out, outcome="cold_start", reason="not_found")
    cuda = _labels_of(exposition, out, outcome="checkpoint_failed")
    assert cuda["reason"] == "cuda"
    connected = _labels_of(exposition, "rekindle_nri_connected")
    free = _labels_of(exposition, "rekindle_store_free_bytes")
    size = _labels_of(exposition, "rekindle_store_size_bytes")
    n1, n2 = {"instance": "10.0.0.1:9464"}, {"instance": "10.0.0.2:9464"}
    tests = [
        {   # two cold starts (CRIU) for every restore: the ratio alert; the failures by reason
            "interval": "1m",
            "input_series": [
                {"series": _series(out, criu, **n1), "values": "0+2x60"},
                {"series": _series(out, restored, **n1), "values": "0+1x60"},
                {"series": _series(out, not_found, **n2), "values": "0+1x60"},
            ],
            "alert_rule_test": [
                # ratio (2 + 1) / (2 + 1 + 1) = 0.75 > 0.5
                {"eval_time": "45m", "alertname": "RekindleColdStartRatioHigh",
                 "exp_alerts": [{"exp_labels": {"severity": "warning"}}]},
                # only the CRIU failures: an artifact not found is no failure of a restore
                {"eval_time": "45m", "alertname": "RekindleRestoreFailures",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "reason": "criu"}}]},
                {"eval_time": "45m", "alertname": "RekindleCheckpointFailures", "exp_alerts": []},
            ],
        },
        {   # mostly restored: no ratio alert; a few restores only, all cold: none either
            "interval": "1m",
            "input_series": [
                {"series": _series(out, restored, **n1), "values": "0+3x60"},
                {"series": _series(out, not_found, **n1), "values": "0+1x60"},
                {"series": _series(out, restored, **n2), "values": "0x60"},
                {"series": _series(out, not_found, **n2), "values": "0x60"},
            ],
            "alert_rule_test": [
                {"eval_time": "45m", "alertname": "RekindleColdStartRatioHigh", "exp_alerts": []},
                {"eval_time": "45m", "alertname": "RekindleRestoreFailures", "exp_alerts": []},
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                {"series": _series(out, not_found, **n1), "values": "0 0 0 0 0 1 1 1 1 1 2 2 2 2 2 3x40"},
            ],
            "alert_rule_test": [
                {"eval_time": "40m", "alertname": "RekindleColdStartRatioHigh", "exp_alerts": []},
            ],
        },
        {   # a failed checkpoint (CUDA)
            "interval": "1m",
            "input_series": [{"series": _series(out, cuda, **n1), "values": "0 0 0 1 1 1 1 1 1 1"}],
            "alert_rule_test": [
                {"eval_time": "8m", "alertname": "RekindleCheckpointFailures",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "reason": "cuda"}}]},
            ],
        },
        {   # node 1 loses NRI at 3m; node 2 stays connected
            "interval": "1m",
            "input_series": [
                {"series": _series("rekindle_nri_connected", connected, **n1), "values": "1 1 1 0x12"},
                {"series": _series("rekindle_nri_connected", connected, **n2), "values": "1x15"},
            ],
            "alert_rule_test": [
                {"eval_time": "6m", "alertname": "RekindleNRIDisconnected", "exp_alerts": []},  # not 5m yet
                {"eval_time": "10m", "alertname": "RekindleNRIDisconnected",
                 "exp_alerts": [{"exp_labels": {"severity": "critical", **n1}}]},
            ],
        },
        {   # node 1 sees 5% free, node 2 50%
            "interval": "1m",
            "input_series": [
                {"series": _series("rekindle_store_free_bytes", free, **n1), "values": "5x30"},
                {"series": _series("rekindle_store_size_bytes", size, **n1), "values": "100x30"},
                {"series": _series("rekindle_store_free_bytes", free, **n2), "values": "50x30"},
                {"series": _series("rekindle_store_size_bytes", size, **n2), "values": "100x30"},
            ],
            "alert_rule_test": [
                {"eval_time": "10m", "alertname": "RekindleStoreNearlyFull", "exp_alerts": []},  # not 15m yet
                {"eval_time": "20m", "alertname": "RekindleStoreNearlyFull",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", **n1}}]},
            ],
        },
    ]
    proc = _promtool(tmp_path, _without_annotations(_rules(monitoring_render)), tests)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is missing (hack/install-deps.sh installs it)")
def test_the_ratio_threshold_reaches_the_alert(tmp_path, exposition):
    r = render({"metrics": {"prometheusRule": {"enabled": True, "coldStartRatio": 0.8}}}, namespace=NAMESPACE)
    out = "rekindle_outcomes_total"
    tests = [{"interval": "1m",
              "input_series": [
                  {"series": _series(out, _labels_of(exposition, out, outcome="cold_start", reason="criu")),
                   "values": "0+3x60"},
                  {"series": _series(out, _labels_of(exposition, out, outcome="restored")), "values": "0+1x60"}],
              # 0.75 of the restores cold: above the default 0.5, below 0.8
              "alert_rule_test": [{"eval_time": "45m", "alertname": "RekindleColdStartRatioHigh",
                                   "exp_alerts": []}]}]
    proc = _promtool(tmp_path, _without_annotations(_rules(r)), tests)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- the Grafana dashboard ----------------------------------------------------------------------

def test_dashboard_configmap(monitoring_render):
    cm = _dashboard(monitoring_render)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Rekindle"}
    assert cm["metadata"]["namespace"] == NAMESPACE
    dash = json.loads(cm["data"]["rekindle.json"])
    assert dash["uid"] == "rekindle" and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    # every query uses the data source variable, so the dashboard works with any Prometheus
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {"${datasource}"}


def test_dashboard_namespace_and_labels_from_the_values():
    r = render({"metrics": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring",
                                                 "labels": {"grafana_dashboard": "rekindle"}}}},
               namespace=NAMESPACE)
    cm = _dashboard(r)
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "rekindle"


def test_dashboard_queries_only_metrics_the_plugin_exports(monitoring_render, exposition):
    dash = json.loads(_dashboard(monitoring_render)["data"]["rekindle.json"])
    exprs = _exprs(dash) + [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    used = set().union(*(_names(e) for e in exprs))
    assert used and used <= set(exposition), used - set(exposition)
    # each of the alerts' subjects has a panel
    for name in ("rekindle_outcomes_total", "rekindle_restore_duration_seconds_bucket",
                 "rekindle_restore_phase_duration_seconds_bucket", "rekindle_store_free_bytes",
                 "rekindle_nri_connected", "rekindle_build_info"):
        assert name in used
