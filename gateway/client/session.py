"""One WebSocket session with the gateway: connecting, sending, and the reader task that
hands each frame to its context (see the package docstring for how and why)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Generator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tts_gateway.gateway.client.context import Context
from tts_gateway.gateway.client.frames import Alignment, AudioChunk, Done, GatewayError, Word
from tts_gateway.gateway.wire import (
    CLIENT_PING_INTERVAL_S,
    CONTEXT_SURVIVING_CODES,
    PROTOCOL_VERSION,
    SESSION_ENDING_CODES,
    CloseCode,
    ErrorCode,
    GatewayMessage,
)

log = logging.getLogger("tts_gateway.gateway.client")


class _Connecting:
    """What :meth:`TTSClient.connect` returns: ``await`` it, or use it with ``async with``."""

    def __init__(self, opening: Awaitable[TTSClient]) -> None:
        self._opening = opening
        self._client: TTSClient | None = None

    def __await__(self) -> Generator[Any, None, TTSClient]:
        return self._opening.__await__()

    async def __aenter__(self) -> TTSClient:
        self._client = await self._opening
        return self._client

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._client is not None
        await self._client.close()


class TTSClient:
    """One WebSocket session with the gateway, carrying any number of contexts.

    Create it with :meth:`connect`. ``ready`` holds the gateway's ``ready``
    frame (``session_id``, ``voice``, ``sample_rate``, ``encoding``,
    ``voices``): the session defaults that every context inherits.
    """

    def __init__(self, ws: ClientConnection, ready: dict[str, Any], max_queued_chunks: int) -> None:
        self._ws = ws
        self.ready = ready
        self._max_queued_chunks = max_queued_chunks
        self._contexts: dict[str, Context] = {}  # open contexts only, so finished ids can be reused
        self._session_error: GatewayError | None = None  # set once the session is unusable
        self.last_session_error: GatewayError | None = None  # non-fatal errors not tied to a context
        self._reader = asyncio.create_task(self._read_loop(), name=f"tts-reader-{self.session_id}")

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        api_key: str | None = None,
        voice: str | None = None,
        sample_rate: int | None = None,
        encoding: str | None = None,
        inactivity_timeout: float | None = None,
        word_timings: bool | None = None,
        use_header: bool = True,
        ready_timeout: float = 10.0,
        max_queued_chunks: int = 1024,
        **ws_kwargs: Any,
    ) -> _Connecting:
        """Open a session and wait for the gateway's ``ready`` frame.

        Use as ``tts = await TTSClient.connect(...)`` or
        ``async with TTSClient.connect(...) as tts: ...``.

        ``voice``, ``sample_rate`` and ``encoding`` set the session defaults
        (sent as query parameters). ``inactivity_timeout`` (seconds) asks the
        gateway to close the session after this long without a message, a ping or
        audio instead of after its own default; the client pings a quiet session
        on its own (every ``CLIENT_PING_INTERVAL_S`` seconds, or twice per
        inactivity timeout if that is shorter; ``ping_interval=None`` turns it
        off), so a session lives as long as its client does. ``word_timings=False``
        asks for no ``alignment`` frames. ``api_key`` travels in an
        ``Authorization: Bearer`` header, or in the ``api_key`` query
        parameter when ``use_header`` is False; a short-lived token from
        ``POST /v1/tokens`` may stand in for it in the header. Other keyword arguments go to
        ``websockets.asyncio.client.connect``; compression is off by default
        because PCM barely compresses and deflate only adds latency.

        Raises ``websockets.InvalidStatus`` when the handshake is refused (401:
        bad or missing key); :class:`GatewayError` when the gateway refuses the
        session (``overloaded``; or ``unknown_voice`` / ``unsupported_format``
        for bad defaults) or does not speak protocol v1; ``OSError`` or
        ``TimeoutError`` when it cannot be reached.
        """
        query = {"voice": voice, "sample_rate": sample_rate, "encoding": encoding,
                 "inactivity_timeout": inactivity_timeout,
                 "word_timings": None if word_timings is None else str(word_timings).lower()}
        if api_key is not None and not use_header:
            query["api_key"] = api_key
        headers = dict(ws_kwargs.pop("additional_headers", None) or {})
        if api_key is not None and use_header:
            headers["Authorization"] = f"Bearer {api_key}"
        ws_kwargs.setdefault("compression", None)
        ping_interval = CLIENT_PING_INTERVAL_S if inactivity_timeout is None else min(
            CLIENT_PING_INTERVAL_S, inactivity_timeout / 2
        )
        ws_kwargs.setdefault("ping_interval", ping_interval)
        return _Connecting(
            cls._open(_with_query(url, query), headers or None, ready_timeout, max_queued_chunks, ws_kwargs)
        )

    @classmethod
    async def _open(
        cls,
        url: str,
        headers: dict[str, str] | None,
        ready_timeout: float,
        max_queued_chunks: int,
        ws_kwargs: dict[str, Any],
    ) -> TTSClient:
        ws = await ws_connect(url, additional_headers=headers, **ws_kwargs)
        try:
            ready = await asyncio.wait_for(_receive_ready(ws), ready_timeout)
        except BaseException:
            await ws.close()
            raise
        return cls(ws, ready, max_queued_chunks)

    # -- session info ----------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self.ready["session_id"]

    @property
    def voices(self) -> list[dict[str, Any]]:
        return self.ready.get("voices", [])

    @property
    def closed(self) -> bool:
        return self._reader.done()

    # -- contexts --------------------------------------------------------------

    def context(
        self,
        context_id: str | None = None,
        *,
        voice: str | None = None,
        sample_rate: int | None = None,
        encoding: str | None = None,
        speed: float | None = None,
    ) -> Context:
        """Open a context; ``context_id=None`` picks a unique id.

        The options override the session defaults for this context only and
        travel with its first text, so the gateway's checks (unknown voice,
        format, context cap) surface as a :class:`GatewayError` from iteration
        after the first :meth:`Context.send_text`. An id can be reused once
        its previous context finished.
        """
        if self._session_error is not None:
            raise self._session_error
        if context_id is None:
            context_id = f"ctx-{uuid.uuid4().hex[:12]}"
        if context_id in self._contexts:
            raise ValueError(f"context {context_id!r} is still open on this session")
        options = {"voice": voice, "sample_rate": sample_rate, "encoding": encoding, "speed": speed}
        options = {name: value for name, value in options.items() if value is not None}
        ctx = Context(self, context_id, options, self._max_queued_chunks)
        self._contexts[context_id] = ctx
        return ctx

    # -- lifecycle -------------------------------------------------------------

    async def close(self) -> None:
        """Close the socket (code 1000). Contexts still open end with ``connection_closed``."""
        # Stop the reader first: it may be parked on a full queue that nobody reads.
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        # Keep reading (and dropping) frames meanwhile: with the receive buffer
        # full, the gateway's answering close frame would never be read and the
        # close would wait for its timeout.
        discarding = asyncio.create_task(self._discard_incoming())
        await self._ws.close()
        await discarding
        closing = GatewayError("connection_closed", "the client closed the session", close_code=CloseCode.NORMAL)
        self._fail_all(closing)

    async def __aenter__(self) -> TTSClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals -------------------------------------------------------------

    async def _discard_incoming(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                await self._ws.recv()

    async def _send(self, message: dict[str, Any]) -> None:
        if self._session_error is not None:
            raise self._session_error
        try:
            await self._ws.send(orjson.dumps(message), text=True)
        except ConnectionClosed as exc:
            # The reader sees the same close and records the gateway's reason
            # (its error frame); give it a moment so the caller gets that.
            await asyncio.wait([self._reader], timeout=1.0)
            raise self._session_error or _closed_error(exc) from None

    def _forget(self, ctx: Context) -> None:
        if self._contexts.get(ctx.context_id) is ctx:
            del self._contexts[ctx.context_id]

    def _fail_all(self, error: GatewayError) -> None:
        if self._session_error is None:
            self._session_error = error
        for ctx in self._contexts.values():
            ctx._fail(error)
        self._contexts.clear()

    async def _read_loop(self) -> None:
        try:
            await self._dispatch_frames()
        except ConnectionClosed as exc:
            error = self._session_error or _closed_error(exc)
            error.close_code = exc.rcvd.code if exc.rcvd else None
            self._fail_all(error)
        except _ProtocolViolation as exc:
            self._fail_all(GatewayError("protocol_error", str(exc)))
            await self._ws.close(CloseCode.PROTOCOL_ERROR, "protocol error")
        except Exception as exc:  # a bug here must not leave consumers hanging
            log.exception("tts client reader crashed")
            self._fail_all(GatewayError(ErrorCode.INTERNAL, f"client reader crashed: {exc!r}"))
            await self._ws.close(CloseCode.INTERNAL_ERROR, "client error")

    async def _dispatch_frames(self) -> None:
        pending_audio: dict[str, Any] | None = None  # an audio header waiting for its binary frame
        while True:
            frame = await self._ws.recv()
            if isinstance(frame, bytes):
                if pending_audio is None:
                    raise _ProtocolViolation("binary frame without a preceding audio header")
                header, pending_audio = pending_audio, None
                await self._deliver_audio(header, frame)
                continue
            if pending_audio is not None:
                raise _ProtocolViolation("audio header not followed by its binary frame")
            try:
                message = orjson.loads(frame)
                kind = message["type"]
            except (orjson.JSONDecodeError, TypeError, KeyError):
                raise _ProtocolViolation(f"unreadable frame from the gateway: {frame[:200]!r}") from None
            if kind == GatewayMessage.AUDIO:
                pending_audio = message
            elif kind == GatewayMessage.ALIGNMENT:
                ctx = self._contexts.get(message.get("context_id"))
                if ctx is not None and not ctx._cancel_requested:
                    words = tuple(Word(w["text"], w["start_ms"], w["end_ms"]) for w in message.get("words", ()))
                    ctx.alignments.extend(words)
                    await ctx._queue.put(Alignment(ctx.context_id, words))
            elif kind == GatewayMessage.DONE:
                ctx = self._contexts.pop(message.get("context_id"), None)
                if ctx is not None:
                    ctx.done = Done(ctx.context_id, message.get("audio_ms", 0.0), message.get("ttfa_ms"))
                    # A cancel that crossed `done` on the wire: its tail was discarded all the same.
                    ctx.cancelled = ctx._cancel_requested
                    ctx._mark_ended()
            elif kind == GatewayMessage.CANCELLED:
                ctx = self._contexts.pop(message.get("context_id"), None)
                if ctx is not None:
                    ctx.cancelled = True
                    ctx._mark_ended()
            elif kind == GatewayMessage.ERROR:
                await self._deliver_error(message)
            else:
                log.debug("ignoring frame of unknown type %r", kind)  # a newer gateway

    async def _deliver_audio(self, header: dict[str, Any], data: bytes) -> None:
        announced = header.get("bytes")
        if announced is not None and announced != len(data):
            raise _ProtocolViolation(f"audio header announced {announced} bytes, the binary frame has {len(data)}")
        ctx = self._contexts.get(header.get("context_id"))
        if ctx is None or ctx._cancel_requested:
            return  # a context we cancelled (barge-in) or never opened
        try:
            chunk = AudioChunk(ctx.context_id, header["seq"], header["offset_ms"], header["duration_ms"], data)
        except KeyError as exc:
            raise _ProtocolViolation(f"audio header without {exc.args[0]!r}") from None
        await ctx._queue.put(chunk)  # waits while the consumer lags: see "Backpressure" in gateway/client/__init__.py

    async def _deliver_error(self, message: dict[str, Any]) -> None:
        context_id = message.get("context_id")
        error = GatewayError(message.get("code", ErrorCode.INTERNAL), message.get("message", ""), context_id)
        if context_id is None:
            if error.code in SESSION_ENDING_CODES:
                self._fail_all(error)  # the close that follows only adds its close code
            else:
                # A malformed frame the gateway could not tie to a context; the
                # session is still usable.
                log.warning("gateway reported a session error: %s", error)
                self.last_session_error = error
            return
        ctx = self._contexts.get(context_id)
        if ctx is None:
            # E.g. unknown_context for a cancel that crossed `done` on the wire.
            log.debug("error for a context that is not open: %s", error)
            return
        ctx.error = error
        if error.code in CONTEXT_SURVIVING_CODES and ctx._texts_sent == 1:
            # The rejected text was the context's first, so the gateway did not
            # open the context: the next text must carry the options again.
            ctx._texts_sent = 0
        await ctx._queue.put(error)  # raised in stream order, after the audio before it
        if error.code not in CONTEXT_SURVIVING_CODES:
            # Marked only once the error is queued, so a consumer draining the
            # queue meanwhile cannot stop without seeing it.
            self._forget(ctx)
            ctx._ended = True


class _ProtocolViolation(Exception):
    """The gateway broke the framing rules; nothing after this can be trusted."""



async def _receive_ready(ws: ClientConnection) -> dict[str, Any]:
    try:
        frame = await ws.recv()
    except ConnectionClosed as exc:
        raise _closed_error(exc) from None
    if isinstance(frame, bytes):
        raise GatewayError("protocol_error", "expected a `ready` frame, got a binary frame")
    try:
        message = orjson.loads(frame)
    except orjson.JSONDecodeError:
        raise GatewayError("protocol_error", f"expected a `ready` frame, got {frame[:200]!r}") from None
    if message.get("type") == GatewayMessage.ERROR:  # refused: overloaded, or a bad session default
        raise GatewayError(message.get("code", ErrorCode.INTERNAL), message.get("message", ""), None)
    if message.get("type") != GatewayMessage.READY:
        raise GatewayError("protocol_error", f"expected a `ready` frame, got {message.get('type')!r}")
    if message.get("protocol") != PROTOCOL_VERSION:
        raise GatewayError(
            "protocol_error",
            f"the gateway speaks protocol {message.get('protocol')!r}, this client speaks {PROTOCOL_VERSION}",
        )
    return message


def _closed_error(exc: ConnectionClosed) -> GatewayError:
    code = exc.rcvd.code if exc.rcvd else None
    if code is None:
        detail = "without a close frame"
    else:
        detail = f"with code {code}" + (f" ({exc.rcvd.reason})" if exc.rcvd.reason else "")
    return GatewayError("connection_closed", f"the gateway closed the connection {detail}", close_code=code)


def _with_query(url: str, params: dict[str, Any]) -> str:
    """Add the non-None ``params`` to ``url``'s query string, keeping what is already there."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    query.update({name: str(value) for name, value in params.items() if value is not None})
    return urlunsplit(parts._replace(query=urlencode(query)))

