"""Slow-loris HTTP targets for ready-probe tests, served from the test process.

Each server accepts every connection and then either never answers (``silent``) or sends one
byte every half second that never completes a status line (``dribble``: faster than a
reader's per-read timeout, so only a deadline on the whole exchange ends it). They run on one asyncio loop
in a background thread, bound to an address the pods can reach (e.g. every address: pods reach
the host through the sandbox bridge's gateway).
``accepted[port]`` counts the connections each server took, so a test can wait until the
plugin is really probing them.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

from tests.waiting import wait_for


class SlowServers:
    def __init__(self, host: str, modes: list[str], interval: float = 0.5) -> None:
        self.host = host
        self.interval = interval
        self.modes = modes
        self.ports: list[int] = []
        self.accepted: Counter[int] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slow-servers", daemon=True)
        self._servers: list[asyncio.base_events.Server] = []
        self._conns: set[asyncio.StreamWriter] = set()

    def __enter__(self) -> SlowServers:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        for mode in self.modes:
            server = await asyncio.start_server(self._handler(mode), self.host, 0)
            self._servers.append(server)
            port = server.sockets[0].getsockname()[1]
            self.ports.append(port)

    def _handler(self, mode: str):
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted[writer.get_extra_info("sockname")[1]] += 1
            self._conns.add(writer)
            try:
                while True:
                    if mode == "dribble":
                        writer.write(b"X")  # never a line end: a line reader waits forever
                        await writer.drain()
                    try:  # read what the prober sends (never answered); EOF ends the connection
                        if not await asyncio.wait_for(reader.read(4096), self.interval):
                            return
                    except asyncio.TimeoutError:
                        pass
            except (ConnectionError, OSError):
                pass
            finally:
                self._conns.discard(writer)
                writer.close()
        return serve

    async def _stop(self) -> None:
        for server in self._servers:
            server.close()
        for writer in list(self._conns):
            writer.close()

    def wait_probed(self, times: int, timeout: float) -> None:
        """Until every server has accepted ``times`` connections."""
        wait_for(lambda: all(self.accepted[p] >= times for p in self.ports), timeout,
                 f"every slow server probed {times}x (accepted: {dict(self.accepted)})", interval=0.2)
