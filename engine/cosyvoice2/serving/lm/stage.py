"""The LLM stage behind the CosyVoice2 engine: text token ids in, speech tokens out.

The engine talks to one small interface, so the plain-torch backend here (CPU tests,
small deployments) and the vLLM backend (continuous batching on a GPU) are
interchangeable. Both follow the official bistream semantics through
:class:`engine.cosyvoice2.model.llm.BistreamPlanner`: 5 text tokens in, up to 15 speech tokens
out, a fill token asks for more text and is never fed back, and at the end of input the
rest of the text plus ``task_id`` is appended and decoding runs to eos.

Speech tokens are delivered through a callback on the event loop's thread.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

from engine.cosyvoice2.model.llm import CosyVoice2LM, TorchLMBackend

log = logging.getLogger(__name__)

# Safety bound on speech per text token (the official offline maximum ratio is 20):
# a model that never samples eos cannot speak forever. Each stage reads its own
# ``max_speech_per_text_token`` (the engine sets it from config).
MAX_SPEECH_PER_TEXT_TOKEN = 20


class LMStream(abc.ABC):
    """One utterance's decoding. Methods are called on the event loop's thread."""

    @abc.abstractmethod
    def push_text_ids(self, ids: Sequence[int]) -> None: ...

    @abc.abstractmethod
    def end_text(self) -> None: ...

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop decoding at once; no more tokens are delivered."""


class LMStage(abc.ABC):
    # Speech tokens a reply may have per text token before it is ended without eos.
    max_speech_per_text_token: float = MAX_SPEECH_PER_TEXT_TOKEN

    @abc.abstractmethod
    def open(
        self,
        prompt_text_ids: Sequence[int],
        prompt_speech_tokens: Sequence[int],
        on_tokens: Callable[[list[int]], None],
        on_done: Callable[[BaseException | None], None],
    ) -> LMStream:
        """Start decoding for one utterance; ``on_done(None)`` after the last token, or with the error."""

    def running(self) -> int:
        return 0

    def failure(self) -> str | None:
        """Why this stage can decode no more, or None."""
        return None

    def metrics(self) -> tuple[dict[str, float], dict[str, float]]:
        """Gauges and running totals for the gateway's metrics (names without the tts_ prefix)."""
        return {"llm_streams": float(self.running())}, {}

    async def close(self) -> None:
        pass


_END = object()


class TorchLMStage(LMStage):
    """Plain-torch decoding, one thread per utterance, sharing one model."""

    def __init__(self, model: CosyVoice2LM) -> None:
        self.model = model
        self._streams: set[_TorchStream] = set()

    def open(self, prompt_text_ids, prompt_speech_tokens, on_tokens, on_done) -> LMStream:
        stream = _TorchStream(self, list(prompt_text_ids), list(prompt_speech_tokens), on_tokens, on_done)
        self._streams.add(stream)
        stream.thread.start()
        return stream

    def running(self) -> int:
        return len(self._streams)

    async def close(self) -> None:
        streams = list(self._streams)
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*(asyncio.to_thread(s.thread.join) for s in streams))


class _TorchStream(LMStream):
    def __init__(self, stage, prompt_text, prompt_speech, on_tokens, on_done) -> None:
        self._stage = stage
        self._loop = asyncio.get_running_loop()
        self._text: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._text_tokens = 0
        self._text_ended = False
        self._prompt_text = prompt_text
        self._prompt_speech = prompt_speech
        self._on_tokens = on_tokens
        self._on_done = on_done
        self.thread = threading.Thread(target=self._run, name="cosyvoice2-lm", daemon=True)

    def push_text_ids(self, ids: Sequence[int]) -> None:
        if ids:
            self._text_tokens += len(ids)
            self._text.put(list(ids))

    def end_text(self) -> None:
        self._text_ended = True
        self._text.put(_END)

    def cancel(self) -> None:
        self._cancelled.set()
        self._text.put(_END)

    def _pieces(self) -> Iterator[list[int]]:
        """The text one token at a time, as the official frontend feeds it: a round starts
        as soon as its 5 text tokens are there, however the text was split into pieces."""
        while True:
            piece = self._text.get()
            if piece is _END or self._cancelled.is_set():
                return
            for token in piece:
                yield [token]

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            backend = TorchLMBackend(self._stage.model, mask_impossible=True)
            tokens = backend.generate_bistream(
                self._pieces(), self._prompt_text, self._prompt_speech, first_round_budget=True
            )
            emitted = 0
            for token in tokens:
                if self._cancelled.is_set():
                    return
                emitted += 1
                self._loop.call_soon_threadsafe(self._on_tokens, [token])
                # The bound applies once all text is in: until then more text may justify more speech.
                if self._text_ended and emitted >= self._stage.max_speech_per_text_token * max(self._text_tokens, 1):
                    log.warning("speech token limit reached without eos; ending the utterance")
                    break
        except BaseException as exc:  # reported to the utterance, which raises it as EngineError
            error = exc
        finally:
            self._loop.call_soon_threadsafe(self._finish, error)

    def _finish(self, error: BaseException | None) -> None:
        self._stage._streams.discard(self)
        if not self._cancelled.is_set():
            self._on_done(error)
