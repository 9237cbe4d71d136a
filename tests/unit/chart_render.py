"""Render charts/rekindle with the Helm library (PyPI's helm-sdkpy).

helm-sdkpy exposes `install`, `lint` and friends but no `template`; its install
always talks to a cluster. So the chart is installed against a small fake
Kubernetes API server on 127.0.0.1 that answers discovery, says 404 for every
GET of an object (or returns the objects it was seeded with, which is how
`lookup` is exercised) and records every object Helm creates. Release records
stay in memory (HELM_DRIVER=memory). Nothing leaves the process.

Like a real cluster it has the namespace kube-system (and the release's), so
`lookup` of it finds one; ``render(cluster=False)`` is a render that cannot see
the cluster (`helm template`, Argo CD), where every `lookup` comes back empty.
``hide`` drops API group/versions from discovery (an older cluster).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rekindle"

_CORE = [
    ("configmaps", "ConfigMap", True),
    ("secrets", "Secret", True),
    ("persistentvolumeclaims", "PersistentVolumeClaim", True),
    ("pods", "Pod", True),
    ("services", "Service", True),
    ("serviceaccounts", "ServiceAccount", True),
    ("namespaces", "Namespace", False),
]
_GROUPS = {
    ("apps", "v1"): [("daemonsets", "DaemonSet", True), ("deployments", "Deployment", True)],
    ("rbac.authorization.k8s.io", "v1"): [
        ("roles", "Role", True),
        ("rolebindings", "RoleBinding", True),
        ("clusterroles", "ClusterRole", False),
        ("clusterrolebindings", "ClusterRoleBinding", False),
    ],
    ("scheduling.k8s.io", "v1"): [("priorityclasses", "PriorityClass", False)],
    ("networking.k8s.io", "v1"): [("networkpolicies", "NetworkPolicy", True)],
    # GA in Kubernetes 1.30.
    ("admissionregistration.k8s.io", "v1"): [
        ("validatingadmissionpolicies", "ValidatingAdmissionPolicy", False),
        ("validatingadmissionpolicybindings", "ValidatingAdmissionPolicyBinding", False),
    ],
    ("node.k8s.io", "v1"): [("runtimeclasses", "RuntimeClass", False)],
    # The Prometheus Operator's CRDs, for the optional PodMonitor / ServiceMonitor.
    ("monitoring.coreos.com", "v1"): [("podmonitors", "PodMonitor", True),
                                      ("servicemonitors", "ServiceMonitor", True),
                                      ("prometheusrules", "PrometheusRule", True)],
}
_VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def _resource_list(group_version: str, resources) -> dict:
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": [
            {"name": n, "singularName": k.lower(), "namespaced": ns, "kind": k, "verbs": _VERBS}
            for n, k, ns in resources
        ],
    }


class FakeAPIServer:
    """Just enough of kube-apiserver for `helm install` (client-side apply)."""

    def __init__(self, objects: list[dict] | None = None, hide: list[str] | None = None):
        self.seeded = {self._key_of(o): o for o in objects or []}
        self.groups = {gv: res for gv, res in _GROUPS.items() if "/".join(gv) not in (hide or [])}
        self.created: list[dict] = []
        self.requests: list[tuple[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _send(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                server.requests.append(("GET", self.path))
                self._send(*server.get(self.path.split("?")[0]))

            def do_POST(self):
                server.requests.append(("POST", self.path))
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                server.created.append(body)
                self._send(201, body)

            def _update(self):
                # Helm adopts an object it finds (same release): answer with it.
                server.requests.append((self.command, self.path))
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                self._send(*server.get(self.path.split("?")[0]))

            def _reject(self):
                server.requests.append((self.command, self.path))
                self._send(405, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                 "reason": "MethodNotAllowed", "code": 405})

            do_PUT = do_PATCH = _update
            do_DELETE = _reject

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @staticmethod
    def _key_of(obj: dict) -> tuple[str, str, str]:
        md = obj.get("metadata", {})
        return (obj["kind"], md.get("namespace", ""), md["name"])

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeAPIServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def get(self, path: str) -> tuple[int, Any]:
        if path == "/version":
            return 200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0", "platform": "linux/amd64"}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            groups = {}
            for g, v in self.groups:
                gv = {"groupVersion": f"{g}/{v}", "version": v}
                groups.setdefault(g, {"name": g, "versions": [], "preferredVersion": gv})["versions"].append(gv)
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": list(groups.values())}
        if path == "/api/v1":
            return 200, _resource_list("v1", _CORE)
        m = re.fullmatch(r"/apis/([^/]+)/([^/]+)", path)
        if m and (m[1], m[2]) in self.groups:
            return 200, _resource_list(f"{m[1]}/{m[2]}", self.groups[(m[1], m[2])])
        kinds = {n: k for n, k, _ in _CORE}
        for res in self.groups.values():
            kinds.update({n: k for n, k, _ in res})
        # A single object: /api/v1/namespaces/NS/RES/NAME or /apis/G/V/namespaces/NS/RES/NAME,
        # or a cluster-scoped one: /api/v1/RES/NAME or /apis/G/V/RES/NAME
        m = re.fullmatch(r"/(?:api/v1|apis/[^/]+/[^/]+)/namespaces/([^/]+)/([^/]+)/([^/]+)", path)
        c = re.fullmatch(r"/(?:api/v1|apis/[^/]+/[^/]+)/([^/]+)/([^/]+)", path)
        key = (kinds.get(m[2], ""), m[1], m[3]) if m else (kinds.get(c[1], ""), "", c[2]) if c else None
        obj = self.seeded.get(key) if key else None
        if obj is not None:
            return 200, obj
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                     "reason": "NotFound", "code": 404, "message": f"{path} not found"}


def _kubeconfig(url: str, namespace: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {"token": "fake"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
        "current-context": "fake",
    })


def _load_helm():
    # The Go runtime inside helm-sdkpy copies the environment when the library
    # loads, so HELM_DRIVER must be set before the process starts: the Helm
    # calls run in a child process (see render()).
    if os.environ.get("HELM_DRIVER") != "memory":
        raise RuntimeError("HELM_DRIVER=memory must be set when the process starts")
    import helm_sdkpy  # noqa: PLC0415 (optional test dependency)

    return helm_sdkpy


class RenderError(Exception):
    pass


def _namespace(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def _render_here(values: dict | None, release: str, namespace: str, seed: list[dict] | None, cluster: bool,
                 hide: list[str] | None) -> dict[str, Any]:
    helm = _load_helm()
    if cluster:
        seed = [_namespace("kube-system"), _namespace(namespace), *(seed or [])]
    with FakeAPIServer(seed if cluster else None, hide) as api:
        cfg = helm.Configuration(namespace=namespace, kubeconfig=_kubeconfig(api.url, namespace))
        try:
            rel = asyncio.run(helm.Install(cfg).run(release, str(CHART), values=values or None, wait=False,
                                                    timeout=60))
        except helm.HelmError as e:
            return {"error": str(e)}
        created = list(api.created)
    manifest = rel.get("manifest", "")
    objects = [o for o in yaml.safe_load_all(manifest) if o]
    return {"objects": objects, "created": created, "notes": rel.get("info", {}).get("notes", ""),
            "manifest": manifest}


def _lint_here() -> dict[str, Any]:
    helm = _load_helm()
    cfg = helm.Configuration(namespace="kube-system", kubeconfig=_kubeconfig("http://127.0.0.1:1", "kube-system"))
    return asyncio.run(helm.Lint(cfg).run(str(CHART)))


def _child(request: dict) -> dict[str, Any]:
    env = dict(os.environ, HELM_DRIVER="memory")
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(request), capture_output=True, text=True,
                          env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"helm child failed ({proc.returncode}): {proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


# The chart refuses its localhost/ placeholder image; renders use this one unless told otherwise.
REGISTRY_IMAGE = "registry.example.com/rekindle/plugin"


def merge(base: dict, over: dict) -> dict:
    """over on top of base, maps merged key by key (a None in over stays: Helm drops that key)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def render(values: dict | None = None, *, release: str = "rekindle", namespace: str = "kube-system",
           seed: list[dict] | None = None, registry_image: bool = True, cluster: bool = True,
           hide: list[str] | None = None) -> dict[str, Any]:
    """Install the chart against a fake API server, in a child process.

    Returns {"objects": [rendered objects], "created": [objects POSTed to the
    server], "notes": NOTES.txt text, "manifest": the raw manifest}.
    Raises RenderError with Helm's message when Helm refuses (schema, template).
    With registry_image, image.name defaults to REGISTRY_IMAGE instead of the placeholder.
    cluster=False: every `lookup` is empty, as in `helm template` (seed is ignored).
    hide: API group/versions (e.g. "admissionregistration.k8s.io/v1") the cluster does not serve.
    """
    if registry_image:
        values = merge({"image": {"name": REGISTRY_IMAGE}}, values or {})
    out = _child({"op": "render", "values": values, "release": release, "namespace": namespace, "seed": seed,
                  "cluster": cluster, "hide": hide})
    if "error" in out:
        raise RenderError(out["error"])
    return out


def lint() -> dict[str, Any]:
    """`helm lint` of the chart with its default values."""
    return _child({"op": "lint"})


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o.get("kind") == kind]


if __name__ == "__main__":
    req = json.load(sys.stdin)
    if req["op"] == "lint":
        result = _lint_here()
    else:
        result = _render_here(req.get("values"), req["release"], req["namespace"], req.get("seed"),
                              req.get("cluster", True), req.get("hide"))
    json.dump(result, sys.stdout)
