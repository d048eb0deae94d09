"""One context (utterance) of a session, as the agent sees it: text in, audio out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, Protocol

from tts_gateway.gateway.client.frames import Alignment, AudioChunk, Done, GatewayError, Word
from tts_gateway.gateway.wire import ClientMessage

# Queued to wake a consumer blocked on an empty queue so it re-checks the end state.
_WAKE = object()


class Session(Protocol):
    """What a context needs of the client that opened it (:class:`TTSClient`), named here so
    that this module does not import the one that imports it."""

    ready: dict[str, Any]

    async def _send(self, message: dict[str, Any]) -> None: ...

    def _forget(self, ctx: Context) -> None: ...


class Context:
    """One utterance stream: text in, audio out. Get one from :meth:`TTSClient.context`.

    Iterate it (``async for chunk in ctx``) to receive :class:`AudioChunk`
    objects in order. Iteration ends after the gateway's ``done`` or
    ``cancelled`` (queued audio is yielded first) and raises
    :class:`GatewayError` when the gateway reports an error for this context
    or the session ends. After ``text_too_long`` or ``bad_message`` the
    context is still open: iterate again to continue.
    """

    def __init__(self, client: Session, context_id: str, options: dict[str, Any], max_queued_chunks: int) -> None:
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
        return self._iterate(with_words=False)

    def events(self) -> AsyncIterator[AudioChunk | Alignment]:
        """Like iterating the context, and with each :class:`Alignment` where it came on the wire:
        after the audio it times. For captions, or players that show words as they play."""
        return self._iterate(with_words=True)

    async def _iterate(self, with_words: bool) -> AsyncIterator[AudioChunk | Alignment]:
        while True:
            if self._queue.empty():
                if self._fatal is not None:
                    raise self._fatal
                if self._ended:
                    return
            item = await self._queue.get()
            if isinstance(item, AudioChunk) or (with_words and isinstance(item, Alignment)):
                if not self._cancel_requested:  # a put already under way when cancel() ran
                    yield item
            elif isinstance(item, GatewayError):
                raise item
            # else _WAKE or an alignment nobody asked for: loop round and re-check the end state

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

    def _discard_queued_audio(self) -> None:  # and its word timings
        kept = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if not isinstance(item, (AudioChunk, Alignment)):
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
