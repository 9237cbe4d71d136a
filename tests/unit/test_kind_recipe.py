"""hack/kind: the recipe cannot run here (no docker daemon, no cluster), so its
files are checked: they parse, the kind config switches NRI on, the demo pods
are valid Kubernetes objects with valid Rekindle annotations, and the script
uses the chart's kind values."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extra")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")

from nri_plugin import policy  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KIND = REPO / "hack" / "kind"
K8S_VERSION = "1.33"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_kind_config_enables_nri():
    (cfg,) = _docs(KIND / "kind-config.yaml")
    assert cfg["kind"] == "Cluster"
    assert cfg["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    assert any(n["role"] == "worker" for n in cfg["nodes"])
    patches = [tomllib.loads(p) for p in cfg["containerdConfigPatches"]]
    nri = [p["plugins"]["io.containerd.nri.v1.nri"] for p in patches
           if "io.containerd.nri.v1.nri" in p.get("plugins", {})]
    assert nri and nri[-1]["disable"] is False
    assert nri[-1].get("socket_path", "/var/run/nri/nri.sock") == "/var/run/nri/nri.sock"


def _pods() -> list[dict]:
    return _docs(KIND / "demo-pod.yaml")


def test_demo_pods_validate_against_kubernetes_schemas():
    pods = _pods()
    assert [p["kind"] for p in pods] == ["Pod", "Pod"]
    for pod in pods:
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_demo_pods_annotations_are_valid():
    intents = {}
    for pod in _pods():
        ann = pod["metadata"]["annotations"]
        for c in pod["spec"]["containers"]:
            intent = policy.decide(ann, c["name"])  # raises on a bad annotation
            assert intent is not None, pod["metadata"]["name"]
            intents[pod["metadata"]["labels"]["rekindle-demo"]] = intent
    src, dst = intents["source"], intents["restore"]
    assert src.role is policy.Role.CHECKPOINT and dst.role is policy.Role.RESTORE
    assert src.artifact == dst.artifact  # the restore pod uses the source's artifact
    assert src.ready_probe.kind is policy.ProbeKind.FILE


def test_demo_pods_match_each_other():
    """A restore needs the same image, command and namespace as its source."""
    src, dst = _pods()
    assert src["metadata"]["namespace"] == dst["metadata"]["namespace"]
    (a,), (b,) = src["spec"]["containers"], dst["spec"]["containers"]
    assert (a["name"], a["image"], a["command"]) == (b["name"], b["image"], b["command"])
    # the workload says when it is ready, through the control dir Rekindle gives it
    assert "REKINDLE_CONTROL_DIR" in a["command"][-1] and "ready-for-checkpoint" in a["command"][-1]


def test_annotation_names_follow_design_doc():
    names = {k for p in _pods() for k in p["metadata"]["annotations"]}
    design = (REPO / "docs" / "design.md").read_text()
    for key in names:
        assert f"`{key}`" in design, key
    for p in _pods():
        for k, v in p["metadata"]["annotations"].items():
            if k in (policy.CHECKPOINT, policy.RESTORE):
                assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", v) and len(v) <= 63


def test_up_script():
    script = KIND / "up.sh"
    assert script.stat().st_mode & 0o111, "up.sh must be executable"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for needle in ("kind create cluster", "hack/kind/kind-config.yaml", "docker build", "kind load docker-image",
                   "helm upgrade --install", "charts/rekindle/ci/kind-values.yaml", "hack/kind/demo-pod.yaml"):
        assert needle in text, needle
    # the image it builds is the one the kind values select
    values = yaml.safe_load((REPO / "charts" / "rekindle" / "ci" / "kind-values.yaml").read_text())
    assert "image=" + values["image"]["name"] + ":$version" in text
    assert values["image"]["pullPolicy"] == "Never"
