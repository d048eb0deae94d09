"""The one contract every speech engine implements.

The gateway drives engines only through these types. An engine knows nothing of
sessions, sockets or encodings: it turns a stream of text into a stream of float32
audio at its native rate, one *utterance* per conversation turn.

Threading model: every method is called on the event loop that called
:meth:`Engine.start`. ``push_text``/``flush``/``end_input``/``cancel`` never block;
they queue work that the engine's own scheduler runs.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np


class EngineError(Exception):
    """An engine could not do what was asked (bad voice, failed synthesis, ...)."""


class UnknownVoice(EngineError):
    pass


@dataclass(frozen=True, slots=True)
class Voice:
    id: str
    name: str
    language: str
    engine: str

    def as_json(self) -> dict:
        return {"id": self.id, "name": self.name, "language": self.language, "engine": self.engine}


@dataclass(frozen=True, slots=True)
class WordTiming:
    """A word's position inside the chunk that carries it, in seconds from the chunk start."""

    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class AudioChunk:
    samples: np.ndarray  # mono float32 in [-1, 1] at Engine.sample_rate
    words: tuple[WordTiming, ...] = ()
    # Engine time spent producing this chunk; with the audio length it gives the
    # real-time factor the gateway reports.
    compute_s: float = 0.0


@dataclass(frozen=True, slots=True)
class UtteranceOptions:
    voice: str
    speed: float = 1.0
    # False: the client wants no word timings (the gateway sends none; an engine may skip
    # the work of estimating them).
    word_timings: bool = True


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an operator watches: how much work waits and how much runs."""

    queued: int = 0  # units of work ready but not yet started
    running: int = 0  # units of work in progress
    utterances: int = 0  # open utterances
    # Engine-specific gauges and running totals, exported as tts_<name> / tts_<name>_total.
    extra: dict[str, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)


class Utterance(abc.ABC):
    """One turn of speech. Text goes in piecewise; audio chunks come out in order.

    Iterating yields :class:`AudioChunk` until all input has been spoken after
    :meth:`end_input`, or stops early after :meth:`cancel`. A failure is raised
    from the iterator as :class:`EngineError`.
    """

    @abc.abstractmethod
    def push_text(self, text: str) -> None:
        """Append raw text (any split, even mid-word)."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Speak everything buffered now, without waiting for more text."""

    @abc.abstractmethod
    def end_input(self) -> None:
        """No more text: speak the rest, then end the iterator."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop at once: drop queued work, end the iterator, free engine resources.

        Safe to call again, and after the utterance has finished: :func:`drive` calls it
        on every way out.
        """

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[AudioChunk]: ...


async def drive(
    utterance: Utterance,
    on_chunk: Callable[[AudioChunk], Awaitable[None]],
    *,
    text: str | None = None,
    start: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run one utterance to its end, handing each audio chunk to ``on_chunk`` as it comes.

    With ``text``, that is the utterance's whole input: it is pushed and the input ended
    first. Without it, the caller feeds the input meanwhile (a streaming session).
    ``start`` runs after the text is pushed and before the first chunk is awaited (an HTTP
    response's headers, say), so the engine is already working while it runs.

    Whichever way this returns or raises (the engine's :class:`EngineError`, a failing
    ``on_chunk`` such as a write to a client that went away, or the task being
    cancelled), the utterance is cancelled on the way out, so the engine drops its work
    at once. What to do about the failure is the caller's business.
    """
    try:
        if text is not None:
            utterance.push_text(text)
            utterance.end_input()
        if start is not None:
            await start()
        async for chunk in utterance:
            await on_chunk(chunk)
    finally:
        utterance.cancel()


class Engine(abc.ABC):
    name: str
    sample_rate: int

    @abc.abstractmethod
    async def start(self) -> None:
        """Load models and warm up; returns once the engine serves at full speed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Cancel all utterances and release resources."""

    @abc.abstractmethod
    def voices(self) -> list[Voice]: ...

    @property
    @abc.abstractmethod
    def default_voice(self) -> str: ...

    @abc.abstractmethod
    def open_utterance(self, options: UtteranceOptions) -> Utterance:
        """Raises :class:`UnknownVoice` for a voice this engine does not have."""

    def add_voice(self, name: str, wav_bytes: bytes, prompt_text: str) -> Voice:
        """Register a voice from a prompt recording. Blocking: call it off the event loop.

        Raises ``ValueError`` (with a message for the user) for an unusable prompt, and
        ``NotImplementedError`` for engines whose voices are fixed.
        """
        raise NotImplementedError(f"the {self.name} engine has fixed voices")

    def stats(self) -> EngineStats:
        return EngineStats()

    def failure(self) -> str | None:
        """Why the engine can serve no more (a dead backend process), or None while it can."""
        return None
