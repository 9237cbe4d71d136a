"""charts/rekindle at the trust boundary: where the metrics endpoint listens and who may reach
it, the admission policy that keeps each node's plugin to the pods of its node, and the HMAC
key under renders that cannot see the cluster. Rendered by the Helm library (helm-sdkpy); the
policy's CEL expressions are evaluated by cel-python against crafted admission requests."""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("yaml", reason="pyyaml is in the test extra")
pytest.importorskip("helm_sdkpy", reason="helm-sdkpy is in the test extra (see docs/install.md)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
celpy = pytest.importorskip("celpy", reason="cel-python is in the test extra")

from tests.unit.chart_render import RenderError, by_kind, render  # noqa: E402

K8S_VERSION = "1.33"
NAMESPACE = "kube-system"
NODE_CLAIM = "authentication.kubernetes.io/node-name"
PLUGIN_USER = f"system:serviceaccount:{NAMESPACE}:rekindle"
VAP_API = "admissionregistration.k8s.io/v1"


def _plugin(r: dict) -> dict:
    (ds,) = by_kind(r["objects"], "DaemonSet")
    (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "rekindle"]
    return c


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _validate(objects: list[dict]) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.fixture(scope="module")
def default_render() -> dict:
    return render(namespace=NAMESPACE)


@pytest.fixture(scope="module")
def events_render() -> dict:
    return render({"events": {"enabled": True}}, namespace=NAMESPACE)


# --- where the metrics endpoint listens ---------------------------------------------------------

def test_metrics_listen_on_the_pod_ip_by_default(default_render):
    from nri_plugin.cli import build_parser

    c = _plugin(default_render)
    assert _flag(c["args"], "--metrics-address") == "$(POD_IP)"  # the kubelet expands it
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    args = build_parser().parse_args([a.replace("$(POD_IP)", "10.1.2.3") for a in c["args"]])
    assert args.metrics_address == "10.1.2.3"


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "fd00::1"])
def test_metrics_address_is_configurable(address):
    r = render({"metrics": {"address": address}}, namespace=NAMESPACE)
    assert _flag(_plugin(r)["args"], "--metrics-address") == address
    _validate(r["objects"])


def test_metrics_off_passes_no_address():
    r = render({"metrics": {"port": 0}}, namespace=NAMESPACE)
    assert "--metrics-address" not in _plugin(r)["args"]


@pytest.mark.parametrize("address", ["127.0.0.1", "::1"])
def test_loopback_address_is_refused(address):
    with pytest.raises(RenderError, match="metrics.address .* loopback"):
        render({"metrics": {"address": address}}, namespace=NAMESPACE)


# --- who may reach it ---------------------------------------------------------------------------

PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_no_network_policy_by_default(default_render):
    assert by_kind(default_render["objects"], "NetworkPolicy") == []


def test_network_policy_admits_only_the_listed_sources_to_the_metrics_port():
    r = render({"metrics": {"port": 9500, "networkPolicy": {"enabled": True,
                                                            "from": [PROMETHEUS, {"ipBlock": {"cidr": "10.0.0.0/8"}}]}}},
               namespace=NAMESPACE)
    (np,) = by_kind(r["objects"], "NetworkPolicy")
    _validate([np])
    (ds,) = by_kind(r["objects"], "DaemonSet")
    assert np["spec"]["podSelector"]["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
    assert np["spec"]["policyTypes"] == ["Ingress"]
    assert np["spec"]["ingress"] == [{"from": [PROMETHEUS, {"ipBlock": {"cidr": "10.0.0.0/8"}}],
                                      "ports": [{"port": 9500, "protocol": "TCP"}]}]


def test_network_policy_without_sources_is_refused():
    # An ingress rule without `from` admits every source: the opposite of what was asked.
    with pytest.raises(RenderError, match="networkPolicy.from"):
        render({"metrics": {"networkPolicy": {"enabled": True}}}, namespace=NAMESPACE)


def test_no_network_policy_without_the_endpoint():
    r = render({"metrics": {"port": 0, "networkPolicy": {"enabled": True, "from": [PROMETHEUS]}}},
               namespace=NAMESPACE)
    assert by_kind(r["objects"], "NetworkPolicy") == []


# --- pods/status of the plugin's own node only --------------------------------------------------

class Policy:
    """A rendered ValidatingAdmissionPolicy, evaluated as the API server does for one request:
    not matched unless every matchCondition is true; denied at the first validation that is
    false or fails to evaluate (failurePolicy Fail)."""

    def __init__(self, policy: dict) -> None:
        env = celpy.Environment()
        spec = policy["spec"]
        assert spec["failurePolicy"] == "Fail"
        self.conditions = [env.program(env.compile(c["expression"])) for c in spec["matchConditions"]]
        self.validations = [(env.program(env.compile(v["expression"])), v["message"]) for v in spec["validations"]]

    @staticmethod
    def _true(program: Any, activation: dict) -> bool:
        try:
            result = program.evaluate(activation)
        except celpy.CELEvalError:
            return False
        return not isinstance(result, celpy.CELEvalError) and result is not None and bool(result) is True

    def admit(self, user: dict, pod_node: str | None) -> str:
        old = {"metadata": {"name": "web", "namespace": "team-a"}, "spec": {"containers": [{"name": "c"}]}}
        if pod_node is not None:
            old["spec"]["nodeName"] = pod_node
        new = copy.deepcopy(old)
        new["status"] = {"conditions": [{"type": "rekindle.dev/Restored", "status": "True"}]}
        activation = {
            "request": celpy.json_to_cel({"operation": "UPDATE", "subResource": "status", "userInfo": user,
                                          "resource": {"group": "", "version": "v1", "resource": "pods"}}),
            "object": celpy.json_to_cel(new),
            "oldObject": celpy.json_to_cel(old),
        }
        if not all(self._true(c, activation) for c in self.conditions):
            return "not matched"
        for program, message in self.validations:
            if not self._true(program, activation):
                return f"denied: {message}"
        return "allowed"


def _plugin_user(extra: dict | None) -> dict:
    user: dict = {"username": PLUGIN_USER, "groups": ["system:serviceaccounts", "system:authenticated"]}
    if extra is not None:
        user["extra"] = extra
    return user


@pytest.fixture(scope="module")
def policy(events_render) -> Policy:
    (vap,) = by_kind(events_render["objects"], "ValidatingAdmissionPolicy")
    return Policy(vap)


def test_events_bring_a_node_restriction_bound_to_deny(events_render):
    (vap,) = by_kind(events_render["objects"], "ValidatingAdmissionPolicy")
    (binding,) = by_kind(events_render["objects"], "ValidatingAdmissionPolicyBinding")
    _validate([vap, binding])
    assert vap["apiVersion"] == binding["apiVersion"] == VAP_API
    assert vap["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods/status"]}]
    assert binding["spec"] == {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]}
    # the user it matches is the account the DaemonSet runs as
    (ds,) = by_kind(events_render["objects"], "DaemonSet")
    sa = ds["spec"]["template"]["spec"]["serviceAccountName"]
    assert PLUGIN_USER == f"system:serviceaccount:{NAMESPACE}:{sa}"
    assert {(o["kind"], o["metadata"]["name"]) for o in events_render["created"]} >= {
        ("ValidatingAdmissionPolicy", vap["metadata"]["name"]),
        ("ValidatingAdmissionPolicyBinding", binding["metadata"]["name"])}


def test_the_plugin_may_update_the_status_of_a_pod_on_its_own_node(policy):
    assert policy.admit(_plugin_user({NODE_CLAIM: ["gpu-1"], "authentication.kubernetes.io/pod-name": ["p"]}),
                        "gpu-1") == "allowed"


def test_the_plugin_may_not_update_the_status_of_a_pod_on_another_node(policy):
    assert policy.admit(_plugin_user({NODE_CLAIM: ["gpu-1"]}), "gpu-2") == \
        "denied: the rekindle plugin may update the status of pods on its own node only"


@pytest.mark.parametrize("extra", [None, {}, {"authentication.kubernetes.io/pod-name": ["p"]}],
                         ids=["no extra", "empty extra", "pod claims only"])
def test_a_token_without_the_node_claim_is_denied(policy, extra):
    assert policy.admit(_plugin_user(extra), "gpu-1").startswith("denied: the token of the rekindle plugin names no node")


@pytest.mark.parametrize("extra,node", [({NODE_CLAIM: ["gpu-1", "gpu-2"]}, "gpu-2"), ({NODE_CLAIM: []}, "gpu-1"),
                                        ({NODE_CLAIM: ["gpu-1"]}, None)],
                         ids=["two node names", "empty node name list", "pod not scheduled"])
def test_anything_but_exactly_the_pods_node_is_denied(policy, extra, node):
    assert policy.admit(_plugin_user(extra), node).startswith("denied:")


@pytest.mark.parametrize("username", ["system:node:gpu-1", "system:serviceaccount:kube-system:other",
                                      "system:serviceaccount:team-a:rekindle", "admin"])
def test_other_users_are_not_matched(policy, username):
    user = {"username": username, "extra": {NODE_CLAIM: ["gpu-9"]}}
    assert policy.admit(user, "gpu-1") == "not matched"


def test_release_namespace_and_name_are_the_matched_user():
    r = render({"events": {"enabled": True}, "fullnameOverride": "ckpt"}, namespace="gpu-system")
    (vap,) = by_kind(r["objects"], "ValidatingAdmissionPolicy")
    p = Policy(vap)
    own = {"username": "system:serviceaccount:gpu-system:ckpt", "extra": {NODE_CLAIM: ["n"]}}
    assert p.admit(own, "n") == "allowed"
    assert p.admit(own, "m").startswith("denied:")
    assert p.admit(_plugin_user({NODE_CLAIM: ["n"]}), "m") == "not matched"


def test_no_policy_without_events(default_render):
    kinds = {o["kind"] for o in default_render["objects"]}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def test_restriction_can_be_turned_off_explicitly():
    r = render({"events": {"enabled": True, "restrictToOwnNode": False}}, namespace=NAMESPACE,
               hide=[VAP_API])
    assert by_kind(r["objects"], "ValidatingAdmissionPolicy") == []
    assert by_kind(r["objects"], "ClusterRole")  # the plain RBAC, cluster-wide


def test_a_cluster_without_the_policy_api_is_told_what_to_choose():
    with pytest.raises(RenderError) as exc:
        render({"events": {"enabled": True}}, namespace=NAMESPACE, hide=[VAP_API])
    msg = str(exc.value)
    assert "events.restrictToOwnNode=true needs admissionregistration.k8s.io/v1" in msg
    assert "events.enabled=false" in msg and "events.restrictToOwnNode=false" in msg


# --- the HMAC key under renders that cannot see the cluster --------------------------------------

def test_render_without_cluster_access_and_without_existing_secret_is_refused():
    """`helm template` / Argo CD: `lookup` is empty, so a chart-made key would be new on every
    render and every sync would invalidate every artifact. The render says what to do instead."""
    with pytest.raises(RenderError) as exc:
        render(namespace=NAMESPACE, cluster=False)
    msg = str(exc.value)
    assert "hmac.existingSecret is empty and this render cannot see the cluster" in msg
    assert "create secret generic" in msg


def test_render_without_cluster_access_with_existing_secret_is_stable():
    values = {"hmac": {"existingSecret": "rekindle-hmac-key"}}
    a = render(values, namespace=NAMESPACE, cluster=False)
    b = render(values, namespace=NAMESPACE, cluster=False)
    assert by_kind(a["objects"], "Secret") == []
    assert a["objects"] == b["objects"]


def test_first_install_generates_the_key_once_the_cluster_is_visible(default_render):
    (secret,) = by_kind(default_render["objects"], "Secret")
    assert secret["metadata"]["name"] == "rekindle-hmac"


# --- values the schema rejects -------------------------------------------------------------------

BAD_VALUES = [
    ("address a hostname", {"metrics": {"address": "localhost"}}, "/metrics/address"),
    ("address with a port", {"metrics": {"address": "10.0.0.1:9464"}}, "/metrics/address"),
    ("networkPolicy.enabled not a bool", {"metrics": {"networkPolicy": {"enabled": "yes"}}},
     "/metrics/networkPolicy/enabled"),
    ("networkPolicy peer with an unknown key", {"metrics": {"networkPolicy": {"enabled": True, "from": [{"pods": {}}]}}},
     "/metrics/networkPolicy/from/0"),
    ("networkPolicy empty peer", {"metrics": {"networkPolicy": {"enabled": True, "from": [{}]}}},
     "/metrics/networkPolicy/from/0"),
    ("ipBlock without cidr", {"metrics": {"networkPolicy": {"enabled": True, "from": [{"ipBlock": {}}]}}},
     "/metrics/networkPolicy/from/0/ipBlock"),
    ("restrictToOwnNode not a bool", {"events": {"restrictToOwnNode": "true"}}, "/events/restrictToOwnNode"),
]


@pytest.mark.parametrize("values,where", [(v, w) for _, v, w in BAD_VALUES], ids=[n for n, _, _ in BAD_VALUES])
def test_schema_rejects(values, where):
    with pytest.raises(RenderError, match="schema") as exc:
        render(copy.deepcopy(values), namespace=NAMESPACE)
    assert where in str(exc.value)
