"""The wire format of the streaming protocol (v1): the one definition both ends import.

The gateway's state machine (``gateway/protocol.py``), its HTTP routes and config, the
Python client (``gateway/client/``) and the load generator all take the protocol's
names, numbers and rules from here, so the two ends cannot drift apart. docs/protocol.md
explains them to people; this module states them for programs.

Standard library only: the client installs without the gateway's dependencies.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from types import MappingProxyType

PROTOCOL_VERSION = 1
STREAM_PATH = "/v1/stream"

# Query parameters of the WebSocket URL: the session's defaults, its inactivity timeout in
# seconds, and the API key or a browser token (POST /v1/tokens) where no Authorization
# header can be sent (browsers).
SESSION_QUERY_PARAMETERS = frozenset(
    {"voice", "sample_rate", "encoding", "inactivity_timeout", "word_timings", "api_key", "token"}
)
# How often the Python client pings an otherwise quiet session, so that the gateway's
# inactivity timeout (60 s unless the session chose another) never closes it.
CLIENT_PING_INTERVAL_S = 10.0

DEFAULT_CONTEXT = "default"  # the context of messages that name none
MAX_CONTEXT_ID_CHARS = 128
SPEED_RANGE = (0.5, 2.0)  # speaking rate, 1.0 is normal
# Text to speak may hold these control characters (ordinary whitespace); any other
# (U+0000-U+001F, U+007F-U+009F) is refused: it has no sound, and engines' text
# front ends are not written for it (a NUL broke one).
ALLOWED_CONTROL_CHARACTERS = "\t\n\r"
_REFUSED_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")

SAMPLE_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
# Every encoding is mono; each sample takes this many bytes on the wire.
BYTES_PER_SAMPLE: Mapping[str, int] = MappingProxyType({"pcm_s16le": 2, "pcm_f32le": 4, "mulaw": 1})
ENCODINGS = tuple(BYTES_PER_SAMPLE)


class ClientMessage(enum.StrEnum):
    """The ``type`` of a frame a client sends."""

    TEXT = "text"  # append text to a context, opening it if needed
    FLUSH = "flush"  # speak what is buffered now; the context stays open
    END = "end"  # no more text: speak the rest, then `done`
    CANCEL = "cancel"  # stop at once, then `cancelled`
    KEEPALIVE = "keepalive"  # nothing to say yet: keeps a quiet session open (as a WebSocket ping does)


class GatewayMessage(enum.StrEnum):
    """The ``type`` of a JSON frame the gateway sends."""

    READY = "ready"  # first frame of an accepted session
    AUDIO = "audio"  # a chunk's header; the next frame is its binary samples
    ALIGNMENT = "alignment"  # word timings on a context's audio timeline
    DONE = "done"  # a context was fully spoken and is closed
    CANCELLED = "cancelled"  # confirms a `cancel`; the context is closed
    ERROR = "error"


# The fields each client message may carry. Any other field is refused (bad_message), so
# a typo never passes silently.
CLIENT_FIELDS: Mapping[str, frozenset[str]] = MappingProxyType({
    ClientMessage.TEXT: frozenset({"type", "context_id", "text", "voice", "sample_rate", "encoding", "speed"}),
    ClientMessage.FLUSH: frozenset({"type", "context_id"}),
    ClientMessage.END: frozenset({"type", "context_id"}),
    ClientMessage.CANCEL: frozenset({"type", "context_id"}),
    ClientMessage.KEEPALIVE: frozenset({"type"}),
})
# Options a context takes from its first `text` (or, for all but speed, from the session).
CONTEXT_OPTIONS = ("voice", "sample_rate", "encoding", "speed")

# The fields of each gateway frame. A receiver ignores types and fields it does not know.
GATEWAY_FIELDS: Mapping[str, frozenset[str]] = MappingProxyType({
    GatewayMessage.READY: frozenset({"type", "protocol", "session_id", "voice", "sample_rate", "encoding", "voices"}),
    GatewayMessage.AUDIO: frozenset({"type", "context_id", "seq", "offset_ms", "duration_ms", "bytes"}),
    GatewayMessage.ALIGNMENT: frozenset({"type", "context_id", "words"}),  # words: [{text, start_ms, end_ms}]
    GatewayMessage.DONE: frozenset({"type", "context_id", "audio_ms", "ttfa_ms"}),
    GatewayMessage.CANCELLED: frozenset({"type", "context_id"}),
    GatewayMessage.ERROR: frozenset({"type", "code", "message", "context_id"}),
})


class ErrorCode(enum.StrEnum):
    """The ``code`` of an ``error`` frame (and of the HTTP routes' JSON errors)."""

    BAD_MESSAGE = "bad_message"
    UNKNOWN_VOICE = "unknown_voice"
    UNSUPPORTED_FORMAT = "unsupported_format"
    TEXT_TOO_LONG = "text_too_long"
    TOO_MANY_CONTEXTS = "too_many_contexts"
    UNKNOWN_CONTEXT = "unknown_context"
    OVERLOADED = "overloaded"
    IDLE_TIMEOUT = "idle_timeout"  # nothing from the client and no audio for the inactivity timeout
    INTERNAL = "internal"
    ENGINE_FAILED = "engine_failed"  # the speech engine can serve no more; the gateway restarts


class CloseCode(enum.IntEnum):
    """WebSocket close codes the protocol uses (RFC 6455, section 7.4.1)."""

    NORMAL = 1000  # either side's own close; the gateway's after idle_timeout
    GOING_AWAY = 1001  # the gateway is shutting down
    PROTOCOL_ERROR = 1002  # the client's, when the gateway broke the framing rules
    POLICY = 1008  # bad session defaults, or a client cut off for not reading its audio
    MESSAGE_TOO_BIG = 1009  # a client frame over the gateway's size limit
    INTERNAL_ERROR = 1011  # the gateway's speech engine failed (engine_failed); the client's, when its reader failed
    TRY_AGAIN_LATER = 1013  # refused: the gateway is at its session limit or shutting down


# The rules that say what an error frame did, so that neither end has to guess:
#
# - Before `ready`, any error refuses the session, and the gateway closes it.
# - After `ready`, an error with no context_id whose code is a key here is the session's
#   last frame: the gateway closes the connection with the close code it maps to. With
#   any other code, only the offending message was dropped.
SESSION_ENDING_CODES: Mapping[ErrorCode, CloseCode] = MappingProxyType({
    ErrorCode.IDLE_TIMEOUT: CloseCode.NORMAL,
    ErrorCode.OVERLOADED: CloseCode.POLICY,  # the client did not read its audio
    ErrorCode.ENGINE_FAILED: CloseCode.INTERNAL_ERROR,  # every context has ended with it too
})
# - An error for a context whose code is in this set dropped only the offending message:
#   a context that was open stays open. Any other code means the context was refused or
#   has ended (no `done` follows).
CONTEXT_SURVIVING_CODES = frozenset({ErrorCode.BAD_MESSAGE, ErrorCode.TEXT_TOO_LONG})


def control_character_error(text: str) -> str | None:
    """Why ``text`` may not be spoken (it holds a refused control character), or None.

    One rule for every route that takes text (the WebSocket's ``text`` frames, the HTTP
    speech route's ``input``), so that they refuse the same input with the same words."""
    found = _REFUSED_CONTROL.search(text)
    if found is None:
        return None
    return (
        f"text holds control character U+{ord(found.group()):04X} at position {found.start()}; "
        "only tab, newline and carriage return are allowed"
    )
