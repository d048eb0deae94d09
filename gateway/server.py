"""The I/O shell: the one port, the WebSocket sessions, auth, limits, metrics, drain.

Everything the protocol decides lives in :mod:`tts_gateway.gateway.protocol`; this module only
carries its actions out: it writes frames through a bounded per-session outbox, drives
engine utterances (one pump task per context), and runs the timers. The plain HTTP
routes are :mod:`tts_gateway.gateway.http_api`'s; :mod:`tts_gateway.gateway.one_port` puts both on one socket.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
import ssl
import uuid
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import orjson
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode
from websockets.http11 import Request, Response
from websockets.server import ServerProtocol

from tts_gateway.engine.base import AudioChunk, Engine, EngineError, Utterance, UtteranceOptions, drive
from tts_gateway.gateway.access import AccessPolicy
from tts_gateway.gateway.auth import Authenticator, Caller, Unauthorized
from tts_gateway.gateway.config import Config, ConfigError, ServerSettings
from tts_gateway.gateway.http_api import HttpApi
from tts_gateway.gateway.key_limits import KeyLimits
from tts_gateway.gateway.metrics import Metrics
from tts_gateway.gateway.one_port import FrontDoor, WebSocketsLog, log_request
from tts_gateway.gateway.protocol import (
    Action,
    CancelUtterance,
    CloseSession,
    ContextFinished,
    EndInput,
    FlushInput,
    PushText,
    SendBytes,
    SendJson,
    Session,
    SessionSettings,
    StartUtterance,
)
from tts_gateway.gateway.wire import STREAM_PATH, GatewayMessage

log = logging.getLogger("tts_gateway")

# A cut-off client gets this long to take its error frame and close before the
# connection is aborted.
CUT_OFF_GRACE_S = 2.0
# How often the gateway asks its engine whether it can still serve (Engine.failure()).
ENGINE_CHECK_INTERVAL_S = 0.25


class Gateway:
    """One gateway: an engine behind a WebSocket endpoint and its HTTP routes."""

    def __init__(self, config: Config, engine: Engine, *, owns_engine: bool = True) -> None:
        """``owns_engine=False``: the engine is already started and outlives this gateway."""
        self.config = config
        self._tls = _tls_context(config.server)  # an unusable certificate stops the gateway before it starts
        self.engine = engine
        self._owns_engine = owns_engine
        self.access = AccessPolicy(config.server)
        self.auth = Authenticator(config.auth)
        self.key_limits = KeyLimits(config.limits, self.auth.key_ids)
        self.metrics = Metrics(engine.name, engine.stats)
        self.metrics.count_keys(self.key_limits)
        self.ready = False
        self.draining = False
        self.sessions: set[SessionRunner] = set()
        self.port = config.server.port
        self.http = HttpApi(engine, config, self.metrics, self)
        self._server: Server | None = None
        self._loop_lag: asyncio.Task | None = None
        self._engine_watch: asyncio.Task | None = None
        # Why the engine can serve no more (then the gateway ends its sessions and exits), or None.
        self.engine_failure: str | None = None
        self._engine_failed = asyncio.Event()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Listen first (so /healthz and /readyz answer), then load and warm the engine."""
        limits = self.config.limits
        http = await self.http.start()
        request_timeout = self.config.server.request_timeout_s

        def front_door(protocol: ServerProtocol, server: Server, **options: Any) -> FrontDoor:
            return FrontDoor(SessionConnection(protocol, server, **options), http, request_timeout)

        self._server = await serve(
            self._handle_connection,
            self.config.server.host,
            self.config.server.port,
            process_request=self._process_request,
            process_response=self._log_handshake,
            logger=WebSocketsLog(logging.getLogger("websockets.server")),
            max_size=limits.max_message_bytes,
            # Client messages are consumed at once; a short queue bounds memory.
            max_queue=16,
            compression=None,  # audio does not compress; deflate would cost CPU per frame
            open_timeout=request_timeout,
            create_connection=front_door,  # the one port: see gateway/one_port.py
            ssl=self._tls,
        )
        self.port = self._server.sockets[0].getsockname()[1]  # the real one when config says 0
        await self.metrics.gpu.start()
        self._loop_lag = asyncio.create_task(self.metrics.watch_loop_lag())
        log.info("listening on %s:%d (WebSocket %s and the HTTP routes, %s)", self.config.server.host, self.port,
                 STREAM_PATH, "TLS" if self.config.server.tls else "plain")
        if self._owns_engine:
            await self.engine.start()
        self.ready = True
        self.metrics.ready.set(1)
        self._engine_watch = asyncio.create_task(self._watch_engine())
        log.info("engine %s ready (native %d Hz)", self.engine.name, self.engine.sample_rate)

    async def drain(self, timeout: float | None = None) -> None:
        """Refuse new sessions and speech requests; let running contexts and speech requests
        finish up to ``timeout``; then close all.

        The socket stays open until :meth:`stop`, so that a load balancer's health check reads
        503 on ``/readyz`` (and a new handshake gets 503, which it retries elsewhere) rather
        than a refused connection, which it cannot tell from a crash."""
        timeout = self.config.server.drain_timeout_s if timeout is None else timeout
        self.draining = True
        self.ready = False
        self.metrics.ready.set(0)
        for runner in list(self.sessions):
            runner.apply(runner.session.start_drain())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._busy and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.http.cut_speeches()
        for runner in list(self.sessions):
            runner.apply(runner.session.shutdown())
        await asyncio.gather(*(r.closed.wait() for r in list(self.sessions)))

    @property
    def _busy(self) -> bool:
        return bool(self.http.speeches) or any(not r.session.idle for r in self.sessions)

    async def stop(self) -> None:
        await self.drain(timeout=0)
        await self.http.stop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self.metrics.gpu.stop()
        for task in (self._loop_lag, self._engine_watch):
            if task is not None:
                task.cancel()
        if self._owns_engine:
            await self.engine.close()

    async def serve_forever(self) -> None:
        """Run until SIGTERM/SIGINT, then drain and stop; or until the engine fails, then drain,
        stop and raise :class:`EngineError`, so that the process exits non-zero and its
        supervisor restarts it."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self._engine_failed.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
        log.info("draining (up to %.1f s)", self.config.server.drain_timeout_s)
        await self.drain()
        await self.stop()
        if self.engine_failure is not None:
            raise EngineError(f"the speech engine failed ({self.engine_failure}); exiting for a restart")

    async def _watch_engine(self) -> None:
        """An engine that can serve no more (a dead backend, a stage that stopped making
        progress) ends every open context and session at once, turns /readyz to 503 and
        stops the gateway (serve_forever exits non-zero)."""
        while (failure := self.engine.failure()) is None:
            await asyncio.sleep(ENGINE_CHECK_INTERVAL_S)
        log.error("engine %s failed: %s; ending every session", self.engine.name, failure)
        self.engine_failure = failure
        self.metrics.ready.set(0)  # /readyz reads engine.failure(); a new session is refused (1011)
        for runner in list(self.sessions):
            runner.apply(runner.session.engine_failed(failure))
        self._engine_failed.set()

    # ------------------------------------------------------------ admission

    def readiness(self) -> str | None:
        """None when new sessions are welcome, else why not: ``/readyz`` answers 503 with it."""
        if self.draining:
            return "draining"
        if not self.ready:
            return "not ready"
        if self.at_capacity:
            return "at capacity"
        failure = self.engine.failure()
        return None if failure is None else f"engine failed: {failure}"

    @property
    def places_taken(self) -> int:
        """Sessions and speech requests open: each takes one of ``max_sessions``."""
        return len(self.sessions) + len(self.http.speeches)

    @property
    def at_capacity(self) -> bool:
        """No room for another session or speech request: ``/readyz`` says so, so that a
        balancer sends new work elsewhere (a session that slips through is still refused with
        ``overloaded``)."""
        return self.places_taken >= self.config.limits.max_sessions

    def _process_request(self, connection: SessionConnection, request: Request) -> Response | None:
        """The WebSocket handshake's checks: the Host, the page's Origin, the API key or token,
        then whether sessions are taken now."""
        if (refused := self.access.refusal(request.headers.get("Host"), request.headers.get("Origin"))) is not None:
            self.metrics.error(refused.code)
            return _response(connection, refused.status, f"{refused.message}\n".encode())
        query = dict(parse_qsl(urlsplit(request.path).query))
        try:
            connection.caller = self.auth.caller(request.headers.get("Authorization", ""), query)
        except Unauthorized as exc:
            self.metrics.error("unauthorized")
            return _response(connection, 401, f"{exc}\n".encode())
        if self.draining:
            return _response(connection, 503, b"shutting down\n")
        if not self.ready:
            return _response(connection, 503, b"engine not ready\n")
        return None  # go on with the WebSocket handshake

    def _log_handshake(self, connection: ServerConnection, request: Request, response: Response) -> None:
        log_request("GET", urlsplit(request.path).path, response.status_code)

    # ------------------------------------------------------------ WebSocket

    async def _handle_connection(self, connection: ServerConnection) -> None:
        runner = SessionRunner(self, connection)
        self.sessions.add(runner)
        try:
            await runner.run()
        finally:
            self.sessions.discard(runner)

    def session_settings(self) -> SessionSettings:
        return SessionSettings(
            voices=tuple(v.as_json() for v in self.engine.voices()),
            default_voice=self.engine.default_voice,
            native_rate=self.engine.sample_rate,
            default_sample_rate=self.config.audio.default_sample_rate,
            default_encoding=self.config.audio.default_encoding,
            max_contexts=self.config.limits.max_contexts_per_session,
            max_text_chars=self.config.limits.max_text_chars,
            idle_timeout_s=self.config.limits.idle_timeout_s,
            max_inactivity_timeout_s=self.config.limits.max_inactivity_timeout_s,
        )


class SessionConnection(ServerConnection):
    """A WebSocket connection that tells its session when the client pings: a ping keeps a
    quiet session open, as any message does. (Pongs answer the gateway's own pings, which
    websockets sends to find dead connections; they say nothing of the client's wishes.)"""

    on_ping: Callable[[], None] | None = None
    caller: Caller | None = None  # who opened it: set by the handshake's checks

    def process_event(self, event: Any) -> None:
        if isinstance(event, Frame) and event.opcode is Opcode.PING and self.on_ping is not None:
            self.on_ping()
        super().process_event(event)


class Outbox:
    """A session's bounded send queue, drained by one writer task.

    Frames leave in the order they were queued, so an audio header and its binary
    frame stay adjacent. ``limit`` bounds the bytes waiting for a slow client.
    """

    def __init__(self, connection: ServerConnection, limit: int) -> None:
        self._connection = connection
        self._limit = limit
        self._items: collections.deque[tuple[bytes, bool] | tuple[int, str]] = collections.deque()
        self.queued_bytes = 0
        self._wakeup = asyncio.Event()

    def has_room(self, nbytes: int) -> bool:
        return self.queued_bytes + nbytes <= self._limit

    def put(self, data: bytes, text: bool) -> None:
        self._items.append((data, text))
        self.queued_bytes += len(data)
        self._wakeup.set()

    def put_close(self, code: int, reason: str) -> None:
        self._items.append((code, reason))
        self._wakeup.set()

    def clear(self) -> None:
        self._items.clear()
        self.queued_bytes = 0

    async def run(self) -> None:
        while True:
            while not self._items:
                self._wakeup.clear()
                await self._wakeup.wait()
            first, second = self._items.popleft()
            if isinstance(first, int):
                await self._connection.close(first, second)
                return
            self.queued_bytes -= len(first)
            await self._connection.send(first, text=second)


class SessionRunner:
    """Carries out one session's protocol actions on its connection."""

    def __init__(self, gateway: Gateway, connection: SessionConnection) -> None:
        self.gateway = gateway
        self.connection = connection
        assert connection.caller is not None, "the handshake's checks name the caller"
        self.caller = connection.caller
        self.session = Session(
            uuid.uuid4().hex, gateway.session_settings(), allowance=gateway.key_limits.accounts[self.caller.key_id]
        )
        self.outbox = Outbox(connection, gateway.config.limits.send_buffer_bytes)
        self.closed = asyncio.Event()
        self._utterances: dict[int, Utterance] = {}
        self._pumps: dict[int, asyncio.Task] = {}
        self._cut_off = False
        self._loop = asyncio.get_running_loop()
        connection.on_ping = lambda: self.session.heard(self._loop.time())

    async def run(self) -> None:
        gateway = self.gateway
        writer = asyncio.create_task(self._write())
        watchdog: asyncio.Task | None = None
        try:
            if gateway.engine_failure is not None:
                self.apply(self.session.refuse_engine_failed(gateway.engine_failure))
            # The place this session took counts: more than the limit means one too many.
            elif gateway.places_taken > gateway.config.limits.max_sessions or gateway.draining:
                self.apply(self.session.refuse_overloaded())
            elif (refused := gateway.key_limits.open_session(self.caller)) is not None:
                self.apply(self.session.refuse_overloaded(refused.message))
            else:
                gateway.metrics.sessions.inc()
                gateway.metrics.sessions_active.inc()
                query = dict(parse_qsl(urlsplit(self.connection.request.path).query))
                self.apply(self.session.open(query, self._loop.time()))
                watchdog = asyncio.create_task(self._watch_idle())
                try:
                    async for message in self.connection:
                        self.apply(self.session.receive_message(message, self._loop.time()))
                finally:
                    gateway.metrics.sessions_active.dec()
                    gateway.key_limits.close_session(self.caller)
            await self.connection.wait_closed()
        except ConnectionClosed:
            pass
        finally:
            self.apply(self.session.connection_lost())
            for task in (writer, watchdog, *self._pumps.values()):
                if task is not None:
                    task.cancel()
            self.closed.set()

    async def _write(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self.outbox.run()

    async def _watch_idle(self) -> None:
        """Wake at the session's idle deadline; it moves on while the client is active."""
        while not self.session.closed:
            await asyncio.sleep(max(self.session.idle_deadline - self._loop.time(), 0.0))
            self.apply(self.session.check_idle(self._loop.time()))

    # ------------------------------------------------------------ actions

    def apply(self, actions: Iterable[Action]) -> None:
        for action in actions:
            match action:
                case SendJson(frame):
                    self._send_json(frame)
                case SendBytes(data):
                    if not self._cut_off:
                        self.outbox.put(data, text=False)
                case StartUtterance(key, voice, speed):
                    self._start_utterance(key, voice, speed)
                # An utterance that failed to open has none: its context has already ended.
                case PushText(key, text):
                    if (utterance := self._utterances.get(key)) is not None:
                        utterance.push_text(text)
                case FlushInput(key):
                    if (utterance := self._utterances.get(key)) is not None:
                        utterance.flush()
                case EndInput(key):
                    if (utterance := self._utterances.get(key)) is not None:
                        utterance.end_input()
                case CancelUtterance(key):
                    self._stop_utterance(key)
                case ContextFinished():
                    self.gateway.metrics.context_finished(action)
                case CloseSession(code, reason):
                    self.outbox.put_close(code, reason)

    def _send_json(self, frame: dict) -> None:
        if self._cut_off:
            return
        data = orjson.dumps(frame)
        kind = frame["type"]
        # Every frame counts against the send buffer, not audio only: a client that sends
        # bad messages and reads none of the errors is as stuck as one that reads no audio.
        # An audio header reserves room for its binary frame too: a pair is never split.
        # An empty outbox always takes a frame (or pair), however large.
        needed = len(data) + (frame["bytes"] if kind == GatewayMessage.AUDIO else 0)
        if self.outbox.queued_bytes and not self.outbox.has_room(needed):
            self._cut_off_slow_reader()
            return
        if kind == GatewayMessage.AUDIO:
            self.gateway.metrics.audio(frame["duration_ms"] / 1000.0)
        elif kind == GatewayMessage.ERROR:
            self.gateway.metrics.error(frame["code"])
        self.outbox.put(data, text=True)

    def _cut_off_slow_reader(self) -> None:
        log.warning("session %s: client not reading, cutting it off", self.session.session_id)
        # The rest of this batch still runs (it may finish a context: its metrics must see
        # that); its frames are dropped, since nothing is sent once the client is cut off.
        self.outbox.clear()
        # Cancels every context, queues the error frame (the outbox is empty: it fits)
        # and the close; nothing is sent after that.
        self.apply(self.session.client_not_reading())
        self._cut_off = True
        self._loop.call_later(CUT_OFF_GRACE_S, self._abort)

    def _abort(self) -> None:
        if not self.closed.is_set():
            self.connection.transport.abort()

    def _start_utterance(self, key: int, voice: str, speed: float) -> None:
        # Counted first: the context finishes (and is counted out) whether or not it opens.
        self.gateway.metrics.context_started()
        try:
            options = UtteranceOptions(voice=voice, speed=speed, word_timings=self.session.word_timings)
            utterance = self.gateway.engine.open_utterance(options)
        except EngineError as exc:
            log.warning("session %s: engine refused an utterance: %s", self.session.session_id, exc)
            self._utterance_failed(key, str(exc))
            return
        except Exception:
            log.exception("session %s: unexpected failure opening an utterance", self.session.session_id)
            self._utterance_failed(key, "unexpected engine failure")
            return
        self._utterances[key] = utterance
        self._pumps[key] = asyncio.create_task(self._pump(key, utterance))

    def _utterance_failed(self, key: int, message: str) -> None:
        """One reply failed. If the engine as a whole can serve no more (its backend died: every
        open stream fails at once, before the engine watcher's next look), the session ends
        with ``engine_failed`` as the watcher would end it, not with one reply's ``internal``."""
        failure = self.gateway.engine.failure()
        if failure is not None:
            self.apply(self.session.engine_failed(failure))
        else:
            self.apply(self.session.utterance_failed(key, message))

    def _stop_utterance(self, key: int) -> None:
        utterance = self._utterances.pop(key, None)
        if utterance is not None:
            utterance.cancel()
        task = self._pumps.pop(key, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _pump(self, key: int, utterance: Utterance) -> None:
        """Move one utterance's audio into the session as it is produced (its text comes in
        through PushText/EndInput meanwhile)."""

        async def deliver(chunk: AudioChunk) -> None:
            self.apply(self.session.audio_ready(key, chunk.samples, chunk.words, chunk.compute_s, self._loop.time()))

        try:
            await drive(utterance, deliver)
            self.apply(self.session.utterance_finished(key, self._loop.time()))
        except EngineError as exc:
            log.warning("session %s: engine failed: %s", self.session.session_id, exc)
            self._utterance_failed(key, str(exc))
        except Exception:
            log.exception("session %s: unexpected engine failure", self.session.session_id)
            self._utterance_failed(key, "unexpected engine failure")
        finally:
            self._utterances.pop(key, None)
            self._pumps.pop(key, None)


def _tls_context(settings: ServerSettings) -> ssl.SSLContext | None:
    """With ``tls_cert`` and ``tls_key``, the one port serves https and wss."""
    if not settings.tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(settings.tls_cert, settings.tls_key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"[server] tls_cert {settings.tls_cert!r} and tls_key {settings.tls_key!r}: "
                          f"not a certificate and its private key in PEM ({exc})") from None
    return context


def _response(connection: ServerConnection, status: int, body: bytes) -> Response:
    """A refused handshake's plain-text answer."""
    response = connection.respond(status, "")
    headers = Headers(response.headers)
    del headers["Content-Type"]
    del headers["Content-Length"]
    headers["Content-Type"] = "text/plain; charset=utf-8"
    headers["Content-Length"] = str(len(body))
    headers["Cache-Control"] = "no-store"
    return Response(response.status_code, response.reason_phrase, headers, body)
