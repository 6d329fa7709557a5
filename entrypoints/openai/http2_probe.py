"""A clear answer to HTTP/2 clients: this server speaks HTTP/1.1.

SGLang's router probes every worker it registers for gRPC (HTTP/2 with prior knowledge: the
connection starts with the HTTP/2 preface). aiohttp cannot parse that and logs a 400 with a
stack trace per probe. Instead, a connection whose first bytes are the preface gets what
RFC 9113 prescribes for a server that needs HTTP/1.1: its SETTINGS frame, then GOAWAY with
HTTP_1_1_REQUIRED, and is closed; the client learns at once that no gRPC is served here.
Every other connection is handed to aiohttp untouched.
"""
from __future__ import annotations

import asyncio
import logging
import struct

logger = logging.getLogger(__name__)

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP_1_1_REQUIRED = 0xD
_SETTINGS, _GOAWAY = 0x4, 0x7


def _frame(kind: int, payload: bytes, flags: int = 0, stream: int = 0) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


HTTP2_REFUSAL = _frame(_SETTINGS, b"") + _frame(_GOAWAY, struct.pack(">II", 0, HTTP_1_1_REQUIRED))


class Http1Only(asyncio.Protocol):
    """Wraps aiohttp's protocol for one connection: the first bytes decide whether it is an HTTP/2
    connection (refused as above) or an HTTP/1 one (everything goes to aiohttp from then on)."""

    def __init__(self, inner: asyncio.Protocol) -> None:
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._head = b""
        self._decided = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._decided:
            self._inner.data_received(data)
            return
        self._head += data
        if HTTP2_PREFACE.startswith(self._head[: len(HTTP2_PREFACE)]) and len(self._head) < len(HTTP2_PREFACE):
            return  # could still be the preface: wait for more bytes
        self._decided = True
        head, self._head = self._head, b""
        if head.startswith(HTTP2_PREFACE):
            logger.debug("an HTTP/2 connection (a gRPC probe?) was told to use HTTP/1.1")
            self._transport.write(HTTP2_REFUSAL)
            self._transport.close()
            return
        self._inner.data_received(head)

    def eof_received(self) -> bool | None:
        if not self._decided and self._head:
            self._decided = True
            head, self._head = self._head, b""
            self._inner.data_received(head)
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()
