"""The session protocol as a sans-I/O state machine.

A :class:`Session` is one WebSocket connection. It takes *events* (a message from the
client, audio from the engine, a timer) and returns *actions* (frames to send, engine
work to start or stop, a close). It never touches a socket, a task or an engine, so
every rule of the protocol is testable with plain function calls; the server in
``gateway/server.py`` is the thin I/O shell that carries the actions out.

Each context inside a session moves through explicit states::

    STREAMING --end--> ENDING --engine finished--> (done, removed)
        |                 |
        +--cancel---------+--> (cancelled, removed)
        +--engine failed--+--> (error internal, removed)
        +--engine can serve no more--> (error engine_failed, removed; the session closes)

A removed context's id may be reused for a new context. Engine events carry the
context's ``key`` (unique per session), so late audio from a cancelled utterance can
never leak into a new context that reuses its id.

Times are plain floats from the caller's monotonic clock (``now``), in seconds.

A session is active while its client sends anything (a message, a ``keepalive``, a
WebSocket ping: :meth:`Session.heard`) or audio goes out to it. After its inactivity
timeout without either, :meth:`Session.check_idle` closes it. The timeout is the
gateway's default unless the client chose its own, within the gateway's bound, in the
``inactivity_timeout`` query parameter.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import orjson

from tts_gateway.gateway.audio import StreamEncoder
from tts_gateway.gateway.wire import (
    CLIENT_FIELDS,
    CONTEXT_OPTIONS,
    CONTEXT_SURVIVING_CODES,
    DEFAULT_CONTEXT,
    ENCODINGS,
    MAX_CONTEXT_ID_CHARS,
    PROTOCOL_VERSION,
    SAMPLE_RATES,
    SESSION_ENDING_CODES,
    SESSION_QUERY_PARAMETERS,
    SPEED_RANGE,
    ClientMessage,
    CloseCode,
    ErrorCode,
    GatewayMessage,
    control_character_error,
)

# Values a client sent are quoted in error messages up to this many characters: an error
# frame must never be an echo that makes a client's garbage cost the gateway memory twice.
MAX_QUOTED_CHARS = 64


# ---------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class SendJson:
    frame: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SendBytes:
    data: bytes


@dataclass(frozen=True, slots=True)
class StartUtterance:
    key: int
    voice: str
    speed: float


@dataclass(frozen=True, slots=True)
class PushText:
    key: int
    text: str


@dataclass(frozen=True, slots=True)
class FlushInput:
    key: int


@dataclass(frozen=True, slots=True)
class EndInput:
    key: int


@dataclass(frozen=True, slots=True)
class CancelUtterance:
    key: int


@dataclass(frozen=True, slots=True)
class CloseSession:
    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class ContextFinished:
    """A context left the session; what the metrics record about it."""

    context_id: str
    outcome: str  # "done" | "cancelled" | "error"
    ttfa_s: float | None
    audio_s: float
    compute_s: float
    stall_s: float
    stalls: int


Action = (
    SendJson | SendBytes | StartUtterance | PushText | FlushInput | EndInput
    | CancelUtterance | CloseSession | ContextFinished
)


class TimedWord(Protocol):
    """Duck type of an engine's word timing: seconds from the start of its chunk."""

    text: str
    start_s: float
    end_s: float


class Refused(Protocol):
    message: str  # why, for the client


class Allowance(Protocol):
    """What the key behind a session may still use: contexts open at once and characters to
    speak, counted over all of the key's sessions (the server's per-key limits, supplied as
    this interface so that the core stays free of them). A refusal becomes ``overloaded``."""

    def open_context(self, chars: int, now: float) -> Refused | None:
        """Take a context place and its first ``chars`` characters of text (both or neither),
        or say why not."""

    def close_context(self) -> None:
        """Give a context place back."""

    def spend_chars(self, chars: int, now: float) -> Refused | None:
        """Take ``chars`` characters of text from the key's budget, or say why not."""


class _Unlimited:
    """No per-key limits."""

    def open_context(self, chars: int, now: float) -> None:
        return None

    def close_context(self) -> None:
        pass

    def spend_chars(self, chars: int, now: float) -> None:
        return None


UNLIMITED: Allowance = _Unlimited()


class ProtocolError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ---------------------------------------------------------------- state


class ContextState(enum.Enum):
    STREAMING = "streaming"  # accepting text
    ENDING = "ending"  # input ended; the engine speaks the rest


@dataclass(eq=False)
class Context:
    key: int
    context_id: str
    voice: str
    sample_rate: int
    encoding: str
    speed: float
    encoder: StreamEncoder
    state: ContextState = ContextState.STREAMING
    text_chars: int = 0
    seq: int = 0
    samples_sent: int = 0  # at the context's output rate
    compute_s: float = 0.0
    first_text_at: float | None = None
    first_audio_at: float | None = None
    # Playback-stall estimate: the client starts playing on the first chunk and
    # pauses whenever the next chunk has not arrived by the time it is needed.
    stall_s: float = 0.0
    stalls: int = 0

    @property
    def audio_s(self) -> float:
        return self.samples_sent / self.sample_rate

    @property
    def ttfa_s(self) -> float | None:
        if self.first_audio_at is None or self.first_text_at is None:
            return None
        return self.first_audio_at - self.first_text_at


@dataclass(frozen=True)
class SessionSettings:
    voices: tuple[dict[str, Any], ...]  # as listed to clients; each has an "id"
    default_voice: str
    native_rate: int  # the engine's sample rate
    default_sample_rate: int = 24000
    default_encoding: str = "pcm_s16le"
    max_contexts: int = 8
    max_text_chars: int = 20_000
    idle_timeout_s: float = 60.0  # a session's inactivity timeout unless it chooses one
    max_inactivity_timeout_s: float = 180.0  # the longest a client may choose


@dataclass
class Session:
    session_id: str
    settings: SessionSettings
    voice: str = ""
    sample_rate: int = 0
    encoding: str = ""
    inactivity_timeout_s: float = 0.0
    word_timings: bool = True  # alignment frames wanted (the word_timings query parameter)
    last_active_at: float = 0.0
    draining: bool = False
    closed: bool = False
    # The per-key limits of the key behind this session, shared with its other sessions.
    allowance: Allowance = UNLIMITED
    contexts: dict[str, Context] = field(default_factory=dict)
    _by_key: dict[int, Context] = field(default_factory=dict)
    _next_key: int = 0

    def __post_init__(self) -> None:
        self._voice_ids = frozenset(v["id"] for v in self.settings.voices)
        self.voice = self.voice or self.settings.default_voice
        self.sample_rate = self.sample_rate or self.settings.default_sample_rate
        self.encoding = self.encoding or self.settings.default_encoding
        self.inactivity_timeout_s = self.inactivity_timeout_s or self.settings.idle_timeout_s

    # ------------------------------------------------------------ connection

    def open(self, query: dict[str, str], now: float) -> list[Action]:
        """The connection is up. ``query`` holds the URL's session defaults."""
        self.last_active_at = now
        try:
            unknown = set(query) - SESSION_QUERY_PARAMETERS
            if unknown:
                raise ProtocolError(
                    ErrorCode.BAD_MESSAGE, f"unknown query parameter(s): {quoted(', '.join(sorted(unknown)))}"
                )
            if "voice" in query:
                self.voice = self._check_voice(query["voice"])
            if "sample_rate" in query:
                self.sample_rate = self._check_rate(_parse_int(query["sample_rate"]))
            if "encoding" in query:
                self.encoding = self._check_encoding(query["encoding"])
            if "inactivity_timeout" in query:
                self.inactivity_timeout_s = self._check_inactivity_timeout(query["inactivity_timeout"])
            if "word_timings" in query:
                self.word_timings = self._check_word_timings(query["word_timings"])
        except ProtocolError as exc:
            return self._refuse(exc.code, exc.message, CloseCode.POLICY, exc.message)
        return [
            SendJson(
                {
                    "type": GatewayMessage.READY,
                    "protocol": PROTOCOL_VERSION,
                    "session_id": self.session_id,
                    "voice": self.voice,
                    "sample_rate": self.sample_rate,
                    "encoding": self.encoding,
                    "voices": list(self.settings.voices),
                }
            )
        ]

    def refuse_overloaded(self, message: str = "the gateway is at its session limit; retry later") -> list[Action]:
        """The gateway (or the key behind the session) is at its session cap: say so, and
        close with 1013."""
        return self._refuse(ErrorCode.OVERLOADED, message, CloseCode.TRY_AGAIN_LATER, "overloaded")

    def heard(self, now: float) -> None:
        """The client sent something: a message, or a WebSocket ping."""
        self.last_active_at = now

    @property
    def idle_deadline(self) -> float:
        """When the session times out if nothing happens before."""
        return self.last_active_at + self.inactivity_timeout_s

    def check_idle(self, now: float) -> list[Action]:
        """Close the session once its inactivity timeout has passed."""
        if self.closed or now < self.idle_deadline:
            return []
        return self._session_error(
            ErrorCode.IDLE_TIMEOUT,
            f"nothing from the client and no audio for {self.inactivity_timeout_s:g} s; send `keepalive` "
            "messages or WebSocket pings to keep a quiet session open",
            "idle timeout",
        )

    def client_not_reading(self) -> list[Action]:
        """The client fell behind by more than its send buffer: cut it off."""
        return self._session_error(
            ErrorCode.OVERLOADED, "client is not reading its audio; send buffer full", "client not reading"
        )

    def refuse_engine_failed(self, reason: str) -> list[Action]:
        """The engine can serve no more: refuse the session (1011) instead of ``ready``."""
        return self._refuse(
            ErrorCode.ENGINE_FAILED, f"the speech engine failed: {reason}", CloseCode.INTERNAL_ERROR, "engine failed"
        )

    def engine_failed(self, reason: str) -> list[Action]:
        """The engine can serve no more: every open context ends with ``engine_failed``, then the
        session does (1011), so that its client reconnects (to another gateway, or to this one
        once its supervisor has restarted it)."""
        if self.closed:
            return []
        message = f"the speech engine failed: {reason}"
        actions: list[Action] = []
        for context in list(self.contexts.values()):
            actions += self._context_error(context.context_id, ErrorCode.ENGINE_FAILED, message)
        return actions + self._session_error(ErrorCode.ENGINE_FAILED, message, "engine failed")

    def start_drain(self) -> list[Action]:
        """Shutdown begins: running contexts may finish, new ones are refused, and the session
        closes (1001) as soon as it has none, so that its client reconnects to another gateway
        between replies rather than being refused its next one."""
        self.draining = True
        return self._close_if_drained()

    def _close_if_drained(self) -> list[Action]:
        if self.draining and self.idle and not self.closed:
            return self._close(CloseCode.GOING_AWAY, "server shutting down")
        return []

    def shutdown(self) -> list[Action]:
        """The drain deadline passed: stop what still runs and close."""
        return [*self._cancel_all(), *self._close(CloseCode.GOING_AWAY, "server shutting down")]

    def connection_lost(self) -> list[Action]:
        self.closed = True
        return self._cancel_all()

    @property
    def idle(self) -> bool:
        return not self.contexts

    # ------------------------------------------------------------ client messages

    def receive_message(self, data: str | bytes, now: float) -> list[Action]:
        if self.closed:
            return []
        self.heard(now)
        try:
            if isinstance(data, bytes):
                raise ProtocolError(ErrorCode.BAD_MESSAGE, "binary frames are not accepted; send JSON text")
            try:
                message = orjson.loads(data)
            except orjson.JSONDecodeError:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, "message is not valid JSON") from None
            if not isinstance(message, dict):
                raise ProtocolError(ErrorCode.BAD_MESSAGE, "message must be a JSON object")
            kind = message.get("type")
            if not isinstance(kind, str) or kind not in CLIENT_FIELDS:  # a list or object is unhashable
                raise ProtocolError(
                    ErrorCode.BAD_MESSAGE, f"unknown message type {quoted(kind)}; expected text, flush, end, cancel or keepalive"
                )
            context_id = message.get("context_id", DEFAULT_CONTEXT)
            if not isinstance(context_id, str) or not 0 < len(context_id) <= MAX_CONTEXT_ID_CHARS:
                raise ProtocolError(
                    ErrorCode.BAD_MESSAGE, f"context_id must be a string of 1-{MAX_CONTEXT_ID_CHARS} characters"
                )
        except ProtocolError as exc:
            return self._session_error(exc.code, exc.message, str(exc.code))
        try:
            extra = set(message) - CLIENT_FIELDS[kind]
            if extra:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"unknown field(s) for {kind}: {quoted(', '.join(sorted(extra)))}")
            if kind == ClientMessage.KEEPALIVE:
                return []  # its arrival was the point
            if kind == ClientMessage.TEXT:
                return self._on_text(context_id, message, now)
            context = self.contexts.get(context_id)
            if context is None:
                raise ProtocolError(ErrorCode.UNKNOWN_CONTEXT, f"no open context {context_id!r}")
            if kind == ClientMessage.CANCEL:
                return self._finish_cancelled(context) + self._close_if_drained()
            if context.state is not ContextState.STREAMING:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"context {context_id!r} has already ended its input")
            if kind == ClientMessage.FLUSH:
                return [FlushInput(context.key)]
            context.state = ContextState.ENDING
            return [EndInput(context.key)]
        except ProtocolError as exc:
            return self._context_error(context_id, exc.code, exc.message) + self._close_if_drained()

    def _on_text(self, context_id: str, message: dict[str, Any], now: float) -> list[Action]:
        text = message.get("text")
        if not isinstance(text, str):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "text must be a string")
        refused = control_character_error(text)
        if refused is not None:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, refused)
        context = self.contexts.get(context_id)
        if context is not None:
            self._check_same_options(context, message)
            if context.state is not ContextState.STREAMING:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"context {context_id!r} has already ended its input")
        held = context.text_chars if context is not None else 0
        if held + len(text) > self.settings.max_text_chars:
            # Not applied; an open context stays usable.
            raise ProtocolError(
                ErrorCode.TEXT_TOO_LONG, f"a context holds at most {self.settings.max_text_chars} characters of text"
            )
        actions: list[Action] = []
        if context is None:
            context = self._new_context(context_id, message, len(text), now)
            actions.append(StartUtterance(context.key, context.voice, context.speed))
        elif text and (refused := self.allowance.spend_chars(len(text), now)) is not None:
            # The rest of the reply cannot be spoken: the context ends (overloaded ends it).
            raise ProtocolError(ErrorCode.OVERLOADED, refused.message)
        if text:
            context.text_chars += len(text)
            if context.first_text_at is None:
                context.first_text_at = now
            actions.append(PushText(context.key, text))
        return actions

    def _new_context(self, context_id: str, message: dict[str, Any], chars: int, now: float) -> Context:
        if self.draining:
            raise ProtocolError(ErrorCode.OVERLOADED, "the gateway is shutting down; no new contexts")
        if len(self.contexts) >= self.settings.max_contexts:
            raise ProtocolError(
                ErrorCode.TOO_MANY_CONTEXTS,
                f"at most {self.settings.max_contexts} contexts may be open on one connection",
            )
        voice = self._check_voice(message["voice"]) if "voice" in message else self.voice
        rate = self._check_rate(message["sample_rate"]) if "sample_rate" in message else self.sample_rate
        encoding = self._check_encoding(message["encoding"]) if "encoding" in message else self.encoding
        speed = _check_speed(message["speed"]) if "speed" in message else 1.0
        if (refused := self.allowance.open_context(chars, now)) is not None:
            raise ProtocolError(ErrorCode.OVERLOADED, refused.message)
        key = self._next_key
        self._next_key += 1
        context = Context(
            key=key,
            context_id=context_id,
            voice=voice,
            sample_rate=rate,
            encoding=encoding,
            speed=speed,
            encoder=StreamEncoder(self.settings.native_rate, rate, encoding),
        )
        self.contexts[context_id] = context
        self._by_key[key] = context
        return context

    @staticmethod
    def _check_same_options(context: Context, message: dict[str, Any]) -> None:
        for name in CONTEXT_OPTIONS:
            if name in message and message[name] != getattr(context, name):
                raise ProtocolError(
                    ErrorCode.BAD_MESSAGE,
                    f"{name} can only be set on a context's first text message",
                )

    def _check_voice(self, voice: Any) -> str:
        if not isinstance(voice, str) or voice not in self._voice_ids:
            raise ProtocolError(
                ErrorCode.UNKNOWN_VOICE, f"unknown voice {quoted(voice)}; available: {', '.join(sorted(self._voice_ids))}"
            )
        return voice

    @staticmethod
    def _check_word_timings(value: str) -> bool:
        if value not in ("true", "false"):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"word_timings must be true or false, got {quoted(value)}")
        return value == "true"

    def _check_inactivity_timeout(self, value: str) -> float:
        longest = self.settings.max_inactivity_timeout_s
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds <= longest:  # also refuses nan
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE, f"inactivity_timeout must be a number of seconds above 0 and at most {longest:g}"
            )
        return seconds

    @staticmethod
    def _check_rate(rate: Any) -> int:
        if isinstance(rate, bool) or not isinstance(rate, int) or rate not in SAMPLE_RATES:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_FORMAT,
                f"unsupported sample_rate {quoted(rate)}; supported: {', '.join(map(str, sorted(SAMPLE_RATES)))}",
            )
        return rate

    @staticmethod
    def _check_encoding(encoding: Any) -> str:
        if encoding not in ENCODINGS:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_FORMAT,
                f"unsupported encoding {quoted(encoding)}; supported: {', '.join(sorted(ENCODINGS))}",
            )
        return encoding

    # ------------------------------------------------------------ engine events

    def audio_ready(
        self, key: int, samples: np.ndarray, words: Iterable[TimedWord], compute_s: float, now: float
    ) -> list[Action]:
        """The engine produced a chunk of native-rate float32 audio for a context."""
        context = self._by_key.get(key)
        if context is None:
            return []  # cancelled or gone: its audio must never be sent
        context.compute_s += compute_s
        offset_ms = context.audio_s * 1000.0
        data, n = context.encoder.encode(samples)
        actions = self._send_audio(context, data, n, now)
        if not self.word_timings:
            return actions
        timings = [
            {
                "text": w.text,
                "start_ms": round(offset_ms + w.start_s * 1000.0, 1),
                "end_ms": round(offset_ms + w.end_s * 1000.0, 1),
            }
            for w in words
        ]
        if timings:
            actions.append(
                SendJson({"type": GatewayMessage.ALIGNMENT, "context_id": context.context_id, "words": timings})
            )
        return actions

    def utterance_finished(self, key: int, now: float) -> list[Action]:
        """The engine spoke all input of a context that had ended."""
        context = self._by_key.get(key)
        if context is None:
            return []
        data, n = context.encoder.finish()
        actions = self._send_audio(context, data, n, now)
        actions.append(
            SendJson(
                {
                    "type": GatewayMessage.DONE,
                    "context_id": context.context_id,
                    "audio_ms": round(context.audio_s * 1000.0, 1),
                    "ttfa_ms": None if context.ttfa_s is None else round(context.ttfa_s * 1000.0, 1),
                }
            )
        )
        actions.append(self._remove(context, "done"))
        return actions + self._close_if_drained()

    def utterance_failed(self, key: int, message: str) -> list[Action]:
        context = self._by_key.get(key)
        if context is None:
            return []
        actions = self._context_error(context.context_id, ErrorCode.INTERNAL, f"speech generation failed: {message}")
        return actions + self._close_if_drained()

    # ------------------------------------------------------------ helpers

    def _send_audio(self, context: Context, data: bytes, n: int, now: float) -> list[Action]:
        if n == 0:
            return []
        offset_s = context.audio_s
        self.last_active_at = now
        if context.first_audio_at is None:
            context.first_audio_at = now
        else:
            due = context.first_audio_at + context.stall_s + offset_s
            if now > due:
                context.stall_s += now - due
                context.stalls += 1
        header = {
            "type": GatewayMessage.AUDIO,
            "context_id": context.context_id,
            "seq": context.seq,
            "offset_ms": round(offset_s * 1000.0, 1),
            "duration_ms": round(n * 1000.0 / context.sample_rate, 1),
            "bytes": len(data),
        }
        context.seq += 1
        context.samples_sent += n
        return [SendJson(header), SendBytes(data)]

    def _finish_cancelled(self, context: Context) -> list[Action]:
        return [
            CancelUtterance(context.key),
            SendJson({"type": GatewayMessage.CANCELLED, "context_id": context.context_id}),
            self._remove(context, "cancelled"),
        ]

    def _cancel_all(self) -> list[Action]:
        actions: list[Action] = []
        for context in list(self.contexts.values()):
            actions.append(CancelUtterance(context.key))
            actions.append(self._remove(context, "cancelled"))
        return actions

    def _remove(self, context: Context, outcome: str) -> ContextFinished:
        del self.contexts[context.context_id]
        del self._by_key[context.key]
        self.allowance.close_context()
        return ContextFinished(
            context_id=context.context_id,
            outcome=outcome,
            ttfa_s=context.ttfa_s,
            audio_s=context.audio_s,
            compute_s=context.compute_s,
            stall_s=context.stall_s,
            stalls=context.stalls,
        )

    def _close(self, code: int, reason: str) -> list[Action]:
        self.closed = True
        return [CloseSession(code, reason)]

    # The wire's error rules (gateway/wire.py) decide what an error does; the client
    # reads the same rules to know what became of its session and contexts.

    def _refuse(self, code: ErrorCode, message: str, close_code: int, reason: str) -> list[Action]:
        """Before ``ready``: every error refuses the session."""
        return [_error(code, message, None), *self._close(close_code, reason)]

    def _session_error(self, code: ErrorCode, message: str, reason: str) -> list[Action]:
        """An error about no one context; a session-ending code stops everything and closes."""
        if code not in SESSION_ENDING_CODES:
            return [_error(code, message, None)]
        return [*self._cancel_all(), _error(code, message, None), *self._close(SESSION_ENDING_CODES[code], reason)]

    def _context_error(self, context_id: str, code: ErrorCode, message: str) -> list[Action]:
        """An error about one context; it ends that context unless its code leaves contexts open."""
        context = self.contexts.get(context_id)
        if context is None or code in CONTEXT_SURVIVING_CODES:
            return [_error(code, message, context_id)]
        return [_error(code, message, context_id), CancelUtterance(context.key), self._remove(context, "error")]


def _error(code: ErrorCode, message: str, context_id: str | None) -> SendJson:
    return SendJson({"type": GatewayMessage.ERROR, "code": str(code), "message": message, "context_id": context_id})


def quoted(value: Any) -> str:
    """``repr(value)`` for an error message, cut to MAX_QUOTED_CHARS with an ellipsis."""
    text = repr(value)
    return text if len(text) <= MAX_QUOTED_CHARS else text[: MAX_QUOTED_CHARS - 1] + "…"


def _parse_int(value: str) -> int | str:
    try:
        return int(value)
    except ValueError:
        return value


def _check_speed(speed: Any) -> float:
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (
        SPEED_RANGE[0] <= speed <= SPEED_RANGE[1]
    ):
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE, f"speed must be a number from {SPEED_RANGE[0]} to {SPEED_RANGE[1]}"
        )
    return float(speed)
