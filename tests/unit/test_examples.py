"""examples/: every manifest is a valid Kubernetes object (the API's own schemas), its Rekindle
annotations pass the plugin's own parser, and each restore pod runs the source's container."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extra")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")

from nri_plugin import policy  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
K8S_VERSION = "1.33"
MANIFESTS = sorted(EXAMPLES.rglob("*.yaml"))
ENGINES = ["vllm", "sglang"]
HOOK_DIR = "/opt/rekindle-hook"


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def one(engine: str, kind: str) -> dict:
    found = [d for p in sorted((EXAMPLES / engine).glob("*.yaml")) for d in docs(p) if d["kind"] == kind]
    assert len(found) == 1, (engine, kind, len(found))
    return found[0]


def pod(obj: dict) -> tuple[dict, dict]:
    """(pod template metadata, pod spec)."""
    t = obj["spec"]["template"]
    return t["metadata"], t["spec"]


def container(obj: dict) -> dict:
    meta, spec = pod(obj)
    name = meta["annotations"][policy.CONTAINER]
    (c,) = [c for c in spec["containers"] if c["name"] == name]
    return c


def test_there_are_examples():
    assert {p.parent.name for p in MANIFESTS} >= set(ENGINES)


@pytest.mark.parametrize("path", MANIFESTS, ids=[str(p.relative_to(EXAMPLES)) for p in MANIFESTS])
def test_manifest_validates_against_the_kubernetes_api(path):
    objs = docs(path)
    assert objs
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("engine", ENGINES)
def test_source_is_a_job_that_checkpoints_once(engine):
    job = one(engine, "Job")
    meta, spec = pod(job)
    assert spec["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
    c = container(job)
    intent = policy.decide(meta["annotations"], c["name"])
    assert intent is not None and intent.role is policy.Role.CHECKPOINT
    assert intent.after_checkpoint is policy.AfterCheckpoint.EXIT
    assert intent.ready_probe.kind is policy.ProbeKind.FILE  # the hook writes ready-for-checkpoint
    for other in spec["containers"]:
        if other["name"] != c["name"]:
            assert policy.decide(meta["annotations"], other["name"]) is None


@pytest.mark.parametrize("engine", ENGINES)
def test_restore_deployment_restores_the_sources_artifact(engine):
    src_meta, _ = pod(one(engine, "Job"))
    deploy = one(engine, "Deployment")
    meta, _ = pod(deploy)
    c = container(deploy)
    intent = policy.decide(meta["annotations"], c["name"])
    assert intent is not None and intent.role is policy.Role.RESTORE
    assert intent.artifact == src_meta["annotations"][policy.CHECKPOINT]
    assert deploy["metadata"]["namespace"] == one(engine, "Job")["metadata"]["namespace"]
    # The startup probe outlasts the restore timeout (then a cold start may still need time).
    probe = c["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 2 * intent.restore_timeout
    assert probe["exec"]["command"] == ["python3", f"{HOOK_DIR}/rekindle_hook.py", "probe"]
    assert c["readinessProbe"]["exec"] == probe["exec"]


@pytest.mark.parametrize("engine", ENGINES)
def test_restore_pod_runs_the_source_container(engine):
    """CRIU needs every mount of the source at the same place in the target, and the restore the
    same image: the two pods differ only in annotations, probes and labels."""
    job, deploy = one(engine, "Job"), one(engine, "Deployment")
    a, b = container(job), container(deploy)
    for key in ("name", "image", "command", "args", "env", "volumeMounts", "resources", "ports"):
        assert a.get(key) == b.get(key), key
    assert pod(job)[1]["volumes"] == pod(deploy)[1]["volumes"]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_hook_drives_this_engine(engine):
    c = container(one(engine, "Job"))
    cmd = c["command"]
    assert cmd[:3] == ["python3", f"{HOOK_DIR}/rekindle_hook.py", "run"] and cmd[-1] == "--"
    assert cmd[cmd.index("--engine") + 1] == engine
    assert int(cmd[cmd.index("--port") + 1]) == c["ports"][0]["containerPort"]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {HOOK_DIR}
    env = {e["name"]: e for e in c["env"]}
    # the role comes from the pod's own annotation: set in the source, empty in restore pods
    assert env["REKINDLE_CHECKPOINT"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        f"metadata.annotations['{policy.CHECKPOINT}']"
    assert env["USE_LIBUV"]["value"] == "0"  # no io_uring fd from PyTorch's TCPStore
