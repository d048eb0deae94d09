"""Every plain HTTP route of the gateway (aiohttp), beside the WebSocket endpoint on the one port.

``gateway/one_port.py`` hands each connection that does not ask for ``/v1/stream`` to
this app. The routes:

- ``GET /healthz``, ``/readyz``: liveness and readiness (plain text, for probes).
- ``GET /metrics``, ``/v1/stats``, ``/v1/voices``: Prometheus metrics, live statistics, voices.
- ``GET /v1/models``, ``/v1/audio/voices``: the speech models and voices, in OpenAI's list shape.
- ``POST /v1/voices`` registers a zero-shot voice from a prompt recording and its
  transcript (multipart form: ``name``, ``text``, ``audio``).
- ``POST /v1/audio/speech`` is OpenAI's speech endpoint: JSON in, 24 kHz mono audio in
  any of OpenAI's formats (gateway/codecs.py) streamed out as the engine produces it, as
  a plain body or as Server-Sent Events. Each request in flight takes one of the
  gateway's ``max_sessions`` places, as a WebSocket session does.
- ``POST /v1/tokens`` mints a short-lived browser token with an API key (gateway/tokens.py).
- Any other ``GET``: the static files of the web client and the dashboard.

The same API keys and tokens, Host and Origin rules (gateway/access.py; an allowed page
gets CORS headers), limits and metrics apply as on the WebSocket. Errors of the API
routes are JSON: ``{"error": {"code": "...", "message": "..."}}``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import mimetypes
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

import orjson
from aiohttp import web

from tts_gateway.engine.base import AudioChunk, Engine, EngineError, UtteranceOptions, drive
from tts_gateway.gateway.access import AccessPolicy
from tts_gateway.gateway.auth import Authenticator, Caller, Unauthorized
from tts_gateway.gateway.codecs import CONTENT_TYPES, SPEECH_RATE, SpeechEncoder
from tts_gateway.gateway.config import Config
from tts_gateway.gateway.key_limits import KeyLimits, Refusal
from tts_gateway.gateway.metrics import Metrics
from tts_gateway.gateway.one_port import log_request
from tts_gateway.gateway.protocol import ContextFinished, quoted
from tts_gateway.gateway.stats import parse_window
from tts_gateway.gateway.wire import SPEED_RANGE, ErrorCode, control_character_error

log = logging.getLogger("tts_gateway.http")

MAX_UPLOAD_BYTES = 16 * 1024 * 1024  # 30 s of 48 kHz stereo 16-bit fits with room

# The speech route speaks every model name with the engine; GET /v1/models lists OpenAI's.
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
STREAM_FORMATS = ("audio", "sse")  # the audio as the body, or as Server-Sent Events
UNSUPPORTED_PARAMETER = "unsupported_parameter"
OPENAI_SPEED_RANGE = (0.25, 4.0)  # accepted, then clamped to the engine's SPEED_RANGE
# OpenAI's voice names speak with the engine's default voice, so OpenAI clients work unchanged.
OPENAI_VOICES = frozenset(
    ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse")
)
# Pages served under a path of their own; any other GET path is a file under web/.
STATIC_PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
PLAIN_TEXT = "text/plain; charset=utf-8"
# Load balancers' probes: answered whatever the Host (a balancer checks a replica by its
# address) and Origin (they tell a page nothing).
PROBES = frozenset({"/healthz", "/readyz"})
# Request keys: the request's Caller once its credentials are checked; the allowed page
# origin its answer's CORS headers name.
CALLER = web.RequestKey("caller", Caller)
CORS_ORIGIN = web.RequestKey("cors_origin", str)
CORS_PREFLIGHT_HEADERS = {
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Content-Type",
    "Access-Control-Max-Age": "600",
}


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def _text(status: int, line: str) -> web.Response:
    """The probes' plain-text answers: one line."""
    return _body(status, f"{line}\n".encode(), PLAIN_TEXT)


def _body(status: int, body: bytes, content_type: str) -> web.Response:
    return web.Response(status=status, body=body, headers={"Content-Type": content_type, "Cache-Control": "no-store"})


class GatewayState(Protocol):
    """What the routes read of the gateway that serves them (gateway/server.py)."""

    ready: bool  # the engine is loaded and warm
    draining: bool  # shutting down: running work finishes, no new work is taken
    access: AccessPolicy  # which Hosts and page origins may call
    auth: Authenticator  # who calls: API keys and tokens
    key_limits: KeyLimits  # what each key may still use

    def readiness(self) -> str | None:
        """None when the gateway takes new sessions, else why not (``/readyz`` says it)."""

    @property
    def at_capacity(self) -> bool:
        """Every one of ``max_sessions`` places is taken (sessions and speech requests)."""


class HttpApi:
    def __init__(self, engine: Engine, config: Config, metrics: Metrics, gateway: GatewayState) -> None:
        self.engine = engine
        self.gateway = gateway
        self.token_ttl_s = config.auth.token_ttl_s
        self.max_token_ttl_s = config.auth.max_token_ttl_s
        self.max_text_chars = config.limits.max_text_chars
        self.request_timeout_s = config.server.request_timeout_s
        self.metrics = metrics
        self.web_root = config.server.web_path.resolve()
        # The speech requests in flight: each takes a session place; a drain waits for them.
        self.speeches: set[asyncio.BaseTransport] = set()  # their connections
        self.app = web.Application(
            client_max_size=MAX_UPLOAD_BYTES, middlewares=[self._one_request_per_connection, self._browser_rules]
        )
        self.app.on_response_prepare.append(_add_cors_headers)
        self.app.router.add_get("/healthz", self.healthz)
        self.app.router.add_get("/readyz", self.readyz)
        self.app.router.add_get("/metrics", self.prometheus)
        self.app.router.add_get("/v1/stats", self.stats)
        self.app.router.add_get("/v1/voices", self.voices)
        self.app.router.add_post("/v1/voices", self.add_voice)
        self.app.router.add_post("/v1/audio/speech", self.speech)
        self.app.router.add_post("/v1/tokens", self.mint_token)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/audio/voices", self.openai_voices)
        self.app.router.add_get("/{path:.*}", self.static)
        self._runner: web.AppRunner | None = None

    async def start(self) -> Callable[[], asyncio.Protocol]:
        """Ready the app; returns the factory of its per-connection protocol, for the one port."""
        # A client that goes away cancels its handler at once (and so its utterance). By the
        # time the runner is cleaned up the gateway has drained: what still runs is cancelled.
        # After an answer sent before its request's body was read in full, the rest of the body
        # is read and dropped for up to lingering_time, so that the client reads the answer
        # rather than a reset; a client that sends no more is closed a second later.
        self._runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5, lingering_time=1.0
        )
        await self._runner.setup()
        assert self._runner.server is not None
        return self._runner.server

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def cut_speeches(self) -> None:
        """The drain's time is up: speech requests still running end here, as when their client
        goes away (the body is cut short, the utterance cancelled)."""
        for transport in self.speeches:
            transport.abort()

    @web.middleware
    async def _one_request_per_connection(self, request: web.Request, handler) -> web.StreamResponse:
        """Each response closes its connection, so that every request on the port passes the
        front door (gateway/one_port.py); aiohttp's own errors (404, 405) become JSON ones."""
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = _error(exc.status, "not_found" if exc.status == 404 else "bad_request",
                              f"{exc.reason}: {request.method} {request.path}")
        response.force_close()
        log_request(request.method, request.path, response.status)
        return response

    @web.middleware
    async def _browser_rules(self, request: web.Request, handler) -> web.StreamResponse:
        """The Host and Origin rules (gateway/access.py); CORS preflights are answered here."""
        if request.path in PROBES:
            return await handler(request)
        origin = request.headers.get("Origin")
        if (refused := self.gateway.access.refusal(request.headers.get("Host"), origin)) is not None:
            return self._error(refused.status, refused.code, refused.message)
        if origin is not None:
            request[CORS_ORIGIN] = origin
        if request.method == "OPTIONS" and origin is not None and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers=CORS_PREFLIGHT_HEADERS)
        return await handler(request)

    def _refused(self, request: web.Request) -> web.Response | None:
        """The 401 for a request without valid credentials; else None, and its Caller is kept."""
        try:
            request[CALLER] = self.gateway.auth.caller(request.headers.get("Authorization", ""), request.query)
        except Unauthorized as exc:
            return self._error(401, "unauthorized", str(exc))
        return None

    def _body_too_slow(self) -> web.Response:
        return self._error(408, ErrorCode.BAD_MESSAGE, f"the body did not arrive within {self.request_timeout_s:g} s")

    def _limited(self, refusal: Refusal) -> web.Response:
        """A per-key limit's refusal: 429, and when to retry where that is known."""
        response = self._error(429, ErrorCode.OVERLOADED, refusal.message)
        if refusal.retry_after_s is not None:
            response.headers["Retry-After"] = str(refusal.retry_after_s)
        return response

    def _error(self, status: int, code: str, message: str) -> web.Response:
        self.metrics.error(code)
        return _error(status, code, message)

    # ------------------------------------------------------------ GET

    async def healthz(self, request: web.Request) -> web.Response:
        return _text(200, "ok")

    async def readyz(self, request: web.Request) -> web.Response:
        reason = self.gateway.readiness()
        return _text(200, "ready") if reason is None else _text(503, reason)

    async def prometheus(self, request: web.Request) -> web.Response:
        if refused := self._refused(request):
            return refused
        return _body(200, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")

    async def stats(self, request: web.Request) -> web.Response:
        if refused := self._refused(request):
            return refused
        try:
            window = parse_window(request.query.get("window"))
        except ValueError as exc:
            return _error(400, "bad_request", str(exc))
        return _body(200, orjson.dumps(self.metrics.stats(window)), "application/json")

    async def voices(self, request: web.Request) -> web.Response:
        if refused := self._refused(request):
            return refused
        listing = {"voices": [v.as_json() for v in self.engine.voices()], "default": self.engine.default_voice}
        return _body(200, orjson.dumps(listing), "application/json")

    async def models(self, request: web.Request) -> web.Response:
        if refused := self._refused(request):
            return refused
        listing = [{"id": m, "object": "model", "created": 0, "owned_by": "tts-gateway"} for m in OPENAI_MODELS]
        return _body(200, orjson.dumps({"object": "list", "data": listing}), "application/json")

    async def openai_voices(self, request: web.Request) -> web.Response:
        """The engine's voices in OpenAI's list shape; the speech route's ``voice`` takes each id."""
        if refused := self._refused(request):
            return refused
        listing = [{"object": "voice", **v.as_json()} for v in self.engine.voices()]
        return _body(200, orjson.dumps({"object": "list", "data": listing, "default": self.engine.default_voice}),
                     "application/json")

    async def static(self, request: web.Request) -> web.Response:
        relative = STATIC_PAGES.get(request.path) or request.path.lstrip("/")
        target = (self.web_root / relative).resolve()
        if not target.is_relative_to(self.web_root) or not target.is_file():
            return _error(404, "not_found", f"no route or page {request.path}")
        content_type = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        if content_type.startswith("text/") or content_type.endswith("javascript"):
            content_type += "; charset=utf-8"
        return _body(200, target.read_bytes(), content_type)

    # ------------------------------------------------------------ POST

    async def _read_body(self, read: Callable[[], Awaitable]):
        """A request body, read within the request timeout: a trickling client is refused."""
        async with asyncio.timeout(self.request_timeout_s):
            return await read()

    async def add_voice(self, request: web.Request) -> web.Response:
        if refused := self._refused(request):
            return refused
        try:
            form = await self._read_body(request.post)  # multipart/form-data or urlencoded
        except web.HTTPRequestEntityTooLarge:
            return _error(413, "too_large", f"the form holds at most {MAX_UPLOAD_BYTES // 2**20} MiB")
        except ValueError as exc:
            return _error(400, "bad_request", f"unreadable form: {exc}")
        except TimeoutError:
            return _error(408, "bad_request", f"the body did not arrive within {self.request_timeout_s:g} s")
        fields = {name: _field_bytes(form.get(name)) for name in ("name", "text", "audio")}
        missing = [name for name, value in fields.items() if not value]
        if missing:
            return _error(
                400, "bad_request",
                f"missing field(s): {', '.join(missing)}; send multipart/form-data with name, text and audio (a WAV file)",
            )
        try:
            name, text = fields["name"].decode(), fields["text"].decode()
        except UnicodeDecodeError:
            return _error(400, "bad_request", "name and text must be UTF-8")
        try:
            voice = await asyncio.to_thread(self.engine.add_voice, name, fields["audio"], text)
        except NotImplementedError as exc:
            return _error(501, "not_supported", str(exc))
        except EngineError as exc:
            log.exception("voice registration failed")
            return _error(500, "internal", str(exc))
        except ValueError as exc:  # the engine's message says what is wrong with the prompt
            return _error(400, "bad_audio", str(exc))
        return web.json_response({"voice": voice.as_json()}, status=201)

    async def speech(self, request: web.Request) -> web.StreamResponse:
        if refused := self._refused(request):
            return refused
        try:
            body = await self._read_body(request.json)
        except ValueError:
            return self._error(400, ErrorCode.BAD_MESSAGE, "the body must be JSON")
        except TimeoutError:
            return self._body_too_slow()
        try:
            speech = self._speech_request(body)
        except _BadRequest as exc:
            return self._error(400, exc.code, str(exc))
        if self.gateway.draining:
            return self._error(503, ErrorCode.OVERLOADED, "the gateway is shutting down; retry on another instance")
        if not self.gateway.ready:
            return self._error(503, "not_ready", "the engine is not ready yet")
        if self.gateway.at_capacity:
            return self._error(503, ErrorCode.OVERLOADED, "the gateway is at its session limit; retry later")
        if (failure := self.engine.failure()) is not None:
            return self._error(503, ErrorCode.ENGINE_FAILED, f"the speech engine failed: {failure}; retry on another instance")
        transport = request.transport
        if transport is None:  # the client has gone already
            return self._error(400, ErrorCode.BAD_MESSAGE, "the client closed the connection")
        caller = request[CALLER]
        key_limits = self.gateway.key_limits
        if (refusal := key_limits.open_speech(caller, len(speech.text), asyncio.get_running_loop().time())) is not None:
            return self._limited(refusal)
        self.speeches.add(transport)
        try:
            return await self._speak(request, body, speech)
        finally:
            self.speeches.discard(transport)
            key_limits.close_speech(caller)

    async def mint_token(self, request: web.Request) -> web.Response:
        """A browser token for the caller's key; the body may ask for a shorter life
        (``ttl_s``) and a limit of its own (``max_sessions``)."""
        if refused := self._refused(request):
            return refused
        caller = request[CALLER]
        if caller.token is not None:
            return self._error(403, "forbidden", "a token cannot mint tokens; use an API key")
        try:
            body = await self._read_body(request.read)
            options = orjson.loads(body) if body.strip() else {}
        except orjson.JSONDecodeError:
            return self._error(400, ErrorCode.BAD_MESSAGE, "the body must be JSON (or empty)")
        except TimeoutError:
            return self._body_too_slow()
        try:
            ttl_s, max_sessions = self._token_options(options)
        except _BadRequest as exc:
            return self._error(400, exc.code, str(exc))
        expires_at = time.time() + ttl_s
        token = self.gateway.auth.signer.mint(caller.key_id, expires_at, max_sessions)
        grant = {"token": token, "expires_at": round(expires_at), "ttl_s": ttl_s, "max_sessions": max_sessions}
        return web.json_response(grant, status=201, headers={"Cache-Control": "no-store"})

    def _token_options(self, options) -> tuple[float, int | None]:
        if not isinstance(options, dict):
            raise _BadRequest(ErrorCode.BAD_MESSAGE, "the body must be a JSON object")
        unknown = set(options) - {"ttl_s", "max_sessions"}
        if unknown:
            raise _BadRequest(ErrorCode.BAD_MESSAGE, f"unknown field(s): {', '.join(sorted(unknown))[:64]}; "
                                                     "known: ttl_s, max_sessions")
        ttl_s = options.get("ttl_s", self.token_ttl_s)
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= self.max_token_ttl_s:
            raise _BadRequest(ErrorCode.BAD_MESSAGE, f"ttl_s must be a number of seconds above 0 and at most "
                                                     f"{self.max_token_ttl_s:g}")
        max_sessions = options.get("max_sessions")
        if max_sessions is not None and (isinstance(max_sessions, bool) or not isinstance(max_sessions, int)
                                         or max_sessions < 1):
            raise _BadRequest(ErrorCode.BAD_MESSAGE, "max_sessions must be a whole number >= 1")
        return float(ttl_s), max_sessions

    async def _speak(self, request: web.Request, body: dict, speech: _Speech) -> web.StreamResponse:
        received_at = asyncio.get_running_loop().time()
        try:
            utterance = self.engine.open_utterance(UtteranceOptions(voice=speech.voice, speed=speech.speed))
        except EngineError as exc:
            return self._error(500, ErrorCode.INTERNAL, str(exc))
        self.metrics.context_started()
        encoder = SpeechEncoder(speech.format, self.engine.sample_rate)
        content_type = "text/event-stream" if speech.sse else encoder.content_type
        response = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-store"})
        if isinstance(body.get("model"), str):
            response.headers["X-Model"] = body["model"]
        download = _SpeechDownload(request, response, encoder, speech.sse, self.metrics)
        outcome = "cancelled"
        try:
            await drive(utterance, download.write, text=speech.text)
            await download.finish()
            outcome = "done"
        except EngineError as exc:
            log.warning("speech request failed: %s", exc)
            outcome = "error"
            if not response.prepared:  # nothing sent yet: an error the client can read
                return self._error(500, ErrorCode.INTERNAL, f"speech generation failed: {exc}")
            # The status line is gone. A body that ended properly would look complete, so the
            # connection is cut before the chunked body's last chunk: the client sees a failure.
            self.metrics.error(ErrorCode.INTERNAL)
            if request.transport is not None:
                request.transport.abort()
        except ConnectionError:  # the client went away between two chunks
            pass
        finally:  # also on cancellation: the client went away
            self.metrics.context_finished(ContextFinished(
                context_id="http", outcome=outcome,
                ttfa_s=None if download.first_audio_at is None else download.first_audio_at - received_at,
                audio_s=download.samples / SPEECH_RATE, compute_s=download.compute_s,
                stall_s=0.0, stalls=0,  # no playback-stall estimate for downloads
            ))
        return response

    def _speech_request(self, body) -> _Speech:
        """Validate an OpenAI speech body."""
        if not isinstance(body, dict):
            raise _BadRequest(ErrorCode.BAD_MESSAGE, "the body must be a JSON object")
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise _BadRequest(ErrorCode.BAD_MESSAGE, "input must be a non-empty string")
        if (refused := control_character_error(text)) is not None:
            raise _BadRequest(ErrorCode.BAD_MESSAGE, refused)
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or not model.isprintable()):
            # Echoed in the X-Model header, where a line break would end the header.
            raise _BadRequest(ErrorCode.BAD_MESSAGE, "model must be a string of printable characters")
        if len(text) > self.max_text_chars:
            raise _BadRequest(ErrorCode.TEXT_TOO_LONG, f"input holds at most {self.max_text_chars} characters")
        voice = body.get("voice") or "default"
        if not isinstance(voice, str):
            raise _BadRequest(ErrorCode.UNKNOWN_VOICE, "voice must be a string")
        ids = {v.id for v in self.engine.voices()}
        if voice == "default" or (voice in OPENAI_VOICES and voice not in ids):
            voice = self.engine.default_voice
        elif voice not in ids:
            raise _BadRequest(ErrorCode.UNKNOWN_VOICE, f"unknown voice {quoted(voice)}; GET /v1/voices lists them")
        fmt = body.get("response_format", "wav")
        if not isinstance(fmt, str) or fmt not in CONTENT_TYPES:
            raise _BadRequest(ErrorCode.UNSUPPORTED_FORMAT, f"response_format must be one of {sorted(CONTENT_TYPES)}")
        stream_format = body.get("stream_format", "audio")
        if not isinstance(stream_format, str) or stream_format not in STREAM_FORMATS:
            raise _BadRequest(ErrorCode.UNSUPPORTED_FORMAT, f"stream_format must be one of {list(STREAM_FORMATS)}")
        if body.get("instructions"):  # no engine of the gateway takes a speaking style from words
            raise _BadRequest(UNSUPPORTED_PARAMETER, "instructions are not supported: the voice speaks in its own style")
        speed = body.get("speed", 1.0)
        low, high = OPENAI_SPEED_RANGE
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not low <= speed <= high:
            raise _BadRequest(ErrorCode.BAD_MESSAGE, f"speed must be a number from {low} to {high}")
        speed = min(max(float(speed), SPEED_RANGE[0]), SPEED_RANGE[1])
        return _Speech(text, voice, fmt, stream_format == "sse", speed)


class _Speech(NamedTuple):
    """A valid speech request."""

    text: str
    voice: str  # an engine voice id
    format: str  # the response format (gateway/codecs.py)
    sse: bool  # the audio as Server-Sent Events rather than as the body
    speed: float  # the engine's


class _SpeechDownload:
    """One speech response: the utterance's audio in the response format, written as it
    comes (as the body, or as Server-Sent Events), and what the metrics record about it."""

    def __init__(self, request: web.Request, response: web.StreamResponse, encoder: SpeechEncoder, sse: bool,
                 metrics: Metrics) -> None:
        self._request = request
        self._response = response
        self._encoder = encoder
        self._sse = sse
        self._metrics = metrics
        self.first_audio_at: float | None = None
        self.samples = 0
        self.compute_s = 0.0

    async def _start(self) -> None:
        """The status line and headers, and what the format starts with (a WAV header): sent
        with the first audio, so that a request that fails before it still gets an error status."""
        self._response.force_close()  # one request per connection: see gateway/one_port.py
        await self._response.prepare(self._request)
        await self._write(self._encoder.header())

    async def write(self, chunk: AudioChunk) -> None:
        if not self._response.prepared:
            await self._start()
        self.compute_s += chunk.compute_s
        data, n = self._encoder.encode(chunk.samples)
        if n:
            self.first_audio_at = self.first_audio_at or asyncio.get_running_loop().time()
            await self._send(data, n)

    async def finish(self) -> None:
        """The encoder's held-back audio, then the end of the body."""
        if not self._response.prepared:
            await self._start()
        await self._send(*self._encoder.finish())
        if self._sse:
            # OpenAI's done event also reports tokens used; the gateway counts none, so it has no usage.
            await self._response.write(_event({"type": "speech.audio.done"}))
        await self._response.write_eof()

    async def _send(self, data: bytes, n: int) -> None:
        await self._write(data)
        self.samples += n
        self._metrics.audio(n / SPEECH_RATE)

    async def _write(self, data: bytes) -> None:
        if not data:
            return
        if self._sse:
            data = _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        await self._response.write(data)


async def _add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """An allowed page's request: its answer names the page, so that the browser lets it
    read the answer. Added as the headers go out, so streamed answers carry them too."""
    origin = request.get(CORS_ORIGIN)
    if origin is None:
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = "Retry-After, X-Model"
    response.headers.add("Vary", "Origin")


def _event(event: dict) -> bytes:
    """One Server-Sent Event."""
    return b"data: " + orjson.dumps(event) + b"\n\n"


class _BadRequest(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _field_bytes(value) -> bytes:
    if value is None:
        return b""
    if isinstance(value, web.FileField):
        return value.file.read()
    return value.encode() if isinstance(value, str) else bytes(value)
