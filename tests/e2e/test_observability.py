"""What a checkpoint and a restore show outside the node, from the real plugin against the real
containerd sandbox: metrics scraped over HTTP, /readyz, Events and the pod condition sent to an
http.server playing the Kubernetes API server (through --kubeconfig), JSON log lines with
fields, and `rekindle doctor` connecting to NRI and containerd."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.e2e.plugin_process import REPO, PluginProcess
from tests.e2e.test_checkpoint_restore import COUNTER, SERVER, checkpoint_source, wait_http, wait_status
from tests.plugin.fake_apiserver import FakeApiServer
from tests.waiting import wait_for

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
K8S_VERSION = "1.33"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def api():
    with FakeApiServer() as server:
        yield server


@pytest.fixture(scope="module")
def plugin(sandbox, tmp_path_factory, api):
    work = tmp_path_factory.mktemp("obs")
    port = _free_port()
    p = PluginProcess(sandbox, work / "plugin", extra_args=[
        "--metrics-port", str(port), "--metrics-address", "127.0.0.1", "--log-format", "json",
        "--events", "--kubeconfig", str(api.kubeconfig(work / "kubeconfig")), "--node-name", "node-e2e"])
    p.port = port  # type: ignore[attr-defined]
    p.start()
    yield p
    p.stop()


def http(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(port: int) -> dict[str, float]:
    """The exposition as {'name{labels}': value}, labels as written."""
    code, text = http(port, "/metrics")
    assert code == 200
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def wait_metric(port: int, key: str, at_least: float, timeout: float = 30.0) -> dict[str, float]:
    def reached() -> dict[str, float] | None:
        m = scrape(port)
        return m if m.get(key, 0.0) >= at_least else None
    return wait_for(reached, timeout, f"{key} >= {at_least}", interval=0.2)


def events_for(api: FakeApiServer, pod: str, reason: str, timeout: float = 30.0) -> dict:
    def event() -> dict | None:
        return next((r.body for r in list(api.requests) if r.method == "POST"
                     and r.body["involvedObject"]["name"] == pod and r.body["reason"] == reason), None)
    return wait_for(event, timeout, f"a {reason} event for {pod}", interval=0.2)


def status_patch(api: FakeApiServer, pod: str, timeout: float = 30.0):
    found = wait_for(lambda: [r for r in list(api.requests)
                              if r.method == "PATCH" and r.path.endswith(f"/pods/{pod}/status")],
                     timeout, f"a status patch for {pod}", interval=0.2)
    (patch,) = found
    return patch


def test_readyz_metrics_events_and_logs_after_a_checkpoint_and_a_restore(sandbox, pod, plugin, api):
    port = plugin.port
    code, text = http(port, "/readyz")
    assert code == 200 and "synchronized" in text, text
    assert http(port, "/healthz")[0] == 200
    before = scrape(port)
    published = 'rekindle_outcomes_total{outcome="published",reason="none"}'
    restored = 'rekindle_outcomes_total{outcome="restored",reason="none"}'

    a, _cid, _ip = checkpoint_source(sandbox, pod, plugin, "obs-a", warmup_mib=16)
    b = pod("dst-obs-a", annotations={"rekindle.dev/restore": "obs-a"})
    sandbox.run_container(b, "server", COUNTER, command=SERVER)
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"})
    assert st["phase"] == "restored", st
    wait_http(sandbox.cri.pod_ip(b.id))

    m = wait_metric(port, restored, before.get(restored, 0) + 1)
    assert m[published] == before.get(published, 0) + 1
    assert m['rekindle_restore_phase_duration_seconds_count{phase="criu_restore"}'] >= 1
    assert m["rekindle_restore_duration_seconds_count"] >= 1
    assert m['rekindle_checkpoint_phase_duration_seconds_count{phase="criu_dump"}'] >= 1
    assert m["rekindle_checkpoint_duration_seconds_count"] >= 1
    (build,) = [k for k in m if k.startswith("rekindle_build_info{")]
    assert m[build] == 1 and 'criu="4.' in build, build
    assert not [k for k in m if "_created" in k]
    assert m["rekindle_restored_bytes_total"] >= 16 << 20 > 0
    assert m["rekindle_published_bytes_total"] >= 16 << 20
    assert m['rekindle_nri_handler_duration_seconds_count{handler="create_container"}'] >= 2
    assert m["rekindle_nri_connected"] == 1 and m["rekindle_nri_synchronized"] == 1
    assert m["rekindle_store_free_bytes"] > 0
    assert m['rekindle_kubernetes_reports_dropped_total{reason="api_unavailable"}'] == 0

    # Events and the condition, as the API server received them, valid by its own schemas.
    ev = events_for(api, a.name, "CheckpointPublished")
    kubernetes_validate.validate(ev, K8S_VERSION, strict=True)
    assert ev["type"] == "Normal" and ev["message"].startswith("default/obs-a (")
    assert ev["involvedObject"]["uid"] == a.uid and ev["source"]["host"] == "node-e2e"
    ev = events_for(api, b.name, "Restored")
    kubernetes_validate.validate(ev, K8S_VERSION, strict=True)
    assert ev["message"].startswith("from default/obs-a in ") and "criu" in ev["message"]
    patch = status_patch(api, b.name)
    assert patch.content_type == "application/strategic-merge-patch+json"
    assert patch.body["metadata"]["uid"] == b.uid
    (cond,) = patch.body["status"]["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("rekindle.dev/Restored", "True", "Restored")
    pod_obj = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": b.name, "namespace": "default"},
               "spec": {"containers": [{"name": "server", "image": COUNTER}]}}
    merged = copy.deepcopy(pod_obj)
    merged["metadata"].update(patch.body["metadata"])
    merged["status"] = patch.body["status"]
    kubernetes_validate.validate(merged, K8S_VERSION, strict=True)
    wait_metric(port, 'rekindle_kubernetes_reports_sent_total{kind="condition"}', 1)
    m = wait_metric(port, 'rekindle_kubernetes_reports_sent_total{kind="event"}', 2)
    assert m['rekindle_kubernetes_reports_dropped_total{reason="rejected"}'] == 0

    # JSON log lines carry the pod, artifact, phase and seconds (the engine's too).
    lines = [json.loads(line) for line in plugin.log().splitlines() if line.startswith("{")]
    criu = [x for x in lines if x.get("phase") == "criu_restore" and x.get("pod") == b.name]
    assert criu and criu[0]["artifact"] == "obs-a" and criu[0]["namespace"] == "default"
    assert criu[0]["container"] == "server" and isinstance(criu[0]["seconds"], float)
    created = [x for x in lines if x.get("event") == "create_container" and x.get("pod") == b.name]
    assert created, "the create handler's lines carry the NRI event"


def test_doctor_connects_to_nri_and_containerd(sandbox, plugin):
    res = subprocess.run(
        [sys.executable, "-m", "nri_plugin", "doctor", "-o", "json",
         "--socket-path", str(sandbox.nri_socket), "--containerd-socket", str(sandbox.containerd_socket),
         "--containerd-config", str(sandbox.dir / "config.toml"),
         "--state-dir", str(plugin.state_dir), "--store", str(plugin.store),
         "--hmac-key-file", str(plugin.state_dir / "hmac.key")],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    checks = {c["name"]: c for c in json.loads(res.stdout)}
    assert checks["nri-socket"]["ok"] and "ttrpc exchange ok" in checks["nri-socket"]["detail"], checks
    assert checks["containerd-api"]["ok"] and "containerd" in checks["containerd-api"]["detail"], checks
    assert checks["nri-config"]["ok"], checks
    assert checks["store"]["ok"] and checks["hmac-key"]["ok"] and checks["criu"]["ok"], checks
    # The doctor's exchange registered nothing: the plugin is still the only one and still ready.
    assert http(plugin.port, "/readyz")[0] == 200
