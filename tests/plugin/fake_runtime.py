"""The runtime side of NRI, in Python, for plugin tests that need to misbehave on purpose.

It speaks the same mux + ttrpc as containerd (conn 1: it calls the plugin; conn 2: it serves
RegisterPlugin) on a unix socket the stub connects to. Tests against the real containerd live
in tests/e2e; this one exists to send what containerd never would (garbage, truncation,
oversized frames) and to time the plugin's replies.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from nri_plugin.proto import nri_api_pb2 as api
from nri_plugin.stub import PLUGIN_SERVICE, RUNTIME_SERVICE
from nri_plugin.transport.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, MuxTrunk
from nri_plugin.transport.ttrpc import TtrpcClient, TtrpcServer


@dataclass
class PluginConn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    trunk: MuxTrunk | None = None
    client: TtrpcClient | None = None
    registered: asyncio.Future[api.RegisterPluginRequest] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def start(self) -> None:
        self.trunk = MuxTrunk(self.reader, self.writer)
        self.client = TtrpcClient(lambda b: self.trunk.send(PLUGIN_SERVICE_CONN, b))

        async def register(payload: bytes, deadline: float | None) -> bytes:
            if not self.registered.done():
                self.registered.set_result(api.RegisterPluginRequest.FromString(payload))
            return b""

        server = TtrpcServer(lambda b: self.trunk.send(RUNTIME_SERVICE_CONN, b),
                             {(RUNTIME_SERVICE, "RegisterPlugin"): register})
        self.trunk.route(PLUGIN_SERVICE_CONN, self.client.feed)
        self.trunk.route(RUNTIME_SERVICE_CONN, server.feed)
        self.reader_task = asyncio.create_task(self.trunk.run())

    async def call(self, method: str, msg, reply_type, timeout: float = 2.0):
        raw = await self.client.call(PLUGIN_SERVICE, method, msg.SerializeToString(), timeout)
        return reply_type.FromString(raw)

    async def handshake(self, version: str = "1.7.24~ds1") -> api.ConfigureResponse:
        await asyncio.wait_for(self.registered, 2)
        conf = await self.call("Configure", api.ConfigureRequest(runtime_name="containerd", runtime_version=version),
                               api.ConfigureResponse)
        await self.call("Synchronize", api.SynchronizeRequest(), api.SynchronizeResponse)
        return conf

    def raw_write(self, data: bytes) -> None:
        self.writer.write(data)

    async def closed_by_plugin(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.trunk.wait_closed(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def close(self) -> None:
        if self.trunk:
            self.trunk.close()
            self.reader_task.cancel()


class FakeRuntime:
    def __init__(self, path: str) -> None:
        self.path = path
        self.conns: asyncio.Queue[PluginConn] = asyncio.Queue()
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> FakeRuntime:
        async def accept(reader, writer):
            await self.conns.put(PluginConn(reader, writer))
        self.server = await asyncio.start_unix_server(accept, self.path)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def next_plugin(self, timeout: float = 5.0, start: bool = True) -> PluginConn:
        conn = await asyncio.wait_for(self.conns.get(), timeout)
        if start:
            conn.start()
        return conn
