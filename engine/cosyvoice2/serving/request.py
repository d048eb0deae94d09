"""One utterance inside the engine: a :class:`Request` with an explicit :class:`RequestStatus`.

A request is born when a client opens an utterance and lives until its last chunk is out,
or it is cancelled, or it fails. Everything the engine keeps about it is here: its voice,
its speech tokens, where token2wav stands in them (:class:`StreamState`), and what the
scheduler needs to order it against the others (deadline, chunks in flight, latency marks).

The scheduler (scheduler.py) owns every request's fields and changes them under its lock;
the runner (runner.py) changes ``stream`` only while the request is ``running``, which no
other thread touches.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from tts_gateway.engine.scheduling import PlaybackClock


class RequestStatus(enum.Enum):
    """Where an utterance stands. It only moves forward::

        OPEN --end_input--> INPUT_ENDED --last speech token--> TOKENS_DONE --last chunk out--> FINISHED
          \\_______________________ cancel _______________________/ --> CANCELLED
          \\__________________ LM stage or token2wav failed _______/ --> FAILED
    """

    OPEN = "open"  # text may still arrive; speech tokens arrive as the LM stage makes them
    INPUT_ENDED = "input_ended"  # no more text; the LM stage is finishing the reply
    TOKENS_DONE = "tokens_done"  # every speech token is in; chunks remain to be spoken
    FINISHED = "finished"  # the last chunk is out
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in _ENDED


_ENDED = frozenset({RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED})
_NEXT = {
    RequestStatus.OPEN: {RequestStatus.INPUT_ENDED},
    RequestStatus.INPUT_ENDED: {RequestStatus.TOKENS_DONE},
    RequestStatus.TOKENS_DONE: {RequestStatus.FINISHED},
}


@dataclass(frozen=True)
class VoicePrompt:
    """A voice's flow conditioning, on the model's device."""

    speech_tokens: torch.Tensor  # [1, P] int32
    speech_feat: torch.Tensor  # [1, 2P, 80]
    embedding: torch.Tensor  # [1, 192]

    @property
    def tokens(self) -> int:
        return int(self.speech_tokens.shape[1])


@dataclass
class StreamState:
    """Where token2wav stands in one utterance's speech tokens, and its caches (the runner's)."""

    offset: int = 0  # tokens already turned into audio
    hop: int = 0  # current hop (set from the schedule at the first chunk)
    # Where the next regular chunk ends, once an early chunk has taken part of its tokens
    # (None: offset + hop). Regular chunks keep ending where the schedule puts them.
    regular_end: int | None = None
    flow_cache: Any = None  # incremental mode: the flow's per-chunk state (serving/incremental.py)
    turn: Any = None  # with a turn-state pool: its TurnState (pages, committed frames; serving/turn_pool.py)
    encoder: Any = None  # ... and its token encoder's EncoderStreamState (serving/incremental_encoder.py)
    hift_mel: torch.Tensor | None = None  # [1, 80, 8]
    hift_source: torch.Tensor | None = None  # [1, 1, 8 * 480]
    hift_speech: torch.Tensor | None = None  # [1, 8 * 480]


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One utterance: its voice, its speech tokens, its token2wav state and its place in line.

    ``output`` receives, on the event loop, ``(samples, compute_s, final)`` for each chunk, then an
    :class:`~tts_gateway.engine.base.EngineError` or the end marker.
    """

    prompt: VoicePrompt
    stream: Any  # the runner's StreamState (tests may put a stand-in here)
    output: asyncio.Queue
    request_id: int = field(default_factory=lambda: next(_ids))
    status: RequestStatus = RequestStatus.OPEN
    tokens: list[int] = field(default_factory=list)
    running: bool = False  # a worker thread holds its next chunk
    pending: int = 0  # chunks delivered, not yet taken by the utterance
    first_chunk_chosen: bool = False  # its first chunk's length is decided (first_chunk_by_load)
    clock: PlaybackClock = field(default_factory=PlaybackClock)
    # When a chunk's latency went (time.monotonic()): text first reached the LM stage, the
    # first speech token came back, the next chunk's tokens were all there.
    text_at: float | None = None
    first_token_at: float | None = None
    ready_at: float | None = None
    # The LM stage's last sign of life for this request: its latest speech token or the end of
    # its input, whichever came later (the watchdog's view; Scheduler.stalled()).
    lm_progress_at: float | None = None

    def advance(self, status: RequestStatus) -> None:
        """Move to ``status``; ValueError for a move the state machine does not have. Any
        status that has not ended may go to CANCELLED or FAILED."""
        allowed = _NEXT.get(self.status, set())
        if not self.status.ended and status in (RequestStatus.CANCELLED, RequestStatus.FAILED):
            allowed = allowed | {status}
        if status not in allowed:
            raise ValueError(f"request {self.request_id}: {self.status.value} cannot become {status.value}")
        self.status = status
