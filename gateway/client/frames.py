"""What the gateway's frames become for the client's user: audio chunks, word timings,
the end of a context, and errors."""

from __future__ import annotations

from dataclasses import dataclass


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
class Alignment:
    """One ``alignment`` frame: timings of words in audio the context already received."""

    context_id: str
    words: tuple[Word, ...]


@dataclass(frozen=True, slots=True)
class Done:
    """The gateway finished speaking a context.

    ``ttfa_ms`` is measured by the gateway (first ``text`` received -> first
    audio sent); None when the context produced no audio.
    """

    context_id: str
    audio_ms: float
    ttfa_ms: float | None

