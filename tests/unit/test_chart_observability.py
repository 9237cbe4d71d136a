"""charts/rekindle: what makes outcomes visible in Kubernetes: the RBAC and token only with
events.enabled, the metrics port and scrape annotations, the probes on /readyz and /healthz,
and the optional PodMonitor / ServiceMonitor. Rendered by the Helm library (helm-sdkpy) and
checked against the Kubernetes API's schemas (kubernetes-validate)."""

from __future__ import annotations

import pytest

pytest.importorskip("yaml", reason="pyyaml is in the test extra")
pytest.importorskip("helm_sdkpy", reason="helm-sdkpy is in the test extra (see docs/install.md)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")

from tests.unit.chart_render import RenderError, by_kind, render  # noqa: E402

K8S_VERSION = "1.33"
NAMESPACE = "kube-system"


@pytest.fixture(scope="module")
def default_render() -> dict:
    return render(namespace=NAMESPACE)


@pytest.fixture(scope="module")
def events_render() -> dict:
    return render({"events": {"enabled": True}}, namespace=NAMESPACE)


@pytest.fixture(scope="module")
def monitors_render() -> dict:
    return render({"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}},
                               "serviceMonitor": {"enabled": True, "interval": "15s"}}}, namespace=NAMESPACE)


def _pod_spec(r: dict) -> dict:
    (ds,) = by_kind(r["objects"], "DaemonSet")
    return ds["spec"]["template"]["spec"]


def _plugin(r: dict) -> dict:
    (c,) = [c for c in _pod_spec(r)["containers"] if c["name"] == "rekindle"]
    return c


def _validate_core(objects: list[dict]) -> None:
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in the Kubernetes API
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# --- events: RBAC and token only when enabled ------------------------------------------------

def test_no_rbac_and_no_token_by_default(default_render):
    kinds = {o["kind"] for o in default_render["objects"]}
    assert not kinds & {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    spec = _pod_spec(default_render)
    assert spec["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in spec
    assert "--events" not in _plugin(default_render)["args"]


def test_events_enabled_brings_minimal_rbac_and_a_token(events_render):
    objects = events_render["objects"]
    _validate_core(objects)
    (sa,) = by_kind(objects, "ServiceAccount")
    (role,) = by_kind(objects, "ClusterRole")
    (binding,) = by_kind(objects, "ClusterRoleBinding")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
    ]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": NAMESPACE}]
    spec = _pod_spec(events_render)
    assert spec["serviceAccountName"] == sa["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is True
    args = _plugin(events_render)["args"]
    assert "--events" in args
    # The node name for the Events' source comes from the downward API.
    env = {e["name"]: e for e in _plugin(events_render)["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Helm sent exactly these objects
    assert {(o["kind"], o["metadata"]["name"]) for o in events_render["created"]} >= {
        ("ServiceAccount", sa["metadata"]["name"]), ("ClusterRole", role["metadata"]["name"]),
        ("ClusterRoleBinding", binding["metadata"]["name"])}


# --- metrics port, scrape annotations, probes ------------------------------------------------

def test_metrics_port_scrape_annotations_and_probes(default_render):
    c = _plugin(default_render)
    args = c["args"]
    assert args[args.index("--metrics-port") + 1] == "9464"
    assert c["ports"] == [{"name": "metrics", "containerPort": 9464, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    (ds,) = by_kind(default_render["objects"], "DaemonSet")
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert (ann["prometheus.io/scrape"], ann["prometheus.io/port"], ann["prometheus.io/path"]) == \
        ("true", "9464", "/metrics")
    assert not by_kind(default_render["objects"], "PodMonitor")
    assert not by_kind(default_render["objects"], "ServiceMonitor")
    assert not by_kind(default_render["objects"], "Service")


def test_metrics_port_zero_turns_endpoint_annotations_and_probes_off():
    r = render({"metrics": {"port": 0, "serviceMonitor": {"enabled": True}}}, namespace=NAMESPACE)
    c = _plugin(r)
    assert c["args"][c["args"].index("--metrics-port") + 1] == "0"
    for key in ("ports", "readinessProbe", "livenessProbe", "startupProbe"):
        assert key not in c
    (ds,) = by_kind(r["objects"], "DaemonSet")
    assert not any(k.startswith("prometheus.io/") for k in ds["spec"]["template"]["metadata"]["annotations"])
    assert not by_kind(r["objects"], "ServiceMonitor") and not by_kind(r["objects"], "Service")


def test_pod_and_service_monitors_when_asked(monitors_render):
    objects = monitors_render["objects"]
    _validate_core(objects)
    (pm,) = by_kind(objects, "PodMonitor")
    (sm,) = by_kind(objects, "ServiceMonitor")
    (svc,) = by_kind(objects, "Service")
    (ds,) = by_kind(objects, "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["apiVersion"] == sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    assert pm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9464, "targetPort": "metrics", "protocol": "TCP"}]


@pytest.mark.parametrize("values, where", [
    ({"metrics": {"port": 70000}}, "port"),
    ({"metrics": {"port": 9464, "podMonitor": {"interval": "soon"}}}, "interval"),
    ({"events": {"enabled": "yes"}}, "enabled"),
    ({"events": {"enabled": False, "rbac": True}}, "rbac"),
], ids=["port-out-of-range", "bad-interval", "enabled-not-bool", "unknown-key"])
def test_schema_rejects(values, where):
    with pytest.raises(RenderError) as err:
        render(values, namespace=NAMESPACE)
    assert where in str(err.value)


def test_plugin_accepts_the_rendered_flags(events_render):
    """The DaemonSet's args parse with the plugin's own parser, into these settings."""
    from nri_plugin.cli import _settings, build_parser
    args = build_parser().parse_args(_plugin(events_render)["args"])
    settings = _settings(args)
    assert (settings.report.metrics_port, settings.report.events) == (9464, True)
