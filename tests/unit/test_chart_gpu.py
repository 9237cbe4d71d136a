"""charts/rekindle on GPU clusters: node selection, the NRI toggle init container (its script run
with fakes), the render-time cross-value checks, and the worked values files in ci/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extra")
pytest.importorskip("helm_sdkpy", reason="helm-sdkpy is in the test extra (see docs/install.md)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")

from tests.unit.chart_render import CHART, RenderError, by_kind, render  # noqa: E402

K8S_VERSION = "1.33"
NAMESPACE = "kube-system"
GPU_LABELS = ["feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present",
              "nvidia.com/gpu.deploy.device-plugin"]
MIN_INDEX = 50  # the rule values.yaml states for nri.plugin.index


def _pod_spec(r: dict) -> dict:
    (ds,) = by_kind(r["objects"], "DaemonSet")
    return ds["spec"]["template"]["spec"]


def _values_file(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def default_render() -> dict:
    return render(namespace=NAMESPACE)


@pytest.fixture(scope="module")
def gpu_render() -> dict:
    return render(_values_file(CHART / "ci" / "gpu-values.yaml"), namespace=NAMESPACE)


# --- node selection, as the NVIDIA device plugin chart does it ----------------------------------------

def _matches(node_labels: dict[str, str], affinity: dict) -> bool:
    """Kubernetes' rule: any nodeSelectorTerm matches; within one, every expression (In only here)."""
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return any(all(e["operator"] == "In" and node_labels.get(e["key"]) in e["values"] for e in t["matchExpressions"])
               for t in terms)


@pytest.mark.parametrize("labels,scheduled", [
    ({"feature.node.kubernetes.io/pci-10de.present": "true"}, True),   # node-feature-discovery
    ({"nvidia.com/gpu.present": "true"}, True),                        # GPU Operator / by hand
    ({"nvidia.com/gpu.deploy.device-plugin": "true"}, True),           # GPU Operator operand label
    ({"nvidia.com/gpu.present": "false"}, False),
    ({"kubernetes.io/os": "linux"}, False),                            # a CPU node
], ids=["nfd", "gpu-present", "operator-deploy", "gpu-present-false", "cpu-node"])
def test_default_affinity_picks_gpu_nodes_by_any_usual_label(default_render, labels, scheduled):
    spec = _pod_spec(default_render)
    assert "nodeSelector" not in spec
    assert _matches(labels, spec["affinity"]) is scheduled
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert sorted(e["key"] for t in terms for e in t["matchExpressions"]) == sorted(GPU_LABELS)


def test_default_tolerations(default_render):
    assert _pod_spec(default_render)["tolerations"] == [
        {"key": "CriticalAddonsOnly", "operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]


def test_node_selection_is_overridable():
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["inference"]}]}]}}}
    r = render({"affinity": own, "nodeSelector": {"zone": "a"}, "tolerations": [{"operator": "Exists"}]},
               namespace=NAMESPACE)
    spec = _pod_spec(r)
    assert spec["affinity"] == own  # the user's terms replace the GPU terms (lists are not merged)
    assert spec["nodeSelector"] == {"zone": "a"} and spec["tolerations"] == [{"operator": "Exists"}]
    r = render({"affinity": None}, namespace=NAMESPACE)
    assert "affinity" not in _pod_spec(r)


# --- the NRI toggle init container ---------------------------------------------------------------------

def _toggle(r: dict) -> dict:
    (init,) = _pod_spec(r)["initContainers"]
    assert init["name"] == "nri-toggle"
    return init


def test_gpu_values_toggle_uses_a_drop_in_through_the_hosts_root(gpu_render):
    init = _toggle(gpu_render)
    assert init["securityContext"]["privileged"] is True
    assert _pod_spec(gpu_render)["hostPID"] is True  # /proc/1 is the node's init
    script = init["command"][-1]
    assert ("rekindle nri-toggle --json --host-root /proc/1/root --config /etc/containerd/config.toml "
            "--drop-in /etc/containerd/conf.d/99-rekindle-nri.toml --socket-path /var/run/nri/nri.sock") in script
    assert "volumeMounts" not in init  # no hostPath: nothing is created on a node the toggle refuses
    assert not [v for v in _pod_spec(gpu_render)["volumes"] if "containerd-config" in v["name"]]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in init["env"]
    assert "conf.d/99-rekindle-nri.toml" in gpu_render["notes"] and "k3s and RKE2" in gpu_render["notes"]
    assert "NOT restarted" not in gpu_render["notes"]


def test_in_place_mode_and_no_restart():
    r = render({"nri": {"patchConfig": True, "configMode": "inPlace", "containerdConfigDir": "/etc/containerd/"}},
               namespace=NAMESPACE)
    script = _toggle(r)["command"][-1]
    assert "--config /etc/containerd/config.toml --socket-path" in script and "--drop-in" not in script
    assert "systemctl" not in script and "sleep" not in script
    assert "NOT restarted" in r["notes"]


def _run_script(script: str, tmp_path: Path, toggle_output: str, node: str = "gpu-node-7") -> tuple[int, list[str]]:
    """Run the init container's script with fake rekindle, nsenter and sleep that record their calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    calls.write_text("")
    (bin_dir / "rekindle").write_text(f"#!/bin/sh\necho \"rekindle $*\" >>{calls}\ncat <<'J'\n{toggle_output}\nJ\n")
    for tool in ("nsenter", "sleep"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho \"{tool} $*\" >>{calls}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:/usr/bin:/bin", "NODE_NAME": node}
    res = subprocess.run(["/bin/sh", "-ec", script], env=env, capture_output=True, text=True)
    return res.returncode, calls.read_text().splitlines()


RESTART = "nsenter --target 1 --mount -- systemctl restart containerd"


@pytest.mark.parametrize("toggle_output,restarted,rc", [
    ('{"changed": true, "restart_needed": true, "nri_live": false}', True, 0),
    # NRI already serving at the socket (containerd 2.x): writing the drop-in needs no restart
    ('{"changed": true, "restart_needed": true, "nri_live": true}', False, 0),
    # an earlier run changed the config but never restarted: restart now
    ('{"changed": false, "restart_needed": false, "nri_live": false}', True, 0),
    ('{"changed": false, "restart_needed": false, "nri_live": true}', False, 0),
    ("config.toml: NRI enabled", False, 1),  # not the JSON contract: fail, do not guess
], ids=["changed", "changed-live", "interrupted", "nothing", "not-json"])
def test_toggle_script_restarts_only_while_nri_is_not_live(gpu_render, tmp_path, toggle_output, restarted, rc):
    init = _toggle(gpu_render)
    assert init["command"][:2] == ["/bin/sh", "-ec"]
    code, log = _run_script(init["command"][2], tmp_path, toggle_output)
    assert code == rc
    assert log[0].startswith("rekindle nri-toggle --json --host-root /proc/1/root ")
    if restarted:
        assert log[-1] == RESTART
        (sleep,) = [c for c in log if c.startswith("sleep ")]
        assert 0 <= int(sleep.split()[1]) < 600  # ci/gpu-values.yaml: restartSpreadSeconds 600
        assert log.index(sleep) < log.index(RESTART)
    else:
        assert RESTART not in log and not [c for c in log if c.startswith("sleep ")]


def test_restart_delay_is_spread_by_node_name_and_stable(gpu_render, tmp_path):
    script = _toggle(gpu_render)["command"][2]
    out = '{"changed": true, "restart_needed": true, "nri_live": false}'

    def delay(node: str) -> int:
        _, log = _run_script(script, tmp_path, out, node)
        (sleep,) = [c for c in log if c.startswith("sleep ")]
        return int(sleep.split()[1])

    delays = {n: delay(n) for n in (f"gpu-{i}" for i in range(8))}
    assert delay("gpu-3") == delays["gpu-3"]  # the same node always waits the same time
    assert len(set(delays.values())) > 1  # nodes do not all restart at once


def test_no_delay_when_spread_is_zero(tmp_path):
    r = render({"nri": {"patchConfig": True, "restartContainerd": True, "restartSpreadSeconds": 0}},
               namespace=NAMESPACE)
    script = _toggle(r)["command"][-1]
    _, log = _run_script(script, tmp_path, '{"changed": true, "restart_needed": true, "nri_live": false}')
    assert log[1:] == [RESTART]


# --- cross-value checks that fail the render ---------------------------------------------------------

BAD = [
    ("bind source repeats the state dir",
     {"hostBindSources": ["/var/lib/kubelet", "/var/lib/rekindle/"]},
     "hostBindSources: /var/lib/rekindle/ is already mounted by the chart (stateDir)"),
    ("bind source repeats containerd's state dir",
     {"hostBindSources": ["/run/containerd"]},
     "hostBindSources: /run/containerd is already mounted by the chart (containerd.stateDir)"),
    ("bind source listed twice with a trailing slash",
     {"hostBindSources": ["/run/nvidia", "/run/nvidia/"]},
     "hostBindSources: /run/nvidia is listed twice"),
    ("ReadWriteOnce store on many nodes",
     {"store": {"type": "pvc", "pvc": {"create": True, "accessModes": ["ReadWriteOnce"]}}},
     "store.pvc.accessModes ReadWriteOnce: a ReadWriteOnce claim mounts on one node only"),
    ("ReadWriteOncePod store on many nodes",
     {"store": {"type": "pvc", "pvc": {"create": True, "accessModes": ["ReadWriteOncePod"]}}},
     "or set store.singleNode=true if the DaemonSet runs on one node only"),
    ("restart without the toggle",
     {"nri": {"restartContainerd": True}},
     "nri.restartContainerd=true needs nri.patchConfig=true"),
    ("restart with a wide rolling update",
     {"nri": {"patchConfig": True, "restartContainerd": True},
      "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%"}}},
     "updateStrategy maxUnavailable 25%, maxSurge 0: an update would restart containerd on several nodes at once"),
    ("restart with surge",
     {"nri": {"patchConfig": True, "restartContainerd": True},
      "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 2}}},
     "updateStrategy maxUnavailable 0, maxSurge 2"),
    ("placeholder image",
     {"image": {"name": "localhost/rekindle/plugin"}},
     "image.name localhost/rekindle/plugin is a placeholder: push the plugin image"),
]


@pytest.mark.parametrize("values,message", [(v, m) for _, v, m in BAD], ids=[n for n, _, _ in BAD])
def test_render_fails_with_a_clear_message(values, message):
    with pytest.raises(RenderError) as exc:
        render(values, namespace=NAMESPACE)
    assert message in str(exc.value)
    assert "rekindle values:" in str(exc.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(RenderError) as exc:
        render({"image": {"name": "localhost/x"}, "nri": {"restartContainerd": True},
                "hostBindSources": ["/sys/fs/cgroup"]}, namespace=NAMESPACE)
    msg = str(exc.value)
    assert "image.name localhost/x" in msg and "needs nri.patchConfig" in msg and "/sys/fs/cgroup" in msg


GOOD = [
    ("local image allowed", {"image": {"name": "localhost/rekindle/plugin", "allowLocal": True}}),
    ("RWO on one node", {"store": {"type": "pvc", "singleNode": True,
                                   "pvc": {"create": True, "accessModes": ["ReadWriteOnce"]}}}),
    ("RWO with RWX", {"store": {"type": "pvc", "pvc": {"create": True,
                                                       "accessModes": ["ReadWriteMany", "ReadWriteOnce"]}}}),
    ("RWO claim not created here", {"store": {"type": "pvc", "pvc": {"create": False, "name": "mine",
                                                                     "accessModes": ["ReadWriteOnce"]}}}),
    ("restart, OnDelete", {"nri": {"patchConfig": True, "restartContainerd": True},
                           "updateStrategy": {"type": "OnDelete", "rollingUpdate": None}}),
    ("restart, maxUnavailable 1 as a string", {"nri": {"patchConfig": True, "restartContainerd": True},
                                               "updateStrategy": {"rollingUpdate": {"maxUnavailable": "1"}}}),
    ("bind source below a chart mount", {"hostBindSources": ["/var/lib/kubelet", "/run/containerd/io"]}),
]


@pytest.mark.parametrize("values", [v for _, v in GOOD], ids=[n for n, _ in GOOD])
def test_allowed_combinations_render(values):
    r = render(values, namespace=NAMESPACE)
    for obj in r["objects"]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_chart_mount_is_known_to_the_bind_source_check(default_render):
    """A mount added to the plugin container must be in rekindle.chartMounts, or a duplicate
    hostBindSources entry would slip through to a pod the API server rejects."""
    (ds,) = by_kind(default_render["objects"], "DaemonSet")
    (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "rekindle"]
    own = [m["mountPath"] for m in c["volumeMounts"] if not m["name"].startswith("bind-source-")]
    assert own
    for path in own:
        with pytest.raises(RenderError, match=re.escape(f"hostBindSources: {path} is already mounted by the chart")):
            render({"hostBindSources": [path]}, namespace=NAMESPACE)


# --- the worked values files ------------------------------------------------------------------------

CI_FILES = sorted((CHART / "ci").glob("*.yaml"))


def test_the_index_rule_is_the_documented_one():
    text = (CHART / "values.yaml").read_text()
    assert f"keep the index at least {MIN_INDEX}" in re.sub(r"\s+#\s+", " ", text)
    assert yaml.safe_load(text)["nri"]["plugin"]["index"] >= MIN_INDEX


@pytest.mark.parametrize("path", CI_FILES, ids=[p.name for p in CI_FILES])
def test_ci_values_follow_the_index_rule_and_render(path):
    values = _values_file(path)
    index = (values.get("nri") or {}).get("plugin", {}).get("index")
    assert index is None or index >= MIN_INDEX, f"{path.name}: nri.plugin.index {index} < {MIN_INDEX}"
    r = render(values, namespace=NAMESPACE)
    for obj in r["objects"]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_shipped_values_do_not_install_the_placeholder_image():
    with pytest.raises(RenderError, match="image.name localhost/rekindle/plugin is a placeholder"):
        render(namespace=NAMESPACE, registry_image=False)


def test_gpu_values_size_the_memory_limit_for_the_cache_tmpfs(gpu_render):
    """The worked example sets the cache's bytes and a limit that holds them: no warning."""
    (c,) = [c for c in _pod_spec(gpu_render)["containers"] if c["name"] == "rekindle"]
    args = c["args"]
    assert args[args.index("--cache-bytes") + 1] == "64Gi" and "--cache-tmpfs" in args
    assert c["resources"]["limits"]["memory"] == "72Gi"
    assert "settings.cache.bytes auto" not in gpu_render["notes"]
