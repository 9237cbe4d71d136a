"""ttrpc over one logical mux connection: framing, a unary client and a unary server.

Framing (containerd/ttrpc channel.go): a 10-byte big-endian header
``uint32 length | uint32 stream_id | uint8 type | uint8 flags`` then ``length`` bytes of body.
Types: 1 request, 2 response, 3 data (streams; NRI never uses them). Bodies are capped at
4 MiB; a larger incoming body is discarded and its stream answered ResourceExhausted, as the Go
server does. Clients use odd stream ids, starting at 1, strictly increasing.

Request body: ttrpc.Request{service, method, payload, timeout_nano, metadata}. Response body:
ttrpc.Response{status, payload}; an absent status means OK. Unknown services or methods are
answered Unimplemented ("service X" / "method X"): NRI >= 0.12 relies on that to fall back to
StateChange for events a plugin does not implement.

The codec (``encode``, ``TtrpcDecoder``) does no I/O. ``TtrpcServer`` and ``TtrpcClient`` are fed
bytes by the mux and send whole messages through a callable; handler errors become a status
exactly once, in ``TtrpcServer._serve``, which then awaits the optional ``drain`` (flow control
towards a slow peer). The optional ``observe(method, payload, seconds)`` hears how long each call
took from the moment its frame was decoded to its reply being sent (queueing on the event loop
included), for latency figures.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import IntEnum

from ..proto import ttrpc_pb2
from .rpc_errors import Code, ConnectionClosed, LocalProtocolError, RemoteProtocolError, RpcError

log = logging.getLogger("nri_plugin.transport")

HEADER = struct.Struct(">IIBB")
MAX_MESSAGE = 4 << 20


class MessageType(IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


@dataclass(frozen=True, slots=True)
class Message:
    stream_id: int
    type: int
    flags: int
    body: bytes | None  # None: the body was larger than MAX_MESSAGE and was discarded
    length: int


def encode(stream_id: int, mtype: MessageType, body: bytes, flags: int = 0) -> bytes:
    if len(body) > MAX_MESSAGE:
        raise LocalProtocolError(f"ttrpc message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return HEADER.pack(len(body), stream_id, int(mtype), flags) + body


class TtrpcDecoder:
    """Reassembles ttrpc messages from the byte stream of one mux connection."""

    def __init__(self, max_message: int = MAX_MESSAGE) -> None:
        self._buf = bytearray()
        self._max = max_message
        self._skip = 0  # bytes of an oversized body still to discard
        self._skipped: Message | None = None

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while True:
            if self._skip:
                n = min(self._skip, len(self._buf))
                del self._buf[:n]
                self._skip -= n
                if self._skip:
                    return out
                assert self._skipped is not None
                out.append(self._skipped)
                self._skipped = None
            if len(self._buf) < HEADER.size:
                return out
            length, stream_id, mtype, flags = HEADER.unpack_from(self._buf)
            if mtype not in (1, 2, 3):
                raise RemoteProtocolError(f"unknown ttrpc message type {mtype}")
            if length > self._max:
                del self._buf[:HEADER.size]
                self._skip = length
                self._skipped = Message(stream_id, mtype, flags, None, length)
                continue
            end = HEADER.size + length
            if len(self._buf) < end:
                return out
            out.append(Message(stream_id, mtype, flags, bytes(self._buf[HEADER.size:end]), length))
            del self._buf[:end]


Send = Callable[[bytes], None]
# A handler gets the request payload and the caller's deadline (seconds from now, or None).
Handler = Callable[[bytes, float | None], Awaitable[bytes]]
Observer = Callable[[str, bytes, float], None]


def _response(status: Code | int = Code.OK, message: str = "", payload: bytes = b"") -> bytes:
    resp = ttrpc_pb2.Response()
    if status != Code.OK:
        resp.status.code = int(status)
        resp.status.message = message
    else:
        resp.payload = payload
    data: bytes = resp.SerializeToString()
    return data


class TtrpcServer:
    """Serves unary calls. ``handlers`` maps (service, method) to an async handler."""

    def __init__(self, send: Send, handlers: dict[tuple[str, str], Handler],
                 drain: Callable[[], Awaitable[None]] | None = None,
                 observe: Observer | None = None) -> None:
        self._send = send
        self._drain = drain  # flow control: wait after a reply while the peer is behind
        self._observe = observe
        self._handlers = handlers
        self._services = {svc for svc, _ in handlers}
        self._decoder = TtrpcDecoder()
        self._last_stream = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def feed(self, data: bytes) -> None:
        for msg in self._decoder.feed(data):
            self._dispatch(msg)

    def _reply(self, stream_id: int, body: bytes) -> None:
        try:
            self._send(encode(stream_id, MessageType.RESPONSE, body))
        except ConnectionClosed:
            log.debug("dropping reply on stream %d: connection closed", stream_id)
        except LocalProtocolError as exc:
            self._send(encode(stream_id, MessageType.RESPONSE, _response(Code.INTERNAL, str(exc))))

    def _dispatch(self, msg: Message) -> None:
        if msg.type != MessageType.REQUEST:
            log.debug("ignoring ttrpc message type %d on stream %d", msg.type, msg.stream_id)
            return
        if msg.stream_id % 2 == 0:
            self._reply(msg.stream_id, _response(
                Code.INVALID_ARGUMENT, "StreamID must be odd for client initiated streams"))
            return
        if msg.stream_id <= self._last_stream:
            self._reply(msg.stream_id, _response(
                Code.INVALID_ARGUMENT, "StreamID cannot be re-used and must increment"))
            return
        self._last_stream = msg.stream_id
        if msg.body is None:
            self._reply(msg.stream_id, _response(
                Code.RESOURCE_EXHAUSTED,
                f"message length {msg.length} exceed maximum message size of {MAX_MESSAGE}"))
            return
        req = ttrpc_pb2.Request()
        try:
            req.ParseFromString(msg.body)
        except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and friends
            self._reply(msg.stream_id, _response(Code.INVALID_ARGUMENT, f"bad request: {exc}"))
            return
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._serve(msg.stream_id, req, loop.time()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, stream_id: int, req: ttrpc_pb2.Request, received: float) -> None:
        handler = self._handlers.get((req.service, req.method))
        if handler is None:
            what = f"method {req.method}" if req.service in self._services else f"service {req.service}"
            self._reply(stream_id, _response(Code.UNIMPLEMENTED, what))
            return
        deadline = req.timeout_nano / 1e9 if req.timeout_nano > 0 else None
        try:
            payload = await handler(req.payload, deadline)
            body = _response(payload=payload)
        except RpcError as exc:
            body = _response(exc.code, exc.message)
        except asyncio.CancelledError:
            return
        except Exception as exc:  # noqa: BLE001 - every handler error becomes a status, once
            log.exception("handler %s/%s failed", req.service, req.method)
            body = _response(Code.UNKNOWN, f"{type(exc).__name__}: {exc}")
        self._reply(stream_id, body)
        if self._observe is not None:
            self._observe(req.method, req.payload, asyncio.get_running_loop().time() - received)
        if self._drain is not None:
            try:
                await self._drain()
            except ConnectionClosed:
                pass  # the trunk is closed and says why

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class TtrpcClient:
    """Makes unary calls; one future per odd stream id."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._decoder = TtrpcDecoder()
        self._next_stream = 1
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._closed: BaseException | None = None

    async def call(self, service: str, method: str, payload: bytes, timeout: float) -> bytes:
        if self._closed is not None:
            raise ConnectionClosed(f"client closed: {self._closed}")
        stream_id = self._next_stream
        self._next_stream += 2
        req = ttrpc_pb2.Request(
            service=service, method=method, payload=payload, timeout_nano=int(timeout * 1e9))
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = fut
        try:
            self._send(encode(stream_id, MessageType.REQUEST, req.SerializeToString()))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RpcError(Code.DEADLINE_EXCEEDED, f"{service}/{method}: no reply in {timeout}s") from None
        finally:
            self._pending.pop(stream_id, None)

    def feed(self, data: bytes) -> None:
        for msg in self._decoder.feed(data):
            fut = self._pending.get(msg.stream_id)
            if msg.type != MessageType.RESPONSE or fut is None or fut.done():
                log.debug("received message on inactive stream %d", msg.stream_id)
                continue
            if msg.body is None:
                fut.set_exception(RpcError(Code.RESOURCE_EXHAUSTED, "response too large"))
                continue
            resp = ttrpc_pb2.Response()
            try:
                resp.ParseFromString(msg.body)
            except Exception as exc:  # noqa: BLE001
                fut.set_exception(RemoteProtocolError(f"bad response: {exc}"))
                continue
            if resp.HasField("status") and resp.status.code != 0:
                fut.set_exception(RpcError(resp.status.code, resp.status.message))
            else:
                fut.set_result(resp.payload)

    def close(self, exc: BaseException) -> None:
        self._closed = exc
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionClosed(str(exc)))
