"""Framing of the NRI mux and ttrpc layers, on bytes only."""

from __future__ import annotations

import asyncio
import random

import pytest

from nri_plugin.proto import ttrpc_pb2
from nri_plugin.transport import mux, ttrpc
from nri_plugin.transport.rpc_errors import LocalProtocolError, RemoteProtocolError


def test_mux_header_is_conn_id_then_length_big_endian():
    assert mux.encode_message(2, b"abc") == [b"\x00\x00\x00\x02\x00\x00\x00\x03abc"]


@pytest.mark.parametrize(
    "size, frames",
    [(1, [1]), (4096, [4096]), (4097, [4096, 1]), (6000, [4096, 1904]), (3 << 20, [4096, (3 << 20) - 4096])],
    ids=["tiny", "exactly-4096", "one-over", "6000", "3MiB"],
)
def test_mux_splits_messages_per_go_bufio_rule(size, frames):
    out = mux.encode_message(1, b"x" * size)
    assert [len(f) - mux.HEADER.size for f in out] == frames


def test_mux_refuses_empty_and_oversized_messages():
    with pytest.raises(LocalProtocolError):
        mux.encode_message(1, b"")
    with pytest.raises(LocalProtocolError):
        mux.encode_message(0, b"x")


def test_mux_decoder_reassembles_across_arbitrary_read_boundaries():
    stream = b"".join(mux.encode_message(1, b"a" * 5000) + mux.encode_message(2, b"b" * 10))
    rng = random.Random(7)
    dec, frames, pos = mux.MuxDecoder(), [], 0
    while pos < len(stream):
        step = rng.randint(1, 700)
        frames += dec.feed(stream[pos:pos + step])
        pos += step
    assert [(f.conn_id, len(f.payload)) for f in frames] == [(1, 4096), (1, 904), (2, 10)]
    assert dec.pending == 0


def test_mux_decoder_rejects_frames_over_16MiB():
    with pytest.raises(RemoteProtocolError):
        mux.MuxDecoder().feed(mux.HEADER.pack(1, (16 << 20) + 1))


def test_ttrpc_header_layout():
    raw = ttrpc.encode(5, ttrpc.MessageType.RESPONSE, b"xy")
    assert raw == b"\x00\x00\x00\x02\x00\x00\x00\x05\x02\x00xy"


def test_ttrpc_decoder_discards_oversized_body_and_reports_its_stream():
    big = ttrpc.MAX_MESSAGE + 10
    data = ttrpc.HEADER.pack(big, 7, 1, 0) + b"\0" * big + ttrpc.encode(9, ttrpc.MessageType.REQUEST, b"ok")
    dec = ttrpc.TtrpcDecoder()
    msgs = []
    for i in range(0, len(data), 1 << 20):
        msgs += dec.feed(data[i:i + (1 << 20)])
    assert [(m.stream_id, m.body) for m in msgs] == [(7, None), (9, b"ok")]


def test_ttrpc_decoder_rejects_unknown_message_type():
    with pytest.raises(RemoteProtocolError):
        ttrpc.TtrpcDecoder().feed(ttrpc.HEADER.pack(0, 1, 9, 0))


def _serve_one(handlers, request_bytes):
    return asyncio.run(_serve_one_async(handlers, request_bytes))


async def _serve_one_async(handlers, request_bytes):
    sent = []
    server = ttrpc.TtrpcServer(sent.append, handlers)
    server.feed(request_bytes)
    for _ in range(20):
        if sent:
            break
        await asyncio.sleep(0.01)
    (msg,) = ttrpc.TtrpcDecoder().feed(sent[0])
    return msg, ttrpc_pb2.Response.FromString(msg.body)


def _request(stream_id, service, method, payload=b""):
    body = ttrpc_pb2.Request(service=service, method=method, payload=payload).SerializeToString()
    return ttrpc.encode(stream_id, ttrpc.MessageType.REQUEST, body)


@pytest.mark.parametrize(
    "service, method, code, text",
    [("svc", "Nope", 12, "method Nope"), ("other", "X", 12, "service other")],
    ids=["unknown-method", "unknown-service"],
)
def test_ttrpc_server_answers_unimplemented_like_go(service, method, code, text):
    async def echo(payload, deadline):
        return payload
    msg, resp = _serve_one({("svc", "Echo"): echo}, _request(1, service, method))
    assert (msg.stream_id, resp.status.code, resp.status.message) == (1, code, text)


def test_ttrpc_server_success_has_no_status_and_echoes_stream():
    async def echo(payload, deadline):
        return payload
    msg, resp = _serve_one({("svc", "Echo"): echo}, _request(3, "svc", "Echo", b"hi"))
    assert msg.stream_id == 3 and not resp.HasField("status") and resp.payload == b"hi"


def test_ttrpc_server_reports_each_calls_time_from_decode_to_reply():
    seen = []

    async def slow(payload, deadline):
        await asyncio.sleep(0.05)
        return payload

    async def body():
        sent = []
        server = ttrpc.TtrpcServer(sent.append, {("svc", "Slow"): slow},
                                   observe=lambda m, p, s: seen.append((m, p, s)))
        server.feed(_request(5, "svc", "Slow", b"x"))
        while not sent:
            await asyncio.sleep(0.01)

    asyncio.run(body())
    (method, payload, seconds), = seen
    assert (method, payload) == ("Slow", b"x") and 0.05 <= seconds < 1.0


def test_ttrpc_server_rejects_even_stream_ids():
    msg, resp = _serve_one({}, _request(2, "svc", "Echo"))
    assert resp.status.code == 3 and "odd" in resp.status.message


def test_ttrpc_server_maps_handler_exceptions_to_a_status():
    async def boom(payload, deadline):
        raise ValueError("bad input")
    msg, resp = _serve_one({("svc", "Boom"): boom}, _request(1, "svc", "Boom"))
    assert resp.status.code == 2 and "bad input" in resp.status.message
