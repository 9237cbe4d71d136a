"""The Rekindle handlers on NRI messages (no runtime): what each decision puts in the reply."""

from __future__ import annotations

import asyncio

import pytest

from nri_plugin.config import Settings
from nri_plugin.events import RuntimeInfo
from nri_plugin.handlers import RekindlePlugin
from nri_plugin.jobs import Jobs
from nri_plugin.proto import nri_api_pb2 as api
from nri_plugin.stub import Reply
from runtime.compat import NodeFacts
from runtime.status import Phase, StatusBook
from runtime.store.volume import ArtifactStore


class NoEngine:
    def checkpoint(self, work):
        raise AssertionError("not expected")

    restore = checkpoint
    probe = checkpoint


@pytest.fixture
def make_plugin(tmp_path):
    def make(version: str = "1.7.24~ds1", restore_timeout: int = 1800) -> RekindlePlugin:
        settings = Settings.from_flags(dict(state_dir=str(tmp_path / "state"), store=str(tmp_path / "store"),
                                            restore_timeout=restore_timeout))
        status = StatusBook(settings.state_dir)
        plugin = RekindlePlugin(settings, store=ArtifactStore(settings.store), key=b"k" * 32, status=status,
                                jobs=Jobs(NoEngine(), status), specs=None,
                                facts=NodeFacts("n", "6.18.0", "x86_64", "4.2.1", None))
        plugin.configure("", RuntimeInfo.from_configure("containerd", version, has_timeouts=True))
        return plugin
    return make


def _create(plugin: RekindlePlugin, pod, ctr) -> api.CreateContainerResponse:
    """CreateContainer as the stub runs it when it sends the reply: commit, then the message."""
    result = plugin.create_container(pod, ctr)
    if isinstance(result, Reply):
        result.commit()
        return result.message
    return result


def _req(annotations: dict[str, str], name: str = "app"):
    pod = api.PodSandbox(id="pod1", name="web", namespace="default", uid="0b6c-uid")
    pod.annotations.update(annotations)
    ctr = api.Container(id="c1", pod_sandbox_id="pod1", name=name, args=["/srv", "--port", "80"])
    return pod, ctr


def test_checkpoint_source_gets_control_dir_mounts_and_env(make_plugin):
    plugin = make_plugin()
    pod, ctr = _req({"rekindle.dev/checkpoint": "m"})
    adj = _create(plugin, pod, ctr).adjust
    # The control dir also at Dynamo's default path: hooks written for Dynamo find it unchanged.
    assert {m.destination: m.source for m in adj.mounts} == {
        "/rekindle": f"{plugin.settings.state_dir}/control/0b6c-uid/app",
        "/snapshot-control": f"{plugin.settings.state_dir}/control/0b6c-uid/app",
        "/.rekindle/bin": f"{plugin.settings.state_dir}/bin"}
    assert "ro" in next(m for m in adj.mounts if m.destination == "/.rekindle/bin").options
    assert {e.key for e in adj.env} == {"REKINDLE_CONTROL_DIR", "SNAPSHOT_CONTROL_DIR", "DYN_SNAPSHOT_CONTROL_DIR"}
    assert list(adj.args) == []  # NRI 0.6 ignores args: the swap happens in PostCreate


def test_nri_0_10_runtime_gets_args_in_the_create_reply(make_plugin):
    plugin = make_plugin("2.2.1")
    pod, ctr = _req({"rekindle.dev/checkpoint": "m"})
    args = list(_create(plugin, pod, ctr).adjust.args)
    assert args == ["/.rekindle/bin/rekindle-init", "--mode", "source", "--control", "/rekindle",
                    "--timeout", "1800", "--", "/srv", "--port", "80"]


def test_unannotated_and_other_container_get_empty_replies(make_plugin):
    plugin = make_plugin()
    assert not _create(plugin, *_req({})).HasField("adjust")
    pod, ctr = _req({"rekindle.dev/checkpoint": "m", "rekindle.dev/container": "other"})
    assert not _create(plugin, pod, ctr).HasField("adjust")


@pytest.mark.parametrize("annotations, phase, named", [
    ({"rekindle.dev/restore": "../x"}, Phase.IGNORED, "rekindle.dev/restore"),
    ({"rekindle.dev/restore": "nothing-here"}, Phase.COLD_START, "nothing-here"),
], ids=["malformed-annotation-ignored", "missing-artifact-cold-start"])
def test_a_restore_that_cannot_be_is_left_alone_with_the_reason(make_plugin, annotations, phase, named):
    plugin = make_plugin()
    pod, ctr = _req(annotations)
    assert not _create(plugin, pod, ctr).HasField("adjust")
    st = plugin.status.read("default", "web", "app")
    assert st.phase is phase and named in st.reason


def test_stale_protocol_files_are_cleared_on_create(make_plugin):
    plugin = make_plugin()
    pod, ctr = _req({"rekindle.dev/checkpoint": "m"})
    _create(plugin, pod, ctr)
    ctl = plugin.settings.state_dir + "/control/0b6c-uid/app"
    for name in ("restore-complete", "restore-pid", "ready-for-checkpoint"):
        open(f"{ctl}/{name}", "w").write("stale")
    _create(plugin, pod, ctr)  # the container is created again (restart)
    import os
    assert not any(os.path.exists(f"{ctl}/{n}") for n in ("restore-complete", "restore-pid", "ready-for-checkpoint"))


def test_post_start_without_swap_schedules_nothing(make_plugin):
    plugin = make_plugin()
    pod, ctr = _req({"rekindle.dev/checkpoint": "m"})
    _create(plugin, pod, ctr)
    plugin.post_create_container(pod, ctr)  # no containerd API: the swap fails open
    asyncio.run(plugin.post_start_container(pod, ctr))
    st = plugin.status.read("default", "web", "app")
    assert st.phase is Phase.CHECKPOINT_FAILED and "containerd API" in st.reason


def test_node_default_restore_timeout_reaches_the_init(make_plugin):
    plugin = make_plugin("2.2.1", restore_timeout=120)
    args = list(_create(plugin, *_req({"rekindle.dev/checkpoint": "m"})).adjust.args)
    assert args[args.index("--timeout") + 1] == "120"


def test_restore_precheck_compares_gpus_the_container_was_given(monkeypatch):
    """A node with two GPUs, a container given one: an artifact from a one-GPU container fits."""
    from runtime.gpu import devices as gpus_mod
    from runtime.gpu.target import target_facts
    from runtime.manifest import CudaInfo, Gpu
    monkeypatch.setattr(gpus_mod, "node_gpus", lambda proc_gpus=None: {
        0: Gpu("GPU-aaaaaaaa-0000-0000-0000-000000000000", "H200"),
        1: Gpu("GPU-bbbbbbbb-0000-0000-0000-000000000000", "H200")})
    facts = NodeFacts("n", "6.18.0", "x86_64", "4.2.1",
                      CudaInfo("580.1", (Gpu("GPU-aaaaaaaa-0000-0000-0000-000000000000", "H200"),
                                          Gpu("GPU-bbbbbbbb-0000-0000-0000-000000000000", "H200"))))
    narrowed = target_facts(facts, {"linux": {"devices": [{"path": "/dev/nvidia1", "major": 195, "minor": 1}]}})
    assert [g.uuid[:12] for g in narrowed.cuda.gpus] == ["GPU-bbbbbbbb"]


def test_second_restore_attempt_in_the_same_pod_starts_cold(make_plugin):
    """Fail once: a pod whose restore already ran (or fell back) is not restored again when
    its container is recreated; a new pod (new uid) is."""
    from runtime.status import ContainerStatus
    plugin = make_plugin()
    pod, ctr = _req({"rekindle.dev/restore": "m"})
    plugin.status.write(ContainerStatus(namespace="default", pod="web", container="app", role="restore",
                                        artifact="m", phase=Phase.COLD_START, reason="criu restore failed",
                                        pod_uid=pod.uid))
    assert not _create(plugin, pod, ctr).HasField("adjust")
    st = plugin.status.read("default", "web", "app")
    assert st.phase is Phase.COLD_START and "already attempted" in st.reason and "criu restore failed" in st.reason
    pod.uid = "another-pod-uid"
    _create(plugin, pod, ctr)  # gets as far as the store: no artifact named m
    assert "already attempted" not in plugin.status.read("default", "web", "app").reason


class CountingSpecs:
    def __init__(self) -> None:
        self.gets = 0
        self.updated: dict[str, dict] = {}

    def get_spec(self, container_id: str) -> dict:
        self.gets += 1
        return {"process": {"args": ["/srv"]}}

    def update_spec(self, container_id: str, spec: dict) -> None:
        self.updated[container_id] = spec


def test_post_create_of_a_restore_reads_the_spec_once(make_plugin):
    """The privilege check and the swap share one read of the stored spec: one round trip to
    containerd fewer in PostCreateContainer (a loaded containerd answers in tens of ms)."""
    from nri_plugin.handlers import Pending
    from nri_plugin.policy import decide
    from runtime import control
    from runtime.manifest import CriuInfo, Manifest, NodeInfo, ProcessInfo, Source
    from runtime.security import SecurityProfile
    plugin = make_plugin()
    plugin.specs = specs = CountingSpecs()
    pod, ctr = _req({"rekindle.dev/restore": "m"})
    source = SecurityProfile.from_oci_spec({"process": {"args": ["/srv"]}}, label="m")
    manifest = Manifest(name="m", namespace="default", created_at="2025-01-02T03:04:05+00:00",
                        source=Source(pod="p", pod_uid="u", container="app", container_id="cid", image="i",
                                      image_ref=""),
                        node=NodeInfo(hostname="n", kernel="6.18.0", arch="x86_64"), criu=CriuInfo("4.2.1"),
                        cuda=None, security=source, process=ProcessInfo(root_pid=2, args=("/srv",)),
                        mounts=(), files=(), timings={})
    intent = decide(dict(pod.annotations), ctr.name, 60)
    ctl = control.control_dir_for(plugin.settings.state_dir, pod.uid, ctr.name)
    plugin._pending[ctr.id] = Pending(plugin._work(pod, ctr, intent, ctl), manifest)
    plugin.post_create_container(pod, ctr)
    assert specs.updated[ctr.id]["process"]["args"][0] == "/.rekindle/bin/rekindle-init", plugin.status.list()
    assert specs.gets == 1


def test_a_restore_opens_the_artifact_once_and_its_job_restores_the_version_checked(make_plugin):
    """CreateContainer's precheck opens the artifact once (manifest, source container, rollback,
    compatibility from that one open) and hands the version on: a version published after it is
    not what the job restores."""
    from nri_plugin.agent import restore_request
    from runtime.manifest import CriuInfo, Manifest, NodeInfo, ProcessInfo, Source
    from runtime.security import SecurityProfile
    plugin = make_plugin()

    def publish() -> str:
        manifest = Manifest(name="m", namespace="default", created_at="2025-01-02T03:04:05+00:00",
                            source=Source(pod="p", pod_uid="u", container="app", container_id="cid", image="",
                                          image_ref=""),
                            node=NodeInfo(hostname="n", kernel="6.18.0", arch="x86_64"), criu=CriuInfo("4.2.1"),
                            cuda=None, security=SecurityProfile.from_oci_spec({}, label="m"),
                            process=ProcessInfo(root_pid=2, args=("/srv",)), mounts=(), files=(), timings={})
        with plugin.store.stage("default", "m") as staging:
            staging.publish(manifest, plugin.key)
        with plugin.store.open("default", "m", plugin.key) as art:
            return art.version

    first = publish()
    opened = []
    real_open = plugin.store.open
    plugin.store.open = lambda *a, **kw: opened.append(a) or real_open(*a, **kw)  # type: ignore[method-assign]
    pod, ctr = _req({"rekindle.dev/restore": "m"})
    assert _create(plugin, pod, ctr).HasField("adjust"), plugin.status.list()
    assert len(opened) == 1
    work = plugin._pending[ctr.id].work
    assert work.version == first
    plugin.store.open = real_open  # type: ignore[method-assign]
    assert publish() != first
    req = restore_request(plugin.settings, ctr.id, "default", "m", image="", image_ref="", version=work.version)
    assert req.version == first


OWN = [("mount", ""), ("network", "/var/run/netns/cni-1"), ("pid", "")]
POD_SHARED = [("mount", ""), ("network", "/var/run/netns/cni-1"), ("pid", "/proc/4242/ns/pid")]
HOST_PID = [("mount", ""), ("network", "/var/run/netns/cni-1")]


@pytest.mark.parametrize("role, phase", [("restore", Phase.COLD_START), ("checkpoint", Phase.CHECKPOINT_FAILED)])
@pytest.mark.parametrize("namespaces, why", [(POD_SHARED, "joins /proc/4242/ns/pid"), (HOST_PID, "hostPID")],
                         ids=["shareProcessNamespace", "hostPID"])
def test_a_container_without_its_own_pid_namespace_is_refused_at_create(make_plugin, role, phase, namespaces, why):
    plugin = make_plugin()
    pod, ctr = _req({f"rekindle.dev/{role}": "m"})
    for kind, path in namespaces:
        ctr.linux.namespaces.add(type=kind, path=path)
    assert not _create(plugin, pod, ctr).HasField("adjust")  # runs its own command, untouched
    st = plugin.status.read("default", "web", "app")
    assert st.phase is phase and why in st.reason and f"{role} refused" in st.reason, st


def test_a_container_with_its_own_pid_namespace_is_taken(make_plugin):
    plugin = make_plugin()
    pod, ctr = _req({"rekindle.dev/checkpoint": "m"})
    for kind, path in OWN:
        ctr.linux.namespaces.add(type=kind, path=path)
    assert _create(plugin, pod, ctr).HasField("adjust")
