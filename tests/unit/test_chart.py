"""charts/rekindle rendered by the Helm library (helm-sdkpy) and checked
against the Kubernetes API schemas (kubernetes-validate)."""

from __future__ import annotations

import base64
import copy
import os

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extra")
pytest.importorskip("helm_sdkpy", reason="helm-sdkpy is in the test extra (see docs/install.md)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")

from tests.unit import chart_render  # noqa: E402
from tests.unit.chart_render import CHART, RenderError, by_kind, render  # noqa: E402

K8S_VERSION = "1.33"
NAMESPACE = "kube-system"


def _values_file(name: str) -> dict:
    return yaml.safe_load((CHART / "ci" / name).read_text())


@pytest.fixture(scope="module")
def default_render() -> dict:
    return render(namespace=NAMESPACE)


@pytest.fixture(scope="module")
def gpu_render() -> dict:
    return render(_values_file("gpu-values.yaml"), namespace=NAMESPACE)


@pytest.fixture(scope="module")
def kind_render() -> dict:
    return render(_values_file("kind-values.yaml"), namespace=NAMESPACE)


def _daemonset(r: dict) -> dict:
    (ds,) = by_kind(r["objects"], "DaemonSet")
    return ds


def _plugin(ds: dict) -> dict:
    (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "rekindle"]
    return c


def _mounts(container: dict, pod_spec: dict) -> dict[str, tuple[dict, dict]]:
    """mountPath -> (volumeMount, volume)."""
    vols = {v["name"]: v for v in pod_spec["volumes"]}
    return {m["mountPath"]: (m, vols[m["name"]]) for m in container["volumeMounts"]}


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# --- helm lint ----------------------------------------------------------------------------------

def test_helm_lint_clean():
    # Helm lints in its lint mode, where `fail` (templates/validate.yaml) only logs.
    result = chart_render.lint()
    assert result["TotalChartsLinted"] == 1
    assert not result["Errors"], result
    # Severity: 1 info, 2 warning, 3 error
    assert [m for m in result["Messages"] if m["Severity"] >= 2] == [], result


# --- every rendered object is a valid Kubernetes object ----------------------------------------

@pytest.mark.parametrize("which", ["default_render", "gpu_render", "kind_render"])
def test_objects_validate_against_kubernetes_schemas(which, request):
    r = request.getfixturevalue(which)
    assert r["objects"]
    for obj in r["objects"]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # what Helm sent to the API server is what it rendered
    assert sorted((o["kind"], o["metadata"]["name"]) for o in r["created"]) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in r["objects"]
    )


# --- default values ------------------------------------------------------------------------------

def test_default_objects(default_render):
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in default_render["objects"])
    assert kinds == [
        ("ConfigMap", "rekindle"),
        ("DaemonSet", "rekindle"),
        ("PersistentVolumeClaim", "rekindle-store"),
        ("Secret", "rekindle-hmac"),
    ]
    for o in default_render["objects"]:
        assert o["metadata"]["namespace"] == NAMESPACE
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "rekindle"
        assert labels["app.kubernetes.io/instance"] == "rekindle"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "rekindle-0.1.0"


def test_daemonset_pod_is_privileged_node_critical_on_gpu_nodes(default_render):
    ds = _daemonset(default_render)
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["automountServiceAccountToken"] is False
    assert "nodeSelector" not in spec  # GPU nodes are chosen by affinity (test_chart_gpu.py)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert "initContainers" not in spec  # the NRI toggle is opt-in
    c = _plugin(ds)
    assert c["securityContext"]["privileged"] is True
    assert c["image"] == "registry.example.com/rekindle/plugin:0.1.0"  # tag defaults to appVersion
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert c["resources"]["limits"]["memory"] == "4Gi"
    # selector labels are a subset of the pod labels
    sel = ds["spec"]["selector"]["matchLabels"]
    assert sel.items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_plugin_command_is_the_cli_contract(default_render):
    c = _plugin(_daemonset(default_render))
    assert c["command"] + c["args"] == [
        "rekindle", "plugin",
        "--socket-path", "/var/run/nri/nri.sock",
        "--name", "rekindle",
        "--idx", "90",
        "--state-dir", "/var/lib/rekindle",
        "--store", "/var/lib/rekindle/store",
        "--containerd-socket", "/run/containerd/containerd.sock",
        "--containerd-state", "/run/containerd",
        "--hmac-key-file", "/etc/rekindle/hmac.key",
        "--log-format", "json",
        "--restore-path", "auto",
        "--fill-threads", "0",
        "--max-parallel", "2",
        "--max-layer-bytes", "8Gi",
        "--bulk-min-run", "4Ki",
        "--capture-timeout", "600",
        "--checkpoint-thp", "keep",
        "--max-probes-per-pod", "1",
        "--max-probes", "16",
        "--cache-bytes", "auto",
        "--cache-entries", "8",
        "--cache-tmpfs",
        "--map-ranges", "driver",
        "--prewarm-interval", "30",
        "--metrics-port", "9464",
        "--metrics-address", "$(POD_IP)",
    ]  # logLevel info: no --verbose; prefetch: no --no-prefetch; events.enabled false: no --events


def test_gpu_values_add_the_driver_dir_as_bind_source(gpu_render):
    ds = _daemonset(gpu_render)
    m = _mounts(_plugin(ds), ds["spec"]["template"]["spec"])
    assert m["/run/nvidia"][1]["hostPath"]["path"] == "/run/nvidia"


def test_mounts(default_render):
    ds = _daemonset(default_render)
    spec = ds["spec"]["template"]["spec"]
    m = _mounts(_plugin(ds), spec)
    expected_host = {
        "/var/run/nri": "/var/run/nri",
        "/run/containerd": "/run/containerd",
        "/var/lib/containerd": "/var/lib/containerd",
        "/host/proc": "/proc",
        "/sys/fs/cgroup": "/sys/fs/cgroup",
        "/var/lib/rekindle": "/var/lib/rekindle",
        "/var/lib/kubelet": "/var/lib/kubelet",  # pod volumes: bind sources CRIU re-creates
    }
    for path, host in expected_host.items():
        mount, vol = m[path]
        assert vol["hostPath"]["path"] == host, path
    assert m["/var/run/nri"][0]["readOnly"] is True
    assert m["/var/lib/containerd"][0]["readOnly"] is True
    assert m["/run/containerd"][0]["mountPropagation"] == "HostToContainer"
    assert m["/var/lib/kubelet"][0]["mountPropagation"] == "HostToContainer"
    assert m["/var/lib/kubelet"][0]["readOnly"] is True
    assert not m["/var/lib/rekindle"][0].get("readOnly")
    # the store is the chart's RWX claim
    store_mount, store_vol = m["/var/lib/rekindle/store"]
    assert store_vol["persistentVolumeClaim"]["claimName"] == "rekindle-store"
    # the HMAC key, from the Secret, at the path the CLI is given
    key_mount, key_vol = m["/etc/rekindle"]
    assert key_mount["readOnly"] is True
    assert key_vol["secret"]["secretName"] == "rekindle-hmac"
    assert key_vol["secret"]["items"] == [{"key": "hmac.key", "path": "hmac.key"}]
    assert key_vol["secret"]["defaultMode"] == 0o400
    # nothing but the listed host paths, the store and the key
    assert set(m) == set(expected_host) | {"/var/lib/rekindle/store", "/etc/rekindle"}


def test_secret_is_32_random_bytes_and_kept(default_render):
    (secret,) = by_kind(default_render["objects"], "Secret")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(secret["data"]["hmac.key"], validate=True)) == 32
    other = render(namespace=NAMESPACE)
    (secret2,) = by_kind(other["objects"], "Secret")
    assert secret2["data"]["hmac.key"] != secret["data"]["hmac.key"]


def test_existing_secret_in_cluster_is_kept():
    """`lookup` finds the Secret an earlier install of the release left behind
    (helm.sh/resource-policy: keep) and reuses its key."""
    key = base64.b64encode(bytes(range(32))).decode()
    existing = {"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "rekindle-hmac", "namespace": NAMESPACE,
                             "labels": {"app.kubernetes.io/managed-by": "Helm"},
                             "annotations": {"meta.helm.sh/release-name": "rekindle",
                                             "meta.helm.sh/release-namespace": NAMESPACE,
                                             "helm.sh/resource-policy": "keep"}},
                "type": "Opaque", "data": {"hmac.key": key}}
    r = render(namespace=NAMESPACE, seed=[existing])
    (secret,) = by_kind(r["objects"], "Secret")
    assert secret["data"]["hmac.key"] == key


def test_existing_secret_name_is_used_and_not_created():
    """GitOps: the user's Secret, mounted like the chart's own; no Secret (no new key) rendered."""
    r = render({"hmac": {"existingSecret": "my-key", "secretKey": "key"}}, namespace=NAMESPACE)
    assert by_kind(r["objects"], "Secret") == []
    for obj in r["objects"]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    spec = _daemonset(r)["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "hmac-key"]
    assert vol["secret"] == {"secretName": "my-key", "defaultMode": 0o400,
                             "items": [{"key": "key", "path": "hmac.key"}]}
    assert "your Secret my-key" in r["notes"]
    # the same render twice is the same render: nothing random left
    again = render({"hmac": {"existingSecret": "my-key", "secretKey": "key"}}, namespace=NAMESPACE)
    assert again["objects"] == r["objects"]


def test_chart_managed_secret_warns_about_renderers_without_lookup(default_render):
    (secret,) = by_kind(default_render["objects"], "Secret")
    spec = _daemonset(default_render)["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "hmac-key"]
    assert vol["secret"]["secretName"] == secret["metadata"]["name"] == "rekindle-hmac"
    assert "hmac.existingSecret" in default_render["notes"]


def test_every_command_in_the_pod_finds_the_plugins_key(default_render):
    """The plugin reads the mounted Secret and never creates a key; `kubectl exec ... rekindle ...`
    finds the same file through REKINDLE_HMAC_KEY_FILE."""
    ds = _daemonset(default_render)
    c = _plugin(ds)
    key_file = _flag(c["args"], "--hmac-key-file")
    assert "--create-key" not in c["args"]
    assert {"name": "REKINDLE_HMAC_KEY_FILE", "value": key_file} in c["env"]
    mount, vol = _mounts(c, ds["spec"]["template"]["spec"])[os.path.dirname(key_file)]
    assert vol["secret"]["items"] == [{"key": "hmac.key", "path": os.path.basename(key_file)}]
    assert mount["readOnly"] is True and vol["secret"]["defaultMode"] == 0o400


def test_pvc_created_rwx_and_kept(default_render):
    (pvc,) = by_kind(default_render["objects"], "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "500Gi"
    assert "storageClassName" not in pvc["spec"]  # the cluster default
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_existing_pvc_not_created():
    r = render({"store": {"type": "pvc", "pvc": {"create": False, "name": "shared-ckpt"}}}, namespace=NAMESPACE)
    assert by_kind(r["objects"], "PersistentVolumeClaim") == []
    spec = _daemonset(r)["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "store"]
    assert vol["persistentVolumeClaim"]["claimName"] == "shared-ckpt"


def test_configmap_settings(default_render):
    (cm,) = by_kind(default_render["objects"], "ConfigMap")
    assert cm["data"] == {"REKINDLE_LOG_LEVEL": "info", "REKINDLE_RESTORE_TIMEOUT": "1800"}
    c = _plugin(_daemonset(default_render))
    assert c["envFrom"] == [{"configMapRef": {"name": "rekindle"}}]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in c["env"]


def test_config_change_rolls_the_pods(default_render):
    r = render({"settings": {"logLevel": "debug", "logFormat": "json", "restoreTimeoutSeconds": 1800}},
               namespace=NAMESPACE)
    a = _daemonset(default_render)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    b = _daemonset(r)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert a != b


def test_notes(default_render):
    notes = default_render["notes"]
    assert "DaemonSet kube-system/rekindle" in notes
    assert "index 90" in notes
    assert "rekindle.dev/checkpoint" in notes and "rekindle.dev/restore" in notes
    assert "/var/lib/rekindle/status/" in notes
    assert "nri.patchConfig=true" in notes


# --- GPU values -----------------------------------------------------------------------------------

def test_gpu_values(gpu_render):
    ds = _daemonset(gpu_render)
    spec = ds["spec"]["template"]["spec"]
    c = _plugin(ds)
    assert _flag(c["args"], "--idx") == "90"
    assert c["args"][-1] == "--verbose"  # logLevel: debug
    assert c["image"] == "registry.example.com/rekindle/plugin:0.1.0"
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in c["env"]
    (pvc,) = by_kind(gpu_render["objects"], "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == "nfs-rwx"
    (cm,) = by_kind(gpu_render["objects"], "ConfigMap")
    assert cm["data"]["REKINDLE_RESTORE_TIMEOUT"] == "3600"


def test_index_two_digits():
    for idx, want in [(50, "50"), (77, "77"), (99, "99")]:
        r = render({"nri": {"plugin": {"index": idx}}}, namespace=NAMESPACE)
        assert _flag(_plugin(_daemonset(r))["args"], "--idx") == want


# --- kind (GPU-less demo) values -----------------------------------------------------------------

def test_kind_values(kind_render):
    ds = _daemonset(kind_render)
    spec = ds["spec"]["template"]["spec"]
    assert "nodeSelector" not in spec and "affinity" not in spec  # every kind node
    assert by_kind(kind_render["objects"], "PersistentVolumeClaim") == []
    (vol,) = [v for v in spec["volumes"] if v["name"] == "store"]
    assert vol["hostPath"]["path"] == "/var/lib/rekindle/store"
    c = _plugin(ds)
    assert c["image"] == "localhost/rekindle/plugin:0.1.0"  # image.allowLocal: loaded onto the nodes
    assert c["imagePullPolicy"] == "Never"
    assert _flag(c["args"], "--log-format") == "text"


# --- values the schema rejects -------------------------------------------------------------------

BAD_VALUES = [
    ("index 100", {"nri": {"plugin": {"index": 100}}}, "/nri/plugin/index"),
    ("index -1", {"nri": {"plugin": {"index": -1}}}, "/nri/plugin/index"),
    # below 50: before plugins that adjust containers (the GPU Operator's CDI NRI plugin)
    ("index 7", {"nri": {"plugin": {"index": 7}}}, "/nri/plugin/index"),
    ("index 49", {"nri": {"plugin": {"index": 49}}}, "/nri/plugin/index"),
    ("index not an integer", {"nri": {"plugin": {"index": "90"}}}, "/nri/plugin/index"),
    ("logFormat xml", {"settings": {"logFormat": "xml"}}, "/settings/logFormat"),
    ("logLevel trace", {"settings": {"logLevel": "trace"}}, "/settings/logLevel"),
    ("logLevel warning (the CLI has -v only)", {"settings": {"logLevel": "warning"}}, "/settings/logLevel"),
    ("store.type nfs", {"store": {"type": "nfs"}}, "/store/type"),
    ("pullPolicy sometimes", {"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ("missing image.name", {"image": {"name": None}}, "/image"),
    ("empty image.name", {"image": {"name": ""}}, "/image/name"),
    ("restore timeout 0", {"settings": {"restoreTimeoutSeconds": 0}}, "/settings/restoreTimeoutSeconds"),
    ("restore timeout > 1 day", {"settings": {"restoreTimeoutSeconds": 86401}}, "/settings/restoreTimeoutSeconds"),
    ("relative stateDir", {"stateDir": "var/lib/rekindle"}, "/stateDir"),
    ("unknown top-level key", {"sotre": {"type": "pvc"}}, "sotre"),
    ("patchConfig not a bool", {"nri": {"patchConfig": "yes"}}, "/nri/patchConfig"),
    ("existingSecret not a Secret name", {"hmac": {"existingSecret": "My_Key"}}, "/hmac/existingSecret"),
]


@pytest.mark.parametrize("values,where", [(v, w) for _, v, w in BAD_VALUES], ids=[n for n, _, _ in BAD_VALUES])
def test_schema_rejects(values, where):
    with pytest.raises(RenderError, match="schema") as exc:
        render(copy.deepcopy(values), namespace=NAMESPACE)
    assert where in str(exc.value)


# --- the rendered command is one the plugin's CLI accepts ----------------------------------------

@pytest.mark.parametrize("which", ["default_render", "gpu_render", "kind_render"])
def test_cli_accepts_rendered_args(which, request):
    from nri_plugin.cli import build_parser

    c = _plugin(_daemonset(request.getfixturevalue(which)))
    assert c["command"] == ["rekindle"]
    args = build_parser().parse_args(c["args"])
    assert args.command == "plugin"
    assert len(args.idx) == 2 and args.idx.isdigit()
    assert args.hmac_key_file == "/etc/rekindle/hmac.key"
    assert args.store == "/var/lib/rekindle/store"
