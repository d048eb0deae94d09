"""Async Python client for the tts-gateway streaming protocol (v1).

Built for LLM agents: connect once, open one context per reply, push the
model's text deltas as they arrive, and iterate the audio as it is produced::

    from gateway.client import TTSClient

    async with TTSClient.connect("ws://127.0.0.1:8765/v1/stream", api_key=KEY) as tts:
        reply = tts.context(voice="joe")

        async def pump():
            async for delta in llm_stream():
                await reply.send_text(delta)
            await reply.end()

        pump_task = asyncio.create_task(pump())
        async for chunk in reply:            # AudioChunk objects, in order
            play(chunk.data)
        print(reply.done.ttfa_ms, reply.alignments)

or, when nothing else needs doing meanwhile, ``audio = await reply.speak(deltas)``.

How frames reach a context
--------------------------
One reader task owns the receiving side of the socket. It pairs every
``audio`` header with the binary frame that follows it and puts the resulting
:class:`AudioChunk` on its context's queue. Word timings (``alignment``) are
appended to ``Context.alignments`` as they arrive; ``done`` / ``cancelled``
set ``Context.done`` / ``Context.cancelled`` and end the context's iteration
once its queued audio has been consumed.

Backpressure
------------
Each context's queue is bounded (``max_queued_chunks``, default 1024 chunks,
i.e. minutes of audio). When a consumer falls that far behind, the reader waits
for it instead of buffering more. The socket then stops being read, which
stalls every context of the session and, once the gateway's per-session send
buffer is full, makes the gateway cut the session off: error ``overloaded``
and close code 1008, or ``connection_closed`` when that frame, stuck behind
the unread audio, is not reached before the gateway aborts the connection.
Memory stays bounded either way. Audio of a context you
cancelled is discarded, so a cancelled context never blocks the reader; but do
not open a context and leave its audio unread.

Errors
------
Everything the gateway reports, and every way a session can end, surfaces as
:class:`GatewayError`. Its ``code`` is one of the protocol's error codes or one
of two client-side codes: ``connection_closed`` (the socket closed without an
explanatory ``error`` frame) and ``protocol_error`` (the gateway broke the
framing rules, e.g. a binary frame without an ``audio`` header). A handshake
refused over HTTP (401 for a bad key) raises ``websockets.InvalidStatus``
from :meth:`TTSClient.connect`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import wave
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Generator, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from gateway.wire import (
    CONTEXT_SURVIVING_CODES,
    PROTOCOL_VERSION,
    SESSION_ENDING_CODES,
    ClientMessage,
    CloseCode,
    ErrorCode,
    GatewayMessage,
)

__all__ = [
    "AudioChunk",
    "Context",
    "Done",
    "GatewayError",
    "TTSClient",
    "Word",
    "write_wav",
]

log = logging.getLogger("gateway.client")


class GatewayError(Exception):
    """An ``error`` frame from the gateway, or the session ending under us.

    ``code`` is a protocol error code (``bad_message``, ``unknown_voice``, ...)
    or a client-side one: ``connection_closed`` or ``protocol_error``.
    ``context_id`` is None for session-level errors. ``close_code`` is the
    WebSocket close code when the error ended the connection, else None.
    """

    def __init__(
        self,
        code: str,
        message: str,
        context_id: str | None = None,
        close_code: int | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = str(code)  # a plain string, whether it came off the wire or from wire.ErrorCode
        self.message = message
        self.context_id = context_id
        self.close_code = close_code


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """One ``audio`` header with its binary frame: mono samples in the context's format."""

    context_id: str
    seq: int
    offset_ms: float
    duration_ms: float
    data: bytes


@dataclass(frozen=True, slots=True)
class Word:
    """A word's timing on the context's audio timeline (from ``alignment`` frames)."""

    text: str
    start_ms: float
    end_ms: float


@dataclass(frozen=True, slots=True)
class Done:
    """The gateway finished speaking a context.

    ``ttfa_ms`` is measured by the gateway (first ``text`` received -> first
    audio sent); None when the context produced no audio.
    """

    context_id: str
    audio_ms: float
    ttfa_ms: float | None


# Queued to wake a consumer blocked on an empty queue so it re-checks the end state.
_WAKE = object()


class Context:
    """One utterance stream: text in, audio out. Get one from :meth:`TTSClient.context`.

    Iterate it (``async for chunk in ctx``) to receive :class:`AudioChunk`
    objects in order. Iteration ends after the gateway's ``done`` or
    ``cancelled`` (queued audio is yielded first) and raises
    :class:`GatewayError` when the gateway reports an error for this context
    or the session ends. After ``text_too_long`` or ``bad_message`` the
    context is still open: iterate again to continue.
    """

    def __init__(self, client: TTSClient, context_id: str, options: dict[str, Any], max_queued_chunks: int) -> None:
        self._client = client
        self.context_id = context_id
        self._options = options  # voice/sample_rate/encoding/speed, sent with the first text only
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=max_queued_chunks)
        self._texts_sent = 0
        self._end_sent = False
        self._cancel_requested = False
        self._ended = False  # nothing more will be queued: stop once the queue is drained
        self._fatal: GatewayError | None = None  # the session died: raise once the queue is drained

        self.done: Done | None = None
        self.cancelled = False
        self.alignments: list[Word] = []
        self.error: GatewayError | None = None  # the last error the gateway reported for this context

    # -- this context's audio format ----------------------------------------

    @property
    def voice(self) -> str:
        return self._options.get("voice") or self._client.ready["voice"]

    @property
    def sample_rate(self) -> int:
        return self._options.get("sample_rate") or self._client.ready["sample_rate"]

    @property
    def encoding(self) -> str:
        return self._options.get("encoding") or self._client.ready["encoding"]

    @property
    def finished(self) -> bool:
        """True once the context ended: done, cancelled, refused, or its session lost."""
        return self._ended or self._fatal is not None

    @property
    def _text_sent(self) -> bool:
        """Whether the gateway knows this context: it opens with the first text."""
        return self._texts_sent > 0

    # -- client -> gateway ---------------------------------------------------

    async def send_text(self, text: str) -> None:
        """Append a text delta (any split, mid-word is fine). Empty deltas are skipped."""
        self._check_open("send_text")
        if not text:
            return
        message: dict[str, Any] = {"type": ClientMessage.TEXT, "context_id": self.context_id, "text": text}
        if not self._text_sent:
            message.update(self._options)
        await self._client._send(message)
        self._texts_sent += 1

    async def flush(self) -> None:
        """Speak everything buffered so far now; the context stays open."""
        self._check_open("flush")
        if self._text_sent:  # before any text the gateway does not know this context
            await self._client._send({"type": ClientMessage.FLUSH, "context_id": self.context_id})

    async def end(self) -> None:
        """No more text: the gateway speaks the rest, then iteration ends with ``done``.

        Idempotent; a no-op on a finished or cancelled context. A context that
        never got any text ends locally at once (``done.audio_ms == 0``).
        """
        if self._end_sent or self._cancel_requested or self.finished:
            return
        self._end_sent = True
        if not self._text_sent:
            self.done = Done(self.context_id, 0.0, None)
            self._client._forget(self)
            self._mark_ended()
            return
        await self._client._send({"type": ClientMessage.END, "context_id": self.context_id})

    async def cancel(self) -> None:
        """Barge-in: stop generation now and drop this context's pending audio.

        Audio queued locally is discarded at once, as is any still in flight;
        iteration ends when the gateway confirms with ``cancelled``. A no-op
        on a context that already finished.
        """
        if self._cancel_requested or self.finished:
            return
        self._cancel_requested = True
        self._discard_queued_audio()
        if not self._text_sent:
            self.cancelled = True
            self._client._forget(self)
            self._mark_ended()
            return
        await self._client._send({"type": ClientMessage.CANCEL, "context_id": self.context_id})

    # -- gateway -> client ---------------------------------------------------

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[AudioChunk]:
        while True:
            if self._queue.empty():
                if self._fatal is not None:
                    raise self._fatal
                if self._ended:
                    return
            item = await self._queue.get()
            if isinstance(item, AudioChunk):
                if not self._cancel_requested:  # a put already under way when cancel() ran
                    yield item
            elif isinstance(item, GatewayError):
                raise item
            # else _WAKE: loop round and re-check the end state

    async def speak(self, text: str | Iterable[str] | AsyncIterable[str]) -> bytes:
        """Send ``text`` (a string or an (async) iterable of deltas), end, return all audio.

        Deltas are sent while audio is received, so speech starts while the
        rest of the text is still streaming in. If the context is cancelled
        meanwhile (barge-in from another task), returns the audio received so
        far. Raises :class:`GatewayError` on an error for this context, and
        whatever the delta iterable raises.
        """
        audio = bytearray()

        async def collect() -> None:
            async for chunk in self:
                audio.extend(chunk.data)

        collector = asyncio.create_task(collect())
        sender = asyncio.create_task(self._send_all_then_end(text))
        try:
            await asyncio.wait({collector, sender}, return_when=asyncio.FIRST_COMPLETED)
            if not collector.done():
                sender.result()  # the sender finished first: re-raise its failure, if any
                await collector
            collector.result()
        finally:
            # Once the audio has ended, text still being sent is moot.
            for task in (collector, sender):
                task.cancel()
            await asyncio.gather(collector, sender, return_exceptions=True)
        return bytes(audio)

    async def _send_all_then_end(self, text: str | Iterable[str] | AsyncIterable[str]) -> None:
        if isinstance(text, str):
            text = [text]
        if isinstance(text, AsyncIterable):
            async for delta in text:
                if self._cancel_requested:
                    return  # barge-in: the rest of the reply will not be spoken
                await self.send_text(delta)
        else:
            for delta in text:
                if self._cancel_requested:
                    return
                await self.send_text(delta)
        await self.end()

    # -- state changes, driven by the calls above and by the reader ----------

    def _check_open(self, action: str) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._ended and self.error is not None:
            raise self.error  # the gateway refused or dropped this context
        if self._end_sent or self._cancel_requested or self._ended:
            raise RuntimeError(f"{action}: context {self.context_id!r} was already ended or cancelled")

    def _mark_ended(self) -> None:
        self._ended = True
        self._wake()

    def _fail(self, error: GatewayError) -> None:
        """The session is gone: audio already queued is still yielded, then ``error`` is raised."""
        if self._fatal is None and not self._ended:
            self._fatal = error
            self._wake()

    def _wake(self) -> None:
        # A consumer blocked in get() means the queue is empty, so there is
        # room; when it is full, the consumer is busy and re-checks by itself.
        try:
            self._queue.put_nowait(_WAKE)
        except asyncio.QueueFull:
            pass

    def _discard_queued_audio(self) -> None:
        kept = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if not isinstance(item, AudioChunk):
                kept.append(item)
        for item in kept:
            self._queue.put_nowait(item)

    def __repr__(self) -> str:
        if self.cancelled:
            state = "cancelled"
        elif self.done is not None:
            state = "done"
        else:
            state = "finished" if self.finished else "open"
        return f"<Context {self.context_id!r} {state}>"


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
        use_header: bool = True,
        ready_timeout: float = 10.0,
        max_queued_chunks: int = 1024,
        **ws_kwargs: Any,
    ) -> _Connecting:
        """Open a session and wait for the gateway's ``ready`` frame.

        Use as ``tts = await TTSClient.connect(...)`` or
        ``async with TTSClient.connect(...) as tts: ...``.

        ``voice``, ``sample_rate`` and ``encoding`` set the session defaults
        (sent as query parameters). ``api_key`` travels in an
        ``Authorization: Bearer`` header, or in the ``api_key`` query
        parameter when ``use_header`` is False. Other keyword arguments go to
        ``websockets.asyncio.client.connect``; compression is off by default
        because PCM barely compresses and deflate only adds latency.

        Raises ``websockets.InvalidStatus`` when the handshake is refused (401:
        bad or missing key); :class:`GatewayError` when the gateway refuses the
        session (``overloaded``; or ``unknown_voice`` / ``unsupported_format``
        for bad defaults) or does not speak protocol v1; ``OSError`` or
        ``TimeoutError`` when it cannot be reached.
        """
        query = {"voice": voice, "sample_rate": sample_rate, "encoding": encoding}
        if api_key is not None and not use_header:
            query["api_key"] = api_key
        headers = dict(ws_kwargs.pop("additional_headers", None) or {})
        if api_key is not None and use_header:
            headers["Authorization"] = f"Bearer {api_key}"
        ws_kwargs.setdefault("compression", None)
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
                    ctx.alignments.extend(
                        Word(word["text"], word["start_ms"], word["end_ms"]) for word in message.get("words", ())
                    )
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
        await ctx._queue.put(chunk)  # waits while the consumer lags: see "Backpressure"

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


def write_wav(path: str, pcm_s16le: bytes, sample_rate: int) -> None:
    """Write mono 16-bit little-endian PCM (encoding ``pcm_s16le``) to a WAV file."""
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm_s16le)
