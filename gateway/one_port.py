"""One port for every route: the WebSocket endpoint and the HTTP routes behind one socket.

Two well-kept libraries serve the routes, each on its ordinary path: websockets serves
``/v1/stream`` and aiohttp every plain HTTP route (GET and POST). websockets owns the
listening socket, and :func:`websockets.asyncio.server.serve` lets its caller wrap the
asyncio protocol of each accepted connection (``create_connection``). The wrapper here,
:class:`FrontDoor`, reads the head of the connection's first request, then hands the
transport and the bytes read so far to the protocol that serves that path: the
websockets connection for ``GET /v1/stream``, else a fresh aiohttp request handler. From
there either runs exactly as if it had accepted the connection itself.

The front door bounds the head in size and in time, so a silent or trickling client
holds no connection for long. Every plain HTTP response closes its connection
(``Connection: close``, as the WebSocket server's own HTTP answers always did), so every
request on the port passes the front door: an HTTP connection can never turn into a
WebSocket one or the other way round. A TCP handshake per HTTP request costs little
beside the speech it asks for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import orjson

from tts_gateway.gateway.wire import STREAM_PATH

log = logging.getLogger("tts_gateway.http")

# The longest request head (request line and headers) the port reads; aiohttp and
# websockets both refuse single lines over 8 KiB.
MAX_HEAD_BYTES = 64 * 1024
END_OF_HEAD = b"\r\n\r\n"


def log_request(method: str, path: str, status: int) -> None:
    """The one INFO line each request on the port gets, whichever library served it. The path
    without its query, which may hold an API key."""
    log.info("%s %s %d", method, path, status)


class WebSocketsLog(logging.LoggerAdapter):
    """The logger handed to websockets: its INFO lines (connection open, rejected, closed; server
    listening, closing) go to DEBUG. They name no path (a plain GET of the stream path gave two
    of them), and :func:`log_request` already says what each handshake did."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        super().log(logging.DEBUG if level == logging.INFO else level, msg, *args, **kwargs)


class FrontDoor(asyncio.Protocol):
    """A new connection until its first request head is read; then the protocol that serves it."""

    def __init__(
        self, websocket: asyncio.Protocol, http: Callable[[], asyncio.Protocol], head_timeout: float
    ) -> None:
        self._websocket = websocket
        self._http = http
        self._head_timeout = head_timeout
        self._head = bytearray()
        self._transport: Any = None  # an asyncio.Transport, or uvloop's (not a subclass of it)
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(self._head_timeout, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        # Only the new bytes (and the three before them) can complete the head's end: a head
        # trickled in byte by byte is not searched again from its start each time.
        searched = max(0, len(self._head) - len(END_OF_HEAD) + 1)
        self._head += data
        end = self._head.find(END_OF_HEAD, searched)
        if not 0 <= end <= MAX_HEAD_BYTES:
            if len(self._head) > MAX_HEAD_BYTES:
                self._refuse(431, "Request Header Fields Too Large", f"the request head exceeds {MAX_HEAD_BYTES} bytes")
            return
        self._stop_timer()
        target = self._websocket if _opens_a_websocket(self._head) else self._http()
        transport, self._transport = self._transport, None
        transport.set_protocol(target)
        target.connection_made(transport)
        target.data_received(bytes(self._head))

    def eof_received(self) -> bool:
        return False  # the client gave up before its request was complete: close

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()

    def _head_timed_out(self) -> None:
        self._refuse(408, "Request Timeout", f"no complete request head within {self._head_timeout:g} s")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer with the routes' JSON error and close: the request never reached a route."""
        self._stop_timer()
        if self._transport is None:
            return
        log.info("connection from %s dropped: %s", self._transport.get_extra_info("peername"), message)
        body = orjson.dumps({"error": {"code": "bad_request", "message": message}})
        self._transport.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
        )
        self._transport.close()
        self._transport = None

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _opens_a_websocket(head: bytes) -> bool:
    """Whether the request line is ``GET /v1/stream[?query] HTTP/1.1``. Anything else goes to
    the HTTP routes, which answer every request (a POST to the stream's path gets 405, a
    malformed request 400)."""
    parts = head[: head.find(b"\r\n")].split(b" ")
    return len(parts) == 3 and parts[0] == b"GET" and urlsplit(parts[1].decode("latin-1")).path == STREAM_PATH
