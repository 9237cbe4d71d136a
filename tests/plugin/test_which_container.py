"""Which container Rekindle acts on: multi-container pods (rekindle.dev/container, kubectl's
default-container, or else the artifact's source container for a restore and "no other
container" for a checkpoint), and a restarted source whose artifact already exists."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from nri_plugin.agent import NodeEngine
from nri_plugin.config import Settings
from nri_plugin.events import RuntimeInfo
from nri_plugin.handlers import RekindlePlugin
from nri_plugin.jobs import Jobs, Skipped, Work
from nri_plugin.policy import decide
from nri_plugin.proto import nri_api_pb2 as api
from nri_plugin.stub import Reply
from runtime import control
from runtime.compat import NodeFacts
from runtime.manifest import CriuInfo, Manifest, NodeInfo, ProcessInfo, SecurityProfile, Source
from runtime.status import ContainerStatus, Phase, StatusBook
from runtime.store.volume import ArtifactStore
from tests.waiting import wait_for_async

KEY = b"k" * 32
DC = "kubectl.kubernetes.io/default-container"


def publish(store: ArtifactStore, namespace: str, name: str, container: str = "server") -> None:
    manifest = Manifest(
        name=name, namespace=namespace, created_at="2025-01-02T03:04:05+00:00",
        source=Source(pod="src", pod_uid="u", container=container, container_id="cid", image="", image_ref=""),
        node=NodeInfo(hostname="n", kernel="6.18.0", arch="x86_64"), criu=CriuInfo(version="4.1"), cuda=None,
        security=SecurityProfile(uid=0, gid=0, additional_gids=(), capabilities=(), privileged=False,
                                 seccomp="unconfined", no_new_privileges=False),
        process=ProcessInfo(root_pid=7, args=("serve",)), mounts=(), files=(), timings={})
    with store.stage(namespace, name) as staging:
        Path(staging.path, "rootfs-diff.tar").write_bytes(b"tar")
        staging.publish(manifest, KEY)


class NoEngine:
    def checkpoint(self, work):
        raise AssertionError("not expected")

    restore = checkpoint
    probe = checkpoint


@pytest.fixture
def plugin(tmp_path) -> RekindlePlugin:
    settings = Settings(state_dir=str(tmp_path / "state"), store=str(tmp_path / "store"))
    status = StatusBook(settings.state_dir)
    p = RekindlePlugin(settings, store=ArtifactStore(settings.store), key=KEY, status=status,
                       jobs=Jobs(NoEngine(), status), specs=None,
                       facts=NodeFacts("n", "6.18.0", "x86_64", "4.2.1", None))
    p.configure("", RuntimeInfo.from_configure("containerd", "1.7.24", has_timeouts=True))
    return p


def create(plugin: RekindlePlugin, annotations: dict[str, str], name: str) -> api.CreateContainerResponse:
    pod = api.PodSandbox(id="pod1", name="web", namespace="default", uid="0b6c-uid")
    pod.annotations.update(annotations)
    ctr = api.Container(id=f"id-{name}", pod_sandbox_id="pod1", name=name, args=["/srv"])
    result = plugin.create_container(pod, ctr)
    if isinstance(result, Reply):
        result.commit()
        return result.message
    return result


def adjusted(resp: api.CreateContainerResponse) -> bool:
    return any(m.destination == "/rekindle" for m in resp.adjust.mounts)


def test_unnamed_restore_goes_only_into_the_artifacts_source_container(plugin):
    publish(plugin.store, "default", "m", container="server")
    assert adjusted(create(plugin, {"rekindle.dev/restore": "m"}, "server"))
    assert not adjusted(create(plugin, {"rekindle.dev/restore": "m"}, "istio-proxy"))
    st = plugin.status.read("default", "web", "istio-proxy")
    assert st.phase is Phase.SKIPPED and "not the artifact's source container ('server')" in st.reason
    assert not (Path(plugin.settings.state_dir) / "control" / "0b6c-uid" / "istio-proxy").exists()


@pytest.mark.parametrize("key", ["rekindle.dev/container", DC])
def test_a_named_container_is_restored_whatever_the_source_was_called(plugin, key):
    publish(plugin.store, "default", "m", container="server")
    ann = {"rekindle.dev/restore": "m", key: "main"}
    assert adjusted(create(plugin, ann, "main"))
    assert not adjusted(create(plugin, ann, "server"))  # not the named one: not ours at all
    assert plugin.status.read("default", "web", "server") is None


def test_a_source_whose_artifact_is_published_is_left_alone(plugin):
    publish(plugin.store, "default", "m")
    resp = create(plugin, {"rekindle.dev/checkpoint": "m"}, "server")
    assert not adjusted(resp) and not resp.adjust.env
    st = plugin.status.read("default", "web", "server")
    assert st.phase is Phase.SKIPPED and "is already published" in st.reason
    assert 'rekindle.dev/overwrite: "true"' in st.reason


def test_overwrite_checkpoints_again(plugin):
    publish(plugin.store, "default", "m")
    assert adjusted(create(plugin, {"rekindle.dev/checkpoint": "m", "rekindle.dev/overwrite": "true"}, "server"))
    assert plugin.status.read("default", "web", "server").phase is Phase.WAITING_READY


def test_something_planted_under_the_name_does_not_block_a_checkpoint(plugin):
    planted = Path(plugin.settings.store) / "default" / "m"
    planted.mkdir(parents=True)
    (planted / "manifest.json").write_text("{}")
    assert adjusted(create(plugin, {"rekindle.dev/checkpoint": "m"}, "server"))


# --- right before a checkpoint: the engine's rules ----------------------------------------------

def _work(tmp_path, annotations: dict[str, str], container: str = "app") -> Work:
    intent = decide(annotations, container)
    ctl = control.ControlDir(tmp_path / "control" / container)
    ctl.prepare()
    return Work(intent=intent, control=ctl, container_id=f"id-{container}", pid=1, namespace="default",
                pod="web", pod_uid="uid", container=container, image="", netns="", pod_id="pod1")


def _engine(tmp_path, running) -> NodeEngine:
    settings = Settings(state_dir=str(tmp_path / "state"), store=str(tmp_path / "store"))
    return NodeEngine(settings, ArtifactStore(settings.store), KEY, None,
                      NodeFacts("n", "6.18.0", "x86_64", "4.2.1", None), None, running)


def test_unnamed_source_in_a_pod_with_other_containers_is_not_checkpointed(tmp_path):
    asked = []

    def running(pod_id):
        asked.append(pod_id)
        return [("id-app", "app"), ("id-proxy", "istio-proxy")]
    engine = _engine(tmp_path, running)
    with pytest.raises(Skipped, match=r"several containers \(istio-proxy besides this one\)"):
        engine.checkpoint(_work(tmp_path, {"rekindle.dev/checkpoint": "m"}))
    assert asked == ["pod1"]


def test_unnamed_source_alone_in_its_pod_passes_the_rules(tmp_path):
    engine = _engine(tmp_path, lambda pod_id: [("id-app", "app")])
    engine._source_rules(_work(tmp_path, {"rekindle.dev/checkpoint": "m"}))


def test_named_source_does_not_care_about_other_containers(tmp_path):
    engine = _engine(tmp_path, lambda pod_id: [("id-app", "app"), ("id-proxy", "istio-proxy")])
    engine._source_rules(_work(tmp_path, {"rekindle.dev/checkpoint": "m", DC: "app"}))


def test_artifact_published_meanwhile_is_not_overwritten(tmp_path):
    engine = _engine(tmp_path, lambda pod_id: [("id-app", "app")])
    publish(engine.store, "default", "m")
    with pytest.raises(Skipped, match="is already published"):
        engine._source_rules(_work(tmp_path, {"rekindle.dev/checkpoint": "m"}))


class SkippingEngine:
    def checkpoint(self, work):
        raise Skipped("the pod runs several containers (x besides this one) and names none")

    restore = checkpoint

    async def probe(self, netns, probe):
        return True


def test_a_skipped_checkpoint_is_recorded_and_told_to_the_workload(tmp_path):
    status = StatusBook(tmp_path / "state")
    work = _work(tmp_path, {"rekindle.dev/checkpoint": "m"})
    work.control.write("ready-for-checkpoint", "")

    async def body():
        jobs = Jobs(SkippingEngine(), status)
        jobs.bind_loop(asyncio.get_running_loop())
        jobs.start(work)
        return await wait_for_async(lambda: _final(status.read("default", "web", "app")), 5, "a final phase",
                                    interval=0.05)
    st = asyncio.run(body())
    assert st.phase is Phase.SKIPPED and "several containers" in st.reason
    assert work.control.read("checkpoint-failed").startswith("skipped: the pod runs several containers")


def _final(st: ContainerStatus | None) -> ContainerStatus | None:
    return st if st is not None and st.phase.final else None
