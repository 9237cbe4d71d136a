"""The NRI multiplexer: several logical connections over one unix stream socket.

Wire format (containerd/nri pkg/net/multiplex): every frame is an 8-byte header
``uint32 BE conn_id | uint32 BE payload_len`` followed by the payload. There are no open or
close frames; both ends simply agree on the ids (1: the plugin's service, served by us;
2: the runtime's service, called by us). Frames carry bytes, not messages: a ttrpc message may
span frames, so reassembly is per connection id.

The 4096-byte rule: the Go side reads each logical connection through a 4096-byte bufio
reader, and a single frame larger than the free buffer kills the connection. So, as Go's own
bufio writer does, every ttrpc message starts a new frame, and a message longer than 4096 bytes
is sent as exactly two frames: its first 4096 bytes, then all the rest (the Go reader takes a
large remainder with a direct read). Splitting into many small frames would risk the Go side's
256-frame queue for big messages instead.

This module is sans-I/O (``MuxDecoder``, ``encode_message``) plus a thin asyncio adapter
(``MuxTrunk``) that owns the socket: one reader task, writes under the event loop's
single-threadedness (all frames of one message are written without yielding), the first error
sticks and closes the whole trunk.

Writes are bounded: a runtime that stops reading must not make the plugin buffer without
limit. Above ``WRITE_HIGH_WATER`` buffered bytes, ``drain()`` waits for the peer (the ttrpc
server drains after each reply); once more than ``MAX_WRITE_BUFFER`` bytes are queued, the
trunk is aborted (not closed: a graceful close would wait for the peer to read the buffer)
with ``WriteBufferFull``, and the stub reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

from .rpc_errors import ConnectionClosed, LocalProtocolError, RemoteProtocolError

log = logging.getLogger("nri_plugin.transport")

PLUGIN_SERVICE_CONN = 1
RUNTIME_SERVICE_CONN = 2

HEADER = struct.Struct(">II")
GO_READ_BUFFER = 4096
# The Go writer refuses payloads above 16 MiB; accept up to that, nothing more.
MAX_FRAME_PAYLOAD = 16 << 20
# Outgoing bytes the transport may hold for a slow reader, and the point where it is dropped.
WRITE_HIGH_WATER = 1 << 20
MAX_WRITE_BUFFER = 16 << 20


class WriteBufferFull(ConnectionClosed):
    """The runtime stopped reading: more than MAX_WRITE_BUFFER bytes were waiting for it."""


@dataclass(frozen=True, slots=True)
class Frame:
    conn_id: int
    payload: bytes


def encode_message(conn_id: int, message: bytes) -> list[bytes]:
    """Frames (header included) carrying one whole ttrpc message, per the 4096-byte rule."""
    if conn_id <= 0 or conn_id > 0xFFFFFFFF:
        raise LocalProtocolError(f"invalid mux connection id {conn_id}")
    if not message:
        raise LocalProtocolError("refusing to send an empty mux frame")
    if len(message) > MAX_FRAME_PAYLOAD:
        raise LocalProtocolError(f"message of {len(message)} bytes exceeds the mux limit")
    if len(message) <= GO_READ_BUFFER:
        chunks = [message]
    else:
        chunks = [message[:GO_READ_BUFFER], message[GO_READ_BUFFER:]]
    return [HEADER.pack(conn_id, len(chunk)) + chunk for chunk in chunks]


class MuxDecoder:
    """Turns bytes read from the trunk into frames. Raises RemoteProtocolError on garbage."""

    def __init__(self, max_payload: int = MAX_FRAME_PAYLOAD) -> None:
        self._buf = bytearray()
        self._max = max_payload

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        frames: list[Frame] = []
        while len(self._buf) >= HEADER.size:
            conn_id, length = HEADER.unpack_from(self._buf)
            if length > self._max:
                raise RemoteProtocolError(f"mux frame of {length} bytes exceeds {self._max}")
            end = HEADER.size + length
            if len(self._buf) < end:
                break
            frames.append(Frame(conn_id, bytes(self._buf[HEADER.size:end])))
            del self._buf[:end]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still buffered (for truncation checks)."""
        return len(self._buf)


FrameHandler = Callable[[bytes], None]


class MuxTrunk:
    """asyncio adapter: reads frames from a stream and routes their payloads by conn id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_buffer: int = MAX_WRITE_BUFFER, high_water: int = WRITE_HIGH_WATER) -> None:
        self._reader = reader
        self._writer = writer
        self._max_buffer = max_buffer
        writer.transport.set_write_buffer_limits(high=min(high_water, max_buffer))
        self._decoder = MuxDecoder()
        self._handlers: dict[int, FrameHandler] = {}
        self._closed = asyncio.Event()
        self.error: BaseException | None = None

    def route(self, conn_id: int, handler: FrameHandler) -> None:
        """Deliver the payload bytes of every frame on ``conn_id`` to ``handler``."""
        self._handlers[conn_id] = handler

    def send(self, conn_id: int, message: bytes) -> None:
        """Queue one whole ttrpc message; never interleaved with another message of any conn."""
        if self._closed.is_set():
            raise ConnectionClosed("mux trunk is closed")
        for frame in encode_message(conn_id, message):
            self._writer.write(frame)
        buffered = self._writer.transport.get_write_buffer_size()
        if buffered > self._max_buffer:
            error = WriteBufferFull(f"runtime stopped reading: {buffered} bytes waiting, limit {self._max_buffer}")
            log.error("%s; dropping the connection", error)
            self.close(error, abort=True)
            raise error

    def has_room(self, size: int) -> bool:
        """Whether a message of ``size`` bytes can be queued without passing the buffer cap."""
        return self._writer.transport.get_write_buffer_size() + size + 2 * HEADER.size <= self._max_buffer

    async def drain(self) -> None:
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            self.close(exc)
            raise ConnectionClosed(str(exc)) from exc

    async def run(self) -> None:
        """Read until EOF or error; then close. Handler errors close the trunk too."""
        try:
            while True:
                data = await self._reader.read(65536)
                if not data:
                    if self._decoder.pending:
                        raise RemoteProtocolError(
                            f"trunk closed inside a frame ({self._decoder.pending} bytes pending)"
                        )
                    raise ConnectionClosed("runtime closed the connection")
                for frame in self._decoder.feed(data):
                    handler = self._handlers.get(frame.conn_id)
                    if handler is None:
                        # The Go reader drops frames of unknown connections too.
                        log.debug("dropping frame for unknown mux conn %d", frame.conn_id)
                        continue
                    handler(frame.payload)
        except asyncio.CancelledError:
            self.close(ConnectionClosed("cancelled"))
            raise
        except BaseException as exc:  # noqa: BLE001 - the first error sticks and closes all
            self.close(exc)

    def close(self, exc: BaseException | None = None, abort: bool = False) -> None:
        if self._closed.is_set():
            return
        self.error = exc
        self._closed.set()
        try:
            if abort:
                self._writer.transport.abort()  # drop what is buffered: the peer is not reading
            else:
                self._writer.close()
        except (OSError, RuntimeError):
            pass

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> BaseException | None:
        await self._closed.wait()
        return self.error
