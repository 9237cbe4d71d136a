"""The fail-open boundary, late results and a runtime that stops reading, through the real stub
and the Rekindle handlers against the Python runtime of fake_runtime.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from nri_plugin.config import Settings
from nri_plugin.events import Event
from nri_plugin.handlers import RekindlePlugin
from nri_plugin.jobs import Jobs
from nri_plugin.proto import nri_api_pb2 as api
from nri_plugin.stub import Identity, Stub
from runtime import control
from runtime.compat import NodeFacts
from runtime.status import Phase, StatusBook
from runtime.store.volume import ArtifactStore
from tests.waiting import wait_for_async

from .fake_runtime import FakeRuntime


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _serve(sock: str, plugin: object, rt: FakeRuntime):
    stub = Stub(plugin, Identity("rekindle", "50"), socket_path=sock, max_backoff=0.2)
    task = asyncio.create_task(stub.run())
    conn = await rt.next_plugin()
    await conn.handshake()
    return stub, task, conn


async def _stop(stub: Stub, task: asyncio.Task) -> None:
    stub.stop()
    await asyncio.wait_for(task, 5)


def _pod(uid: str = "0b6c-uid", **annotations: str) -> api.PodSandbox:
    pod = api.PodSandbox(id="pod-" + uid, name="web-" + uid[:4], namespace="default", uid=uid)
    pod.annotations.update(annotations)
    return pod


def _ctr(cid: str, name: str = "app") -> api.Container:
    return api.Container(id=cid, pod_sandbox_id="pod", name=name, args=["/srv", "--port", "80"])


# ---------------------------------------------------------------- every handler, every way to fail
class Failing:
    """Every handler raises; sync or async. Records what the stub reports."""

    def __init__(self, use_async: bool) -> None:
        self.reported: list[tuple[str, str, str, str]] = []
        self.reported_event = threading.Event()
        names = ("configure", "synchronize", "create_container", "update_container", "stop_container",
                 "post_create_container", "post_start_container", "remove_pod_sandbox")
        for name in names:
            setattr(self, name, self._make(name, use_async))

    @staticmethod
    def _make(name: str, use_async: bool):
        def fail(*args):
            raise OSError(28, f"No space left on device in {name}")

        async def afail(*args):
            raise ValueError(f"bad value in {name}")
        return afail if use_async else fail

    def on_handler_error(self, handler, pod, ctr, exc) -> None:
        self.reported.append((handler, pod.name if pod else "", ctr.name if ctr else "", type(exc).__name__))


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_any_handler_error_is_an_empty_reply_and_reported(tmp_path, use_async):
    sock = str(tmp_path / "nri.sock")
    plugin = Failing(use_async)
    err = "ValueError" if use_async else "OSError"

    async def body():
        async with FakeRuntime(sock) as rt:
            stub, task, conn = await _serve(sock, plugin, rt)  # Configure and Synchronize failed too
            pod, ctr = _pod(), _ctr("c1")
            created = await conn.call("CreateContainer", api.CreateContainerRequest(pod=pod, container=ctr),
                                      api.CreateContainerResponse)
            assert not created.HasField("adjust")
            updated = await conn.call("UpdateContainer", api.UpdateContainerRequest(pod=pod, container=ctr),
                                      api.UpdateContainerResponse)
            assert not updated.update
            await conn.call("StopContainer", api.StopContainerRequest(pod=pod, container=ctr), api.StopContainerResponse)
            for ev in (Event.POST_CREATE_CONTAINER, Event.POST_START_CONTAINER, Event.REMOVE_POD_SANDBOX):
                await conn.call("StateChange", api.StateChangeEvent(event=ev, pod=pod, container=ctr), api.Empty)
            await wait_for_async(lambda: len(plugin.reported) >= 8, 5, "every failure reported to the plugin")
            assert stub.connections == 1, "an error must not cost the connection"
            await _stop(stub, task)

    run(body())
    assert plugin.reported == [
        ("configure", "", "", err), ("synchronize", "", "", err),
        ("create_container", "web-0b6c", "app", err), ("update_container", "web-0b6c", "app", err),
        ("stop_container", "web-0b6c", "app", err), ("post_create_container", "web-0b6c", "app", err),
        ("post_start_container", "web-0b6c", "app", err), ("remove_pod_sandbox", "web-0b6c", "", err)]


# ---------------------------------------------------------------- the Rekindle handlers behind the stub
class FakeSpecs:
    """containerd's stored specs, as the entrypoint swap sees them."""

    def __init__(self) -> None:
        self.updated: dict[str, dict] = {}

    def get_spec(self, container_id: str) -> dict:
        return {"process": {"args": ["/srv", "--port", "80"]}}

    def update_spec(self, container_id: str, spec: dict) -> None:
        self.updated[container_id] = spec


class IdleEngine:
    def checkpoint(self, work):
        raise AssertionError("not expected")

    restore = checkpoint

    async def probe(self, netns, probe):
        return False


class ObservedPlugin(RekindlePlugin):
    """The real plugin; notes when a create handler has really returned (late or not)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.created: list[str] = []

    def create_container(self, pod, ctr):
        try:
            return super().create_container(pod, ctr)
        finally:
            self.created.append(ctr.id)


@pytest.fixture
def rekindle(tmp_path):
    settings = Settings(state_dir=str(tmp_path / "state"), store=str(tmp_path / "store"))
    status = StatusBook(settings.state_dir)
    return ObservedPlugin(settings, store=ArtifactStore(settings.store), key=b"k" * 32, status=status,
                          jobs=Jobs(IdleEngine(), status), specs=FakeSpecs(),
                          facts=NodeFacts("n", "6.18.0", "x86_64", "4.2.1", None))


def test_oserror_in_create_is_a_cold_start_not_a_failed_pod(tmp_path, rekindle):
    """A file where the pod's control root belongs: ControlDir.prepare() raises OSError."""
    sock = str(tmp_path / "nri.sock")
    pod, ctr = _pod(**{"rekindle.dev/checkpoint": "m"}), _ctr("c1")
    root = tmp_path / "state" / "control"
    root.mkdir(parents=True)
    (root / pod.uid).write_text("not a directory")

    async def body():
        async with FakeRuntime(sock) as rt:
            stub, task, conn = await _serve(sock, rekindle, rt)
            resp = await conn.call("CreateContainer", api.CreateContainerRequest(pod=pod, container=ctr),
                                   api.CreateContainerResponse)
            assert not resp.HasField("adjust")
            st = await asyncio.to_thread(rekindle.status.wait, "default", pod.name, "app", {Phase.COLD_START}, 5)
            await _stop(stub, task)
            return st

    st = run(body())
    assert st is not None and st.phase is Phase.COLD_START, st
    assert "NotADirectoryError" in st.reason and st.artifact == "m"


def test_late_create_result_is_discarded_and_post_create_leaves_it_alone(tmp_path, rekindle, monkeypatch):
    """A create that overran its budget was answered empty (no mounts, no init). When it
    finishes later it must not register the container: PostCreate would swap the entrypoint
    to an init that was never mounted. A create in time, beside it, is swapped as usual."""
    sock = str(tmp_path / "nri.sock")
    real = control.control_dir_for

    class SlowControlDir(control.ControlDir):
        def prepare(self) -> None:  # a state dir on a stalled disk
            time.sleep(2.5)
            super().prepare()

    def control_dir_for(state_dir, pod_uid, container):
        ctl = real(state_dir, pod_uid, container)
        return SlowControlDir(ctl.path) if container == "slow" else ctl
    monkeypatch.setattr(control, "control_dir_for", control_dir_for)

    pod = _pod(**{"rekindle.dev/checkpoint": "m"})
    slow, fast = _ctr("c-slow", "slow"), _ctr("c-fast", "fast")

    async def body():
        async with FakeRuntime(sock) as rt:
            stub, task, conn = await _serve(sock, rekindle, rt)
            t0 = time.monotonic()
            late = await conn.call("CreateContainer", api.CreateContainerRequest(pod=pod, container=slow),
                                   api.CreateContainerResponse)
            assert time.monotonic() - t0 < 2.0 and not late.HasField("adjust")
            on_time = await conn.call("CreateContainer", api.CreateContainerRequest(pod=pod, container=fast),
                                      api.CreateContainerResponse)
            assert on_time.HasField("adjust")
            # the slow handler has really returned
            await wait_for_async(lambda: slow.id in rekindle.created, 10, "the slow create to finish", interval=0.05)
            for ctr in (slow, fast):
                for ev in (Event.POST_CREATE_CONTAINER, Event.POST_START_CONTAINER):
                    await conn.call("StateChange", api.StateChangeEvent(event=ev, pod=pod, container=ctr), api.Empty)
            await _stop(stub, task)
            await rekindle.jobs.shutdown()

    run(body())
    assert list(rekindle.specs.updated) == [fast.id], "only the container that got the mounts is swapped"
    st = rekindle.status.read("default", pod.name, "slow")
    assert st.phase is Phase.COLD_START and "overran" in st.reason, st
    assert rekindle.status.read("default", pod.name, "fast").phase is Phase.WAITING_READY


# ---------------------------------------------------------------- a runtime that stops reading
class BigReplies:
    def create_container(self, pod, ctr):
        adj = api.ContainerAdjustment()
        adj.env.add(key="BIG", value="x" * (1 << 20))
        return api.CreateContainerResponse(adjust=adj)


def test_runtime_that_stops_reading_is_dropped_not_buffered_for(tmp_path):
    """1 MiB replies to a runtime that reads nothing: the plugin drops the connection once its
    write buffer passes the cap, instead of growing it, and registers again."""
    sock = str(tmp_path / "nri.sock")

    async def body():
        async with FakeRuntime(sock) as rt:
            stub, task, conn = await _serve(sock, BigReplies(), rt)
            conn.writer.transport.pause_reading()  # from now on nobody reads what the plugin writes
            req = api.CreateContainerRequest(pod=_pod(), container=_ctr("c1"))
            calls = [asyncio.create_task(conn.client.call("nri.pkg.api.v1alpha1.Plugin", "CreateContainer",
                                                          req.SerializeToString(), 30)) for _ in range(40)]
            again = await rt.next_plugin(timeout=20)
            await again.handshake()
            assert stub._trunk is not None and stub.connections == 2
            for c in calls:
                c.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            conn.close()
            await _stop(stub, task)

    run(body())
