"""Readiness, liveness and NRI metrics over HTTP, driven by the real stub against the Python
runtime: /readyz answers 200 only once registered and synchronized, and 503 again as soon as
the connection is lost; /healthz follows the event loop's heartbeat; /metrics shows the
connection state and each handler's latency. Handler log lines carry pod, container and event."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request

import pytest

from nri_plugin import logs
from nri_plugin.health import Health
from nri_plugin.httpd import HttpEndpoint
from nri_plugin.metrics import Metrics
from nri_plugin.proto import nri_api_pb2 as api
from nri_plugin.stub import Identity, Stub
from tests.waiting import wait_for_async

from .fake_runtime import FakeRuntime


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Plugin:
    def __init__(self) -> None:
        self.log = logging.getLogger("test.plugin")

    def create_container(self, pod, ctr):
        self.log.info("creating")
        return api.CreateContainerResponse()

    async def post_start_container(self, pod, ctr):
        self.log.info("started")


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.addFilter(logs.ContextFields())
        self.setFormatter(logs.JsonFormatter())
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def capture():
    handler = Capture()
    logger = logging.getLogger("test.plugin")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)


def test_ready_only_while_registered_and_synchronized(tmp_path, capture):
    sock = str(tmp_path / "nri.sock")
    health, metrics = Health(), Metrics()
    endpoint = HttpEndpoint("127.0.0.1", 0, metrics.registry, health)
    port = endpoint.start()

    async def body():
        async with FakeRuntime(sock) as rt:
            stub = Stub(Plugin(), Identity("rekindle", "50"), socket_path=sock, max_backoff=0.2,
                        observers=(health, metrics))
            task = asyncio.create_task(stub.run())
            conn = await rt.next_plugin()
            await asyncio.wait_for(conn.registered, 2)
            code, text = await asyncio.to_thread(get, port, "/readyz")
            assert code == 503, text  # registered, not yet synchronized
            await conn.handshake()
            await wait_for_async(lambda: get(port, "/readyz")[0] == 200, 5, "/readyz to answer 200")
            assert "synchronized" in get(port, "/readyz")[1]
            pod = api.PodSandbox(id="p", name="web", namespace="team-a")
            ctr = api.Container(id="c1", name="server")
            await conn.call("CreateContainer", api.CreateContainerRequest(pod=pod, container=ctr),
                            api.CreateContainerResponse)
            await conn.call("StateChange", api.StateChangeEvent(event=7, pod=pod, container=ctr), api.Empty)
            metrics_text = await asyncio.to_thread(get, port, "/metrics")
            assert "rekindle_nri_connected 1.0" in metrics_text[1]
            assert "rekindle_nri_synchronized 1.0" in metrics_text[1]
            assert 'rekindle_nri_handler_duration_seconds_count{handler="create_container"} 1.0' in metrics_text[1]
            assert 'rekindle_nri_handler_duration_seconds_count{handler="post_start_container"} 1.0' \
                in metrics_text[1]
            conn.close()  # the runtime goes away
            await wait_for_async(lambda: get(port, "/readyz")[0] == 503, 5, "/readyz to answer 503")
            await wait_for_async(lambda: metrics.registry.get_sample_value("rekindle_nri_connected") == 0, 5,
                                 "rekindle_nri_connected to drop to 0")
            conn2 = await rt.next_plugin()  # the stub reconnects
            await conn2.handshake()
            await wait_for_async(lambda: get(port, "/readyz")[0] == 200, 5, "/readyz to answer 200")
            stub.stop()
            await asyncio.wait_for(task, 5)
    try:
        asyncio.run(asyncio.wait_for(body(), 30))
    finally:
        endpoint.stop()
    # Both handlers' lines carry the event, pod and container the stub bound (sync and async).
    by_msg = {line["msg"]: line for line in capture.lines}
    for msg, event in (("creating", "create_container"), ("started", "post_start_container")):
        line = by_msg[msg]
        assert (line["event"], line["namespace"], line["pod"], line["container"]) == \
            (event, "team-a", "web", "server"), line


def test_not_ready_before_any_connection_and_alive_while_the_loop_beats():
    now = [100.0]
    health = Health(stall_after=60, clock=lambda: now[0])
    endpoint = HttpEndpoint("127.0.0.1", 0, Metrics().registry, health)
    port = endpoint.start()
    try:
        code, text = get(port, "/readyz")
        assert code == 503 and "not registered with the runtime yet" in text
        assert get(port, "/healthz")[0] == 200
        now[0] += 61  # no heartbeat for a minute: the loop is stuck
        code, text = get(port, "/healthz")
        assert code == 503 and "event loop stalled" in text
        health.beat()
        assert get(port, "/healthz")[0] == 200
        assert get(port, "/nope")[0] == 404
    finally:
        endpoint.stop()
