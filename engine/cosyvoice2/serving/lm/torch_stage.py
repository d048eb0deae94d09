"""The LM stage on plain torch: one thread per utterance, sharing one model (CPU, tests,
small deployments).

:class:`TorchLMBackend` runs decoding plans (:mod:`.planner`) on a
:class:`~tts_gateway.engine.cosyvoice2.model.llm.CosyVoice2LM` with a KV cache; :class:`TorchLMStage`
puts one backend per utterance behind the stage interface (:mod:`.stage`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from transformers import DynamicCache

from tts_gateway.engine.cosyvoice2.model.llm import CosyVoice2LM
from tts_gateway.engine.cosyvoice2.serving.lm.planner import BistreamPlanner, Chunk, offline_chunk
from tts_gateway.engine.cosyvoice2.serving.lm.sampling import Sampler, make_sampler
from tts_gateway.engine.cosyvoice2.serving.lm.stage import LMStage, LMStream

log = logging.getLogger(__name__)


class TorchLMBackend:
    """Runs decoding plans on a :class:`CosyVoice2LM` with a KV cache, one utterance at a time.

    The model can be shared; the cache and the decoded history belong to this object, so
    concurrent utterances need one backend each. ``generate_*`` are synchronous generators:
    the engine runs them in a worker thread and, for streaming text, passes an iterator that
    blocks until the next piece of token ids (or the end) is there.
    """

    MAX_EOS_REDRAWS = 100

    def __init__(
        self,
        model: CosyVoice2LM,
        sampler: Sampler | None = None,
        *,
        mask_impossible: bool = False,
        redraw_suppressed_eos: bool = True,
    ) -> None:
        """``mask_impossible``: give no probability to special classes a round cannot take
        (fill in the final round, the unused class anywhere). The reference raises when it
        samples one; a trained model practically never does, but serving should not fail a
        turn on it. Off, decoding is exactly the reference's.

        ``redraw_suppressed_eos=False``: mask eos where it is suppressed instead of redrawing,
        as a backend that samples once (vLLM) does; with greedy picks a redraw would repeat."""
        self.mask_impossible = mask_impossible
        self.redraw_suppressed_eos = redraw_suppressed_eos
        self.model = model
        self.vocab = model.vocab
        self.sampler = sampler if sampler is not None else make_sampler(model.config.sampling)
        self._cache: DynamicCache | None = None
        self._unfed: list[int] = []  # context positions not run through the model yet
        # The reply's text tokens read by the round being run (Chunk.text_read): what the
        # speech token just yielded was made with.
        self.text_read = 0

    def reset(self) -> None:
        self._cache = DynamicCache()
        self._unfed = []

    @property
    def context_length(self) -> int:
        """Positions in the KV cache."""
        return 0 if self._cache is None else self._cache.get_seq_length()

    @torch.inference_mode()
    def append(self, unified_ids: Sequence[int]) -> torch.Tensor:
        """Extend the context by ``unified_ids`` -> float32 logits of the position after it.

        Positions deferred by a round that ended at its budget are run first.
        """
        feed = [*self._unfed, *unified_ids]
        if not feed:
            raise ValueError("nothing to append")
        if self._cache is None:
            self.reset()
        self._unfed = []
        device = self.model.llm_decoder.weight.device
        ids = torch.tensor([feed], dtype=torch.long, device=device)
        hidden = self.model.hidden(self.model.embed(ids), self._cache)
        return self.model.llm_decoder(hidden[0, -1]).float()

    def step(self, speech_class: int) -> torch.Tensor:
        """Feed one decoded speech class -> logits of the next position."""
        return self.append([self.vocab.speech(speech_class)])

    def sample(self, logits: torch.Tensor, history: list[int], *, allow_eos: bool) -> int:
        """One draw of the sampler; a suppressed eos is redrawn, as the reference does."""
        if not allow_eos and not self.redraw_suppressed_eos:
            logits = logits.clone()
            logits[self.vocab.eos_class] = float("-inf")
        scores = logits.log_softmax(dim=-1)
        for _ in range(self.MAX_EOS_REDRAWS + 1):
            speech_class = self.sampler(scores, history)
            if allow_eos or speech_class != self.vocab.eos_class:
                return speech_class
        raise RuntimeError(f"the sampler kept choosing eos where it is not allowed ({self.MAX_EOS_REDRAWS} redraws)")

    def run(self, chunk: Chunk, history: list[int]) -> Iterator[int]:
        """Run one round: yields its speech tokens; ``history`` collects what the sampler has seen."""
        vocab = self.vocab
        self.text_read = chunk.text_read
        feed = list(chunk.ids)
        emitted = 0
        while chunk.max_tokens is None or emitted < chunk.max_tokens:
            logits = self.append(feed)
            if self.mask_impossible:
                impossible = [
                    special
                    for special in range(vocab.speech_token_size, vocab.num_speech_classes)
                    if special != vocab.eos_class and special not in chunk.stop
                ]
                logits = logits.clone()  # the model's output is an inference tensor
                logits[impossible] = float("-inf")
            allow_eos = vocab.eos_class in chunk.stop and emitted >= chunk.min_tokens
            speech_class = self.sample(logits, history, allow_eos=allow_eos)
            if speech_class in chunk.stop:
                feed = []
                break
            if speech_class >= vocab.speech_token_size:
                raise RuntimeError(f"the model produced speech class {speech_class} where it cannot occur")
            history.append(speech_class)
            emitted += 1
            yield speech_class
            feed = [vocab.speech(speech_class)]
        # A token emitted at the budget has not been run yet: it is run with the next round's ids.
        self._unfed += feed
        if not chunk.final:
            history.append(vocab.fill_class)

    def generate_offline(
        self,
        text: Sequence[int],
        prompt_text: Sequence[int] = (),
        prompt_speech: Sequence[int] = (),
        *,
        min_token_text_ratio: float = 2,
        max_token_text_ratio: float = 20,
    ) -> Iterator[int]:
        """Speech tokens for a whole text (see :func:`offline_chunk`)."""
        chunk = offline_chunk(
            self.vocab,
            text,
            prompt_text,
            prompt_speech,
            min_token_text_ratio=min_token_text_ratio,
            max_token_text_ratio=max_token_text_ratio,
        )
        self.reset()
        yield from self.run(chunk, [])

    def generate_bistream(
        self,
        text_pieces: Iterable[Sequence[int]],
        prompt_text: Sequence[int] = (),
        prompt_speech: Sequence[int] = (),
        max_reply_tokens: int | None = None,
        **planner_options: Any,
    ) -> Iterator[int]:
        """Speech tokens while the text arrives in pieces of token ids (see :class:`BistreamPlanner`).

        ``max_reply_tokens``: a bound on the whole reply; the final round may emit what the
        rounds before it left (at least one token).
        """
        planner = BistreamPlanner(
            self.vocab, prompt_text, prompt_speech, self.model.config.mix_ratio, **planner_options
        )
        self.reset()
        history: list[int] = []
        total = 0
        for piece in text_pieces:
            chunk = planner.push_text(piece)
            if chunk is None:
                continue
            emitted: list[int] = []
            for speech_class in self.run(chunk, history):
                emitted.append(speech_class)
                yield speech_class
            planner.round_done(emitted)
            total += len(emitted)
        final = planner.finish()
        if max_reply_tokens is not None:
            final = replace(final, max_tokens=max(1, max_reply_tokens - total))
        yield from self.run(final, history)


_END = object()
CLOSE_JOIN_S = 5.0  # how long close() waits for each utterance's thread


class TorchLMStage(LMStage):
    """Plain-torch decoding, one thread per utterance, sharing one model."""

    def __init__(self, model: CosyVoice2LM) -> None:
        self.model = model
        self._streams: set[_TorchStream] = set()

    def open(self, prompt_text_ids, prompt_speech_tokens, on_tokens, on_done, on_text_read=None) -> LMStream:
        stream = _TorchStream(self, list(prompt_text_ids), list(prompt_speech_tokens), on_tokens, on_done, on_text_read)
        self._streams.add(stream)
        stream.thread.start()
        return stream

    def running(self) -> int:
        return len(self._streams)

    async def close(self) -> None:
        streams = list(self._streams)
        for stream in streams:
            stream.cancel()
        # Bounded: a thread stuck in the model (the engine's watchdog's case) is left behind, a daemon.
        await asyncio.gather(*(asyncio.to_thread(s.thread.join, CLOSE_JOIN_S) for s in streams))


class _TorchStream(LMStream):
    def __init__(self, stage, prompt_text, prompt_speech, on_tokens, on_done, on_text_read) -> None:
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
        self._on_text_read = on_text_read
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
            text_read = None  # last reported
            for token in tokens:
                if self._cancelled.is_set():
                    return
                emitted += 1
                if self._on_text_read is not None and backend.text_read != text_read:
                    text_read = backend.text_read
                    self._loop.call_soon_threadsafe(self._on_text_read, text_read)
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
