"""The stub against a Python runtime that misbehaves on purpose (real containerd: tests/e2e)."""

from __future__ import annotations

import asyncio
import os
import random
import struct
import threading
import time

import pytest

from nri_plugin.events import Event
from nri_plugin.proto import nri_api_pb2 as api
from nri_plugin.stub import Identity, Stub

from .fake_runtime import FakeRuntime


class Recorder:
    def __init__(self, create_delay: float = 0.0, big_env: int = 0) -> None:
        self.created: list[str] = []
        self.create_delay = create_delay
        self.big_env = big_env

    def create_container(self, pod, ctr):
        time.sleep(self.create_delay)
        self.created.append(ctr.id)
        adj = api.ContainerAdjustment()
        if self.big_env:
            adj.env.add(key="BIG", value="x" * self.big_env)
        return api.CreateContainerResponse(adjust=adj)

    def post_start_container(self, pod, ctr):
        pass


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def sock(tmp_path):
    return str(tmp_path / "nri.sock")


async def _start(sock, plugin):
    stub = Stub(plugin, Identity("rekindle", "50"), socket_path=sock, max_backoff=0.2)
    task = asyncio.create_task(stub.run())
    return stub, task


async def _stop(stub, task):
    stub.stop()
    await asyncio.wait_for(task, 5)


def test_handshake_registers_and_subscribes_only_handled_events(sock):
    async def body():
        async with FakeRuntime(sock) as rt:
            stub, task = await _start(sock, Recorder())
            conn = await rt.next_plugin()
            conf = await conn.handshake()
            reg = await conn.registered
            assert (reg.plugin_name, reg.plugin_idx) == ("rekindle", "50")
            assert conf.events == Event.CREATE_CONTAINER.bit | Event.POST_START_CONTAINER.bit
            await _stop(stub, task)
    run(body())


def test_slow_handler_is_answered_empty_within_the_request_timeout(sock):
    async def body():
        async with FakeRuntime(sock) as rt:
            stub, task = await _start(sock, Recorder(create_delay=3.0))
            conn = await rt.next_plugin()
            await conn.handshake()
            t0 = time.monotonic()
            req = api.CreateContainerRequest(pod=api.PodSandbox(id="p"), container=api.Container(id="c"))
            resp = await conn.call("CreateContainer", req, api.CreateContainerResponse, timeout=2.0)
            assert time.monotonic() - t0 < 2.0
            assert not resp.HasField("adjust")
            await _stop(stub, task)
    run(body())


def test_each_request_served_is_logged_with_its_pod_and_time_at_debug(sock, caplog):
    caplog.set_level("DEBUG", logger="nri_plugin.stub")

    async def body():
        async with FakeRuntime(sock) as rt:
            stub, task = await _start(sock, Recorder(create_delay=0.05))
            conn = await rt.next_plugin()
            await conn.handshake()
            req = api.CreateContainerRequest(pod=api.PodSandbox(id="p", name="web", namespace="team"),
                                             container=api.Container(id="c"))
            await conn.call("CreateContainer", req, api.CreateContainerResponse)
            await _stop(stub, task)
    run(body())
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("served CreateContainer")]
    assert line.startswith("served CreateContainer team/web in ") and float(line.split()[-2]) >= 50.0, line


def test_reply_larger_than_4096_bytes_is_split_and_reassembled(sock):
    async def body():
        async with FakeRuntime(sock) as rt:
            stub, task = await _start(sock, Recorder(big_env=100_000))
            conn = await rt.next_plugin()
            await conn.handshake()
            req = api.CreateContainerRequest(pod=api.PodSandbox(id="p"), container=api.Container(id="c"))
            resp = await conn.call("CreateContainer", req, api.CreateContainerResponse)
            assert len(resp.adjust.env[0].value) == 100_000
            await _stop(stub, task)
    run(body())


def test_split_synchronize_is_acknowledged_chunk_by_chunk(sock):
    async def body():
        async with FakeRuntime(sock) as rt:
            stub, task = await _start(sock, Recorder())
            conn = await rt.next_plugin()
            await asyncio.wait_for(conn.registered, 2)
            await conn.call("Configure", api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9",
                                                              request_timeout=2000), api.ConfigureResponse)
            part = await conn.call("Synchronize", api.SynchronizeRequest(more=True, pods=[api.PodSandbox(id="a")]),
                                   api.SynchronizeResponse)
            assert part.more and not part.update and not stub.synchronized.is_set()
            await conn.call("Synchronize", api.SynchronizeRequest(pods=[api.PodSandbox(id="b")]), api.SynchronizeResponse)
            assert stub.synchronized.is_set()
            await _stop(stub, task)
    run(body())


def _garbage(rng: random.Random) -> bytes:
    kind = rng.choice(["random", "oversized-mux", "oversized-ttrpc", "truncated", "bad-type", "bad-proto"])
    if kind == "random":
        return os.urandom(rng.randint(1, 5000))
    if kind == "oversized-mux":
        return struct.pack(">II", 1, 0xFFFFFFF0)
    if kind == "oversized-ttrpc":
        body = struct.pack(">IIBB", 5 << 20, 1, 1, 0) + b"\0" * 100
        return struct.pack(">II", 1, len(body)) + body
    if kind == "truncated":
        return struct.pack(">II", 1, 1000) + b"\1" * 10
    if kind == "bad-type":
        body = struct.pack(">IIBB", 0, 1, 77, 0)
        return struct.pack(">II", 1, len(body)) + body
    body = struct.pack(">IIBB", 4, 1, 1, 0) + b"\xff\xff\xff\xff"
    return struct.pack(">II", 1, len(body)) + body


@pytest.mark.parametrize("seed", range(12))
def test_fuzzed_frames_never_crash_or_hang_the_plugin(sock, seed):
    """After any garbage the plugin either answers or drops the connection, then comes back."""
    rng = random.Random(seed)

    async def body():
        async with FakeRuntime(sock) as rt:
            stub, task = await _start(sock, Recorder())
            conn = await rt.next_plugin()
            await conn.handshake()
            for _ in range(rng.randint(1, 4)):
                conn.raw_write(_garbage(rng))
            await conn.writer.drain()
            if rng.random() < 0.5:
                conn.writer.close()  # truncate: runtime goes away mid-frame
            await conn.closed_by_plugin(1.0)
            conn.close()
            # Whatever happened, the plugin must reconnect and serve a clean handshake.
            again = await rt.next_plugin(timeout=5)
            conf = await again.handshake()
            assert conf.events
            assert not task.done(), "the plugin's run loop must survive protocol errors"
            await _stop(stub, task)
    run(body())


class Blocking:
    """Sync create handlers that hang until released."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.release = threading.Event()

    def create_container(self, pod, ctr):
        self.threads.append(threading.current_thread().name)
        self.release.wait(10)
        return api.CreateContainerResponse(adjust=api.ContainerAdjustment())


def test_sync_handlers_run_in_the_stubs_own_bounded_pool(sock):
    """Six creates against handlers that hang: every reply comes in time (empty), only the pool's
    four threads ever run a handler, and the two calls still queued when they overran never run."""
    plugin = Blocking()

    async def body():
        async with FakeRuntime(sock) as rt:
            stub, task = await _start(sock, plugin)
            conn = await rt.next_plugin()
            await conn.handshake()
            req = api.CreateContainerRequest(pod=api.PodSandbox(id="p"), container=api.Container(id="c"))
            t0 = time.monotonic()
            replies = await asyncio.gather(*(conn.call("CreateContainer", req, api.CreateContainerResponse)
                                             for _ in range(6)))
            assert time.monotonic() - t0 < 2.0
            assert not any(r.HasField("adjust") for r in replies)
            plugin.release.set()
            await asyncio.sleep(0.2)
            again = await conn.call("CreateContainer", req, api.CreateContainerResponse)
            assert again.HasField("adjust")
            await _stop(stub, task)
    run(body())
    assert len(plugin.threads) == 5, plugin.threads  # four that hung, then the one after release
    assert all(name.startswith("nri-handler") for name in plugin.threads), plugin.threads


def test_the_plugin_subscribes_to_the_events_of_the_protocols_it_implements():
    from nri_plugin.handler_types import subscribed_events
    from nri_plugin.handlers import RekindlePlugin

    plugin = object.__new__(RekindlePlugin)  # which handlers it has, not what it does
    assert subscribed_events(plugin) == {Event.RUN_POD_SANDBOX, Event.STOP_POD_SANDBOX, Event.REMOVE_POD_SANDBOX,
                                         Event.CREATE_CONTAINER, Event.POST_CREATE_CONTAINER,
                                         Event.POST_START_CONTAINER, Event.STOP_CONTAINER, Event.REMOVE_CONTAINER}

    class NotAHandler:
        create_container = None  # the name without a method

    assert subscribed_events(NotAHandler()) == set()
