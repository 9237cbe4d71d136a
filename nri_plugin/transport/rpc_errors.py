"""Errors of the NRI transport (mux and ttrpc), kept apart from Rekindle's engine errors.

Who broke the protocol matters for the log line a node operator reads: ``LocalProtocolError``
means we were about to send something invalid, ``RemoteProtocolError`` that the runtime sent
something we cannot parse. ``RpcError`` is a well-formed error status from the other side.
"""

from __future__ import annotations

from enum import IntEnum


class Code(IntEnum):
    """gRPC status codes, as ttrpc uses them."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class TransportError(Exception):
    """Base class of every transport failure."""


class ProtocolError(TransportError):
    """The byte stream violates the mux or ttrpc framing."""


class LocalProtocolError(ProtocolError):
    """We were about to send something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""


class ConnectionClosed(TransportError):
    """The trunk is closed (EOF, reset, or closed by us)."""


class RpcError(TransportError):
    """A call ended with a non-OK status."""

    def __init__(self, code: int, message: str) -> None:
        try:
            name = Code(code).name
        except ValueError:
            name = str(code)
        super().__init__(f"rpc error: code = {name} desc = {message}")
        self.code = code
        self.message = message
