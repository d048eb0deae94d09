"""HTTP routes that need a request body, on their own port (aiohttp, same event loop).

websockets' HTTP handling serves the GET routes beside ``/v1/stream``, but it reads no
request body, so these go here:

- ``POST /v1/voices`` registers a zero-shot voice from a prompt recording and its
  transcript (multipart form: ``name``, ``text``, ``audio``).
- ``POST /v1/audio/speech`` is OpenAI's speech endpoint: JSON in, 24 kHz 16-bit mono
  audio (``wav`` or ``pcm``) streamed out as the engine produces it.

The same API keys, limits and metrics apply. Listening on a second port keeps each server on a well-kept
library's ordinary path instead of splicing two HTTP stacks on one socket.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable

from aiohttp import web

from engine.base import AudioChunk, Engine, EngineError, UtteranceOptions, drive
from gateway.audio import StreamEncoder
from gateway.auth import authorized
from gateway.config import Config
from gateway.metrics import Metrics
from gateway.protocol import ContextFinished
from gateway.wire import SPEED_RANGE, ErrorCode

log = logging.getLogger("tts_gateway.http")

MAX_UPLOAD_BYTES = 16 * 1024 * 1024  # 30 s of 48 kHz stereo 16-bit fits with room

# OpenAI's speech output: 24 kHz 16-bit mono little-endian.
SPEECH_RATE = 24000
SPEECH_FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm"}
OPENAI_SPEED_RANGE = (0.25, 4.0)  # accepted, then clamped to the engine's SPEED_RANGE
# OpenAI's voice names speak with the engine's default voice, so OpenAI clients work unchanged.
OPENAI_VOICES = frozenset(
    ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse")
)


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


class HttpApi:
    def __init__(self, engine: Engine, config: Config, metrics: Metrics, ready: Callable[[], bool]) -> None:
        self.engine = engine
        self.ready = ready
        self.api_keys = config.auth.api_keys
        self.max_text_chars = config.limits.max_text_chars
        self.metrics = metrics
        self.app = web.Application(client_max_size=MAX_UPLOAD_BYTES)
        self.app.router.add_post("/v1/voices", self.add_voice)
        self.app.router.add_post("/v1/audio/speech", self.speech)
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        # A client that goes away cancels its handler at once (and so its utterance).
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the real port when 0 was asked

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _refused(self, request: web.Request) -> web.Response | None:
        if authorized(self.api_keys, request.headers.get("Authorization", ""), request.query.get("api_key")):
            return None
        return self._error(401, "unauthorized", "missing or invalid API key")

    def _error(self, status: int, code: str, message: str) -> web.Response:
        self.metrics.error(code)
        return _error(status, code, message)

    async def add_voice(self, request: web.Request) -> web.Response:
        if refused := self._refused(request):
            return refused
        try:
            form = await request.post()  # multipart/form-data or urlencoded
        except ValueError as exc:
            return _error(400, "bad_request", f"unreadable form: {exc}")
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
            body = await request.json()
        except ValueError:
            return self._error(400, ErrorCode.BAD_MESSAGE, "the body must be JSON")
        try:
            text, voice, fmt, speed = self._speech_request(body)
        except _BadRequest as exc:
            return self._error(400, exc.code, str(exc))
        if not self.ready():
            return self._error(503, "not_ready", "the engine is not ready yet")
        received_at = asyncio.get_running_loop().time()
        try:
            utterance = self.engine.open_utterance(UtteranceOptions(voice=voice, speed=speed))
        except EngineError as exc:
            return self._error(500, ErrorCode.INTERNAL, str(exc))
        self.metrics.context_started()
        response = web.StreamResponse(headers={"Content-Type": SPEECH_FORMATS[fmt], "Cache-Control": "no-store"})
        if isinstance(body.get("model"), str):
            response.headers["X-Model"] = body["model"]
        encoder = StreamEncoder(self.engine.sample_rate, SPEECH_RATE, "pcm_s16le")
        download = _SpeechDownload(request, response, fmt, encoder, self.metrics)
        outcome = "cancelled"
        try:
            await drive(utterance, download.write, text=text, start=download.start)
            await download.finish()
            outcome = "done"
        except EngineError as exc:  # the status line is gone: the client sees a cut-short body
            log.warning("speech request failed: %s", exc)
            self.metrics.error(ErrorCode.INTERNAL)
            outcome = "error"
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

    def _speech_request(self, body) -> tuple[str, str, str, float]:
        """Validate an OpenAI speech body: (text, engine voice id, format, engine speed)."""
        if not isinstance(body, dict):
            raise _BadRequest(ErrorCode.BAD_MESSAGE, "the body must be a JSON object")
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise _BadRequest(ErrorCode.BAD_MESSAGE, "input must be a non-empty string")
        if len(text) > self.max_text_chars:
            raise _BadRequest(ErrorCode.TEXT_TOO_LONG, f"input holds at most {self.max_text_chars} characters")
        voice = body.get("voice") or "default"
        if not isinstance(voice, str):
            raise _BadRequest(ErrorCode.UNKNOWN_VOICE, "voice must be a string")
        ids = {v.id for v in self.engine.voices()}
        if voice == "default" or (voice in OPENAI_VOICES and voice not in ids):
            voice = self.engine.default_voice
        elif voice not in ids:
            raise _BadRequest(ErrorCode.UNKNOWN_VOICE, f"unknown voice {voice!r}; GET /v1/voices lists them")
        fmt = body.get("response_format", "wav")
        if fmt not in SPEECH_FORMATS:
            raise _BadRequest(ErrorCode.UNSUPPORTED_FORMAT, f"response_format must be one of {sorted(SPEECH_FORMATS)}")
        speed = body.get("speed", 1.0)
        low, high = OPENAI_SPEED_RANGE
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not low <= speed <= high:
            raise _BadRequest(ErrorCode.BAD_MESSAGE, f"speed must be a number from {low} to {high}")
        return text, voice, fmt, min(max(float(speed), SPEED_RANGE[0]), SPEED_RANGE[1])


class _SpeechDownload:
    """One speech response: the utterance's audio as 24 kHz 16-bit PCM, written as it comes,
    and what the metrics record about it."""

    def __init__(self, request: web.Request, response: web.StreamResponse, fmt: str, encoder: StreamEncoder,
                 metrics: Metrics) -> None:
        self._request = request
        self._response = response
        self._fmt = fmt
        self._encoder = encoder
        self._metrics = metrics
        self.first_audio_at: float | None = None
        self.samples = 0
        self.compute_s = 0.0

    async def start(self) -> None:
        """The status line and headers, and a WAV header whose sizes say "unknown"."""
        await self._response.prepare(self._request)
        if self._fmt == "wav":
            await self._response.write(streaming_wav_header(SPEECH_RATE))

    async def write(self, chunk: AudioChunk) -> None:
        self.compute_s += chunk.compute_s
        data, n = self._encoder.encode(chunk.samples)
        if n:
            self.first_audio_at = self.first_audio_at or asyncio.get_running_loop().time()
            await self._send(data, n)

    async def finish(self) -> None:
        """The resampler's look-ahead, then the end of the body."""
        await self._send(*self._encoder.finish())
        await self._response.write_eof()

    async def _send(self, data: bytes, n: int) -> None:
        await self._response.write(data)
        self.samples += n
        self._metrics.audio(n / SPEECH_RATE)


class _BadRequest(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def streaming_wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say "unknown" (0xFFFFFFFF), for a stream."""
    unknown = 0xFFFFFFFF
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", unknown, b"WAVE", b"fmt ", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16, b"data", unknown,
    )


def _field_bytes(value) -> bytes:
    if value is None:
        return b""
    if isinstance(value, web.FileField):
        return value.file.read()
    return value.encode() if isinstance(value, str) else bytes(value)
