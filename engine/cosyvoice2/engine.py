"""The CosyVoice2 engine on the gateway's engine interface.

Data path of one utterance::

    agent text -> TextNormalizer -> Qwen tokenizer -> LM stage (bistream) -> speech tokens
               -> token2wav worker (flow + HiFT, chunked, batched) -> 24 kHz audio chunks

The LM stage runs per utterance (plain torch here; vLLM on a GPU). One token2wav worker
thread serves every utterance: whenever chunks are ready it takes up to ``max_batch``
of them, most urgent listener first (earliest playback deadline: an utterance with no
audio yet is due at once, one that is playing is due when its audio runs out), leaving
out chunks whose context is so much longer than the rest that padding would waste the
batch (they go with a batch of their size), and runs them together. A playing utterance
about to run out of audio, with too few tokens for a whole hop, gets the tokens there are
as an early chunk while batches are short (``Token2Wav.next_job(early=True)``). An
utterance whose consumer has not taken its last chunks is not scheduled, so output stays
bounded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import torch

from engine.base import (
    AudioChunk,
    Engine,
    EngineError,
    EngineStats,
    UnknownVoice,
    Utterance,
    UtteranceOptions,
    Voice,
)
from engine.cosyvoice2.serving.lm.stage import LMStage, LMStream
from engine.cosyvoice2.serving.lm.torch_stage import TorchLMStage
from engine.cosyvoice2.model.loading import DTYPES, CosyVoice2Models, load_models
from engine.cosyvoice2.modeldir.layout import missing_files
from engine.cosyvoice2.serving.token2wav import (
    MAX_CALL_ROW_FRAMES,
    PADDING_LIMIT,
    Lane,
    StreamState,
    Token2Wav,
    VoicePrompt,
    call_kind,
)
from engine.cosyvoice2.frontend.voices import UnknownVoiceError, VoiceStore
from engine.scheduling import PlaybackClock
from engine.cosyvoice2.settings import CosyVoice2Settings
from engine.text import TextNormalizer

log = logging.getLogger(__name__)

# Flow graphs of final chunks (full attention over the whole turn) up to this batch: a
# batch holds few of them, since each turn has one.
FINAL_GRAPH_MAX_BATCH = 8
_OUTPUT_CHUNKS = 4  # chunks an utterance may hold before its consumer takes them
# Early chunks (Token2Wav.next_job(early=True)) only while batches take less than this.
EARLY_MAX_BATCH_S = 0.3
# First chunks the first-chunk lane runs in one call (its graphs' largest batch).
FIRST_LANE_MAX_BATCH = 8
_END = object()


def short_first_chunk_fits(playable_s: float, next_tokens: int, token_s: float, call_s: float, busy: bool) -> bool:
    """Whether the chunk after a short first chunk can be out before that one has played.

    Either chunk takes about one flow call (``call_s``) once it runs; the next one also waits
    for the ``next_tokens`` it needs, one every ``token_s`` from now, and for the call in
    flight when the worker is ``busy``. The first chunk's listener plays ``playable_s``."""
    next_out = max(next_tokens * token_s, call_s) + (call_s if busy else 0.0) + call_s
    return next_out <= call_s + playable_s


class CosyVoice2Engine(Engine):
    name = "cosyvoice2"

    def __init__(self, settings: CosyVoice2Settings) -> None:
        self.settings = settings
        self.sample_rate = 24000
        self.models: CosyVoice2Models | None = None
        self.voice_store: VoiceStore | None = None
        self.lm: LMStage | None = None
        self.worker: Token2WavWorker | None = None
        self.token2wav: Token2Wav | None = None
        self._utterances: set[CosyVoice2Utterance] = set()
        self._prompts: dict[str, VoicePrompt] = {}

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        settings = self.settings
        if not settings.model_dir:
            raise EngineError("engine.cosyvoice2.model_dir is not set: point it at a CosyVoice2-0.5B model directory")
        device = _device(settings.device)
        dtype = DTYPES[settings.dtype]
        if settings.llm_backend == "vllm":
            if device.type != "cuda":
                raise EngineError("llm_backend = 'vllm' needs a CUDA GPU; use llm_backend = 'torch' on this machine")
            # vLLM first: it sizes its KV cache from the memory it finds free.
            self.lm = await _start_vllm_stage(settings)
        if settings.flow_cudnn_attention:  # after the vLLM stage, whose import turned it off
            torch.backends.cuda.enable_cudnn_sdp(True)
        if device.type == "cuda":
            log.info("flow attention: cuDNN SDPA %s", "on" if torch.backends.cuda.cudnn_sdp_enabled() else "off")
        try:
            self.models = await asyncio.to_thread(
                load_models,
                settings.model_dir,
                device=device,
                llm_dtype=dtype,
                flow_dtype=dtype,
                load_llm=settings.llm_backend == "torch",
            )
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot load the CosyVoice2 model: {exc}") from exc
        if self.lm is None:
            self.lm = TorchLMStage(self.models.llm)
        self.lm.max_speech_per_text_token = settings.max_speech_per_text_token
        self.sample_rate = self.models.configs.sample_rate
        self.voice_store = VoiceStore(self.voices_dir, self.models.frontend)
        if not self.voice_store.list():
            raise EngineError(
                f"no voices registered in {self.voices_dir}; add one with "
                "`tts-gateway voice add NAME --wav PROMPT.wav --text TRANSCRIPT`"
            )
        log.info("voices: %s (default %s)", ", ".join(v.name for v in self.voices()), self.default_voice)
        token2wav = Token2Wav(
            self.models.flow,
            self.models.hift,
            hop_len=settings.token_hop_len,
            first_hop_len=settings.token_first_hop_len,
            first_by_load=settings.first_chunk_by_load,
            second_on_lane=settings.second_chunk_on_lane,
            max_hop_len=settings.token_max_hop_len,
            scale=settings.stream_scale_factor,
            incremental=settings.flow_mode == "incremental" or (settings.flow_mode == "auto" and device.type == "cpu"),
            prefix_voices=settings.prefix_voices,
        )
        self.token2wav = token2wav
        # The voice-prefix bank first: the flow's graphs read it.
        voices = self.voice_store.list()
        prompts = [self._prompt(info.id)[0] for info in voices[: token2wav.prefix_voices]]
        bank = await asyncio.to_thread(token2wav.prepare_voices, prompts, max(v.speech_tokens for v in voices))
        if bank is not None:
            log.info(
                "flow voice prefixes: %d slots of %d frames (%.2f GiB)", bank.slots, bank.frames, bank.nbytes / 2**30
            )
        if device.type == "cuda" and settings.graph_max_batch > 0:
            await asyncio.to_thread(self._capture_flow_graphs, device)
        if device.type == "cuda" and settings.hift_graphs:
            await asyncio.to_thread(self._capture_hift_graphs)
        lane = None
        if device.type == "cuda" and settings.first_chunk_lane:
            lane = await asyncio.to_thread(self._first_chunk_lane, device)
        self.worker = Token2WavWorker(
            token2wav, settings.max_batch, asyncio.get_running_loop(), early_chunks=settings.early_chunks,
            first_chunk_lane=lane, first_chunk_by_load=settings.first_chunk_by_load,
        )
        await self._warm_up()

    def _capture_flow_graphs(self, device: torch.device) -> None:
        """CUDA graphs of the flow for every bucket served, then the token2wav memory check."""
        from engine.cosyvoice2.serving.flow_graphs import FlowBuckets, FlowGraphs

        settings = self.settings
        buckets = FlowBuckets.up_to(settings.graph_max_batch, settings.graph_max_frames, settings.graph_frame_step)
        bank = self.token2wav.bank
        graphs = FlowGraphs(self.models.flow.decoder, buckets, bank=bank)
        frames = buckets.frame_buckets()
        # Non-final chunks start after their voices' prefixes where there is a bank (frames:
        # those after the prefix), else run whole; one row runs whole either way (the faster
        # replay on the H200: 85 vs 103 ms for a first chunk with the vocoder). Final chunks
        # end turns, a few at a time. Token2Wav.plan keeps calls of several rows within
        # MAX_CALL_ROW_FRAMES, so larger graphs would not be replayed.
        budget = MAX_CALL_ROW_FRAMES
        graphs.capture([1] if bank is not None else buckets.batches, frames, [True], max_row_frames=budget)
        if bank is not None:
            graphs.capture(buckets.batches, frames, [True], after_prefix=True, max_row_frames=budget)
        final_batches = [b for b in buckets.batches if b <= FINAL_GRAPH_MAX_BATCH]
        graphs.capture(final_batches, frames, [False], max_row_frames=budget)
        self.models.flow.decoder.graphs = graphs
        held = torch.cuda.memory_reserved(device) / 2**30
        # A small graph of each kind against its eager solve.
        checked = [buckets.key(3, 250, streaming, after) for streaming, after in ((True, bank is not None), (False, False))]
        errors = ", ".join(f"{key}: {graphs.replay_error(key):.2e}" for key in checked if key in graphs.graphs)
        log.info(
            "flow CUDA graphs: %d captured in %.1f s (%.2f GiB); |replay - eager| %s; "
            "token2wav holds %.1f GiB of %.1f GiB budgeted",
            len(graphs.graphs), graphs.capture_seconds, graphs.reserved_bytes / 2**30, errors, held,
            settings.vllm.token2wav_memory_gb,
        )
        if held > settings.vllm.token2wav_memory_gb:
            log.warning("token2wav holds more GPU memory than token2wav_memory_gb; raise it or lower max_batch")

    def _capture_hift_graphs(self) -> None:
        """CUDA graphs of the vocoder for every voice's chunk shapes at every batch bucket."""
        from engine.cosyvoice2.serving.hift_graphs import HiftGraphs

        graphs = HiftGraphs(self.models.hift, self.settings.max_batch)
        self.token2wav.hift_graphs = graphs
        for info in self.voice_store.list():  # a voice registered later: its first _prompt()
            for shape in self.token2wav.chunk_shapes(info.speech_tokens):
                graphs.allow(*shape)
        try:
            graphs.capture_allowed()
        except Exception as exc:  # an optional speed-up: the vocoder still runs, eagerly
            self.token2wav.hift_graphs = None
            log.error("HiFT CUDA graphs could not be captured, the vocoder runs eagerly: %s", exc)
            return
        log.info(
            "HiFT CUDA graphs: %d captured in %.1f s; largest |replay - eager| %.2e",
            len(graphs.graphs), graphs.capture_seconds, graphs.max_error,
        )

    def _first_chunk_lane(self, device: torch.device) -> Lane:
        """The first-chunk lane: a stream of the highest priority and its own graphs of every
        voice's opening chunks (``Token2Wav.opens_turn``: flow run whole, and the vocoder) up to
        FIRST_LANE_MAX_BATCH."""
        from engine.cosyvoice2.serving.flow_graphs import FlowBuckets, FlowGraphs
        from engine.cosyvoice2.serving.hift_graphs import HiftGraphs

        settings, token2wav = self.settings, self.token2wav
        priority = -1000  # lower is higher; torch maps a value past the range to the highest priority
        voices = self.voice_store.list()
        widths = sorted({width for info in voices for width in token2wav.lane_widths(info.speech_tokens)})
        buckets = FlowBuckets.up_to(FIRST_LANE_MAX_BATCH, widths[-1], settings.graph_frame_step)
        flow_graphs = FlowGraphs(self.models.flow.decoder, buckets, priority=priority)
        flow_graphs.capture(buckets.batches, widths, [True])
        hift_graphs = None
        if settings.hift_graphs:
            hift_graphs = HiftGraphs(self.models.hift, FIRST_LANE_MAX_BATCH, priority=priority)
            for info in voices:
                for shape in token2wav.lane_shapes(info.speech_tokens):
                    hift_graphs.allow(*shape)
            hift_graphs.capture_allowed()
        log.info(
            "first-chunk lane: %d flow and %d vocoder CUDA graphs in %.1f s (%.2f GiB)",
            len(flow_graphs.graphs), len(hift_graphs.graphs) if hift_graphs else 0,
            flow_graphs.capture_seconds + (hift_graphs.capture_seconds if hift_graphs else 0),
            flow_graphs.reserved_bytes / 2**30,
        )
        return Lane(torch.cuda.Stream(device, priority=priority), flow_graphs, hift_graphs)

    async def _warm_up(self) -> None:
        """Speak one short line end to end so the first real request pays no start-up cost."""
        utterance = self.open_utterance(UtteranceOptions(self.default_voice))
        utterance.push_text("Hello.")
        utterance.end_input()
        async for _chunk in utterance:
            pass

    async def close(self) -> None:
        for utterance in list(self._utterances):
            utterance.cancel()
        if self.worker is not None:
            await asyncio.to_thread(self.worker.stop)
        if self.lm is not None:
            await self.lm.close()

    @property
    def voices_dir(self) -> Path:
        if self.settings.voices_dir:
            return Path(self.settings.voices_dir)
        return Path(self.settings.model_dir) / "voices"

    # ------------------------------------------------------------ voices

    def voices(self) -> list[Voice]:
        if self.voice_store is None:
            return []
        return [info.to_voice() for info in self.voice_store.list()]

    @property
    def default_voice(self) -> str:
        assert self.voice_store is not None
        if self.settings.default_voice:
            try:
                return self.voice_store.info(self.settings.default_voice).id
            except UnknownVoiceError:
                raise EngineError(f"default_voice {self.settings.default_voice!r} is not registered") from None
        return self.voice_store.list()[0].id

    def add_voice(self, name: str, wav_bytes: bytes, prompt_text: str) -> Voice:
        """Register a zero-shot voice (prompt WAV + its transcript). Raises ValueError with a user message."""
        assert self.voice_store is not None
        voice_id = self.voice_store.add(name, wav_bytes, prompt_text)
        return self.voice_store.info(voice_id).to_voice()

    def _prompt(self, voice: str) -> tuple[VoicePrompt, list[int], list[int]]:
        assert self.voice_store is not None and self.models is not None
        try:
            info = self.voice_store.info(voice)
        except UnknownVoiceError:
            raise UnknownVoice(f"unknown voice {voice!r}") from None
        prepared = self.voice_store.load(info.id)
        prompt = self._prompts.get(info.id)
        if prompt is None:
            weight = next(self.models.flow.parameters())
            device, dtype = weight.device, weight.dtype
            prompt = VoicePrompt(
                prepared.speech_tokens.to(device),
                prepared.speech_feat.to(device, dtype),
                prepared.embedding.to(device, dtype),
            )
            self._prompts[info.id] = prompt
            graphs = self.token2wav.hift_graphs if self.token2wav is not None else None
            if graphs is not None:
                for shape in self.token2wav.chunk_shapes(prompt.tokens):
                    graphs.allow(*shape)
            lane = self.worker.first_chunk_lane if self.worker is not None else None
            if lane is not None and lane.hift_graphs is not None:  # captured on the lane's first use
                for shape in self.token2wav.lane_shapes(prompt.tokens):
                    lane.hift_graphs.allow(*shape)
        return prompt, prepared.prompt_text_ids[0].tolist(), prepared.speech_tokens[0].tolist()

    # ------------------------------------------------------------ utterances

    def open_utterance(self, options: UtteranceOptions) -> CosyVoice2Utterance:
        if self.worker is None or self.lm is None or self.models is None:
            raise EngineError("engine is not started")
        prompt, prompt_text, prompt_speech = self._prompt(options.voice)
        utterance = CosyVoice2Utterance(self, prompt, prompt_text, prompt_speech, options.speed)
        self._utterances.add(utterance)
        return utterance

    def failure(self) -> str | None:
        return self.lm.failure() if self.lm is not None else None

    def stats(self) -> EngineStats:
        worker = self.worker
        queued, running = worker.counts() if worker is not None else (0, 0)
        gauges, totals = self.lm.metrics() if self.lm is not None else ({}, {})
        if worker is not None:
            totals.update(worker.totals())
        return EngineStats(queued=queued, running=running, utterances=len(self._utterances), extra=gauges, totals=totals)


class CosyVoice2Utterance(Utterance):
    def __init__(self, engine: CosyVoice2Engine, prompt: VoicePrompt, prompt_text, prompt_speech, speed: float):
        self._engine = engine
        self._speed = speed
        self._tokenizer = engine.models.frontend.tokenizer
        self._normalizer = TextNormalizer("auto")
        self._output: asyncio.Queue = asyncio.Queue()
        self.handle = engine.worker.add(engine.worker.token2wav.new_stream(prompt), self._output)
        self._lm: LMStream = engine.lm.open(prompt_text, prompt_speech, self.handle.push_tokens, self._lm_done)
        self._input_ended = False
        self.cancelled = False

    def push_text(self, text: str) -> None:
        if not (self.cancelled or self._input_ended):
            self._send(self._normalizer.push(text))

    def flush(self) -> None:
        if not (self.cancelled or self._input_ended):
            self._send(self._normalizer.flush())

    def end_input(self) -> None:
        if not (self.cancelled or self._input_ended):
            self.flush()
            self._input_ended = True
            self._lm.end_text()

    def _send(self, text: str) -> None:
        if text:
            self.handle.text_sent()
            self._lm.push_text_ids(self._tokenizer.encode(text))

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        self._lm.cancel()
        self._engine.worker.remove(self.handle)
        self._engine._utterances.discard(self)
        self._output.put_nowait(_END)

    def _lm_done(self, error: BaseException | None) -> None:
        if error is not None:
            log.error("speech token generation failed: %s", error)
            self._output.put_nowait(EngineError(f"speech token generation failed: {error}"))
            self.cancel()
            return
        self.handle.tokens_done()

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        try:
            while True:
                item = await self._output.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item if isinstance(item, EngineError) else EngineError(str(item))
                if self.cancelled:
                    return
                self.handle.taken()
                samples, compute_s = item
                if self._speed != 1.0:
                    samples = _change_speed(samples, self._speed)
                yield AudioChunk(samples, compute_s=compute_s)
        finally:
            self._engine._utterances.discard(self)


def _change_speed(samples: np.ndarray, speed: float) -> np.ndarray:
    """Tempo change by resampling the chunk's time axis (pitch moves with it)."""
    n = max(1, int(round(len(samples) / speed)))
    positions = np.linspace(0, len(samples) - 1, n)
    return np.interp(positions, np.arange(len(samples)), samples).astype(np.float32)


async def _start_vllm_stage(settings: CosyVoice2Settings) -> LMStage:
    """Convert the LM for vLLM (cached beside the model), start it and warm every batch shape."""
    from engine.cosyvoice2.serving.lm.vllm_stage import VLLMLMStage
    from engine.cosyvoice2.serving.lm.vllm_convert import convert
    from engine.cosyvoice2.modeldir.reading import load_model_configs

    missing = missing_files(settings.model_dir)
    if missing:
        raise EngineError(f"model directory {settings.model_dir} is incomplete; missing: {', '.join(missing)}")
    configs = await asyncio.to_thread(load_model_configs, settings.model_dir)
    try:
        path = await asyncio.to_thread(convert, settings.model_dir, configs.llm)
    except (OSError, ValueError, KeyError) as exc:
        raise EngineError(f"cannot convert llm.pt for vLLM: {exc}") from exc
    return await VLLMLMStage.start(settings.vllm, str(path), configs.llm)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class StreamHandle:
    """The worker's view of one utterance. Fields are guarded by the worker's lock.

    It also keeps the times that say where a chunk's latency went (time.monotonic()):
    when text first reached the LM stage, when the first speech token came back, and
    when the next chunk's tokens were all there (``ready_at``).
    """

    def __init__(self, worker: Token2WavWorker, state: StreamState, output: asyncio.Queue) -> None:
        self.worker = worker
        self.state = state
        self.output = output
        self.pending = 0  # chunks delivered, not yet taken by the consumer
        self.busy = False  # a worker thread holds its next chunk
        self.first_settled = False  # its first chunk's length is chosen (first_chunk_by_load)
        self.clock = PlaybackClock()
        self.text_at: float | None = None
        self.first_token_at: float | None = None
        self.ready_at: float | None = None

    # Called on the event loop's thread.
    def text_sent(self) -> None:
        if self.text_at is None:
            self.text_at = time.monotonic()

    def push_tokens(self, tokens: list[int]) -> None:
        now = time.monotonic()
        with self.worker.lock:
            if self.first_token_at is None:
                self.first_token_at = now
            self.state.tokens.extend(tokens)
            self.mark_ready(now)
            self.worker.wake.notify_all()

    def tokens_done(self) -> None:
        with self.worker.lock:
            self.state.tokens_done = True
            self.mark_ready(time.monotonic())
            self.worker.wake.notify_all()

    def mark_ready(self, now: float) -> None:
        if self.ready_at is None and self.worker.token2wav.next_job(self.state) is not None:
            self.ready_at = now

    def taken(self) -> None:
        with self.worker.lock:
            self.pending -= 1
            self.worker.wake.notify_all()


class Token2WavWorker:
    """One thread that runs token2wav for every utterance, most urgent first, in batches.

    With a ``first_chunk_lane`` (a GPU's second stream and graphs, see ``token2wav.Lane``)
    a second thread runs new turns' first chunks there, up to ``FIRST_LANE_MAX_BATCH`` at a
    time, as soon as they are ready: a first chunk then does not wait for the flow call in
    flight. While the lane is busy, the main thread takes first chunks too (a burst of new
    turns). A handle is ``busy`` while either thread holds its next chunk.
    """

    def __init__(
        self, token2wav: Token2Wav, max_batch: int, loop: asyncio.AbstractEventLoop, *, early_chunks: bool = True,
        first_chunk_lane: Lane | None = None, first_chunk_by_load: bool = False,
    ) -> None:
        self.token2wav = token2wav
        self.max_batch = max_batch
        self.loop = loop
        self.early_chunks = early_chunks
        self.first_chunk_lane = first_chunk_lane
        self.first_chunk_by_load = first_chunk_by_load
        self._lane_busy = False
        self._recent_batch_s = 0.0  # moving average of a batch's run time, all its groups
        self._recent_call_s = 0.0  # moving average of one flow call of the main thread
        self._recent_lane_call_s = 0.0  # ... and of the first-chunk lane
        self._wake_at: float | None = None  # when a listener becomes urgent (early chunks)
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.handles: set[StreamHandle] = set()
        self.running = 0
        # Running totals for the metrics (see totals()).
        self._totals: collections.Counter[str] = collections.Counter()
        self._stopping = False
        self._threads = [threading.Thread(target=self._run, name="cosyvoice2-token2wav", daemon=True)]
        if first_chunk_lane is not None:
            self._threads.append(
                threading.Thread(target=self._run_first_chunk_lane, name="cosyvoice2-token2wav-first", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    def add(self, state: StreamState, output: asyncio.Queue) -> StreamHandle:
        handle = StreamHandle(self, state, output)
        with self.lock:
            self.handles.add(handle)
        return handle

    def remove(self, handle: StreamHandle) -> None:
        """Forget a cancelled utterance; its state (and flow cache) is freed once no batch holds it."""
        with self.lock:
            self.handles.discard(handle)

    def counts(self) -> tuple[int, int]:
        with self.lock:
            queued = sum(
                1 for h in self.handles if h.pending < _OUTPUT_CHUNKS and self.token2wav.next_job(h.state) is not None
            )
            return queued, self.running

    def totals(self) -> dict[str, float]:
        """Where the time goes, as running totals (exported as tts_<name>_total).

        ``token2wav_busy_seconds`` against wall time near 1 means this stage is saturated.
        ``first_audio_*_seconds`` split each utterance's first chunk into its stages (divide
        by ``first_audio_chunks`` for the mean): text in -> first speech token -> the
        chunk's tokens complete -> its batch starts -> its audio is out. A chunk delivered
        after its listener ran out of audio is a late chunk, blamed on the LLM stage when
        its tokens were complete only after that moment, else on token2wav.
        """
        with self.lock:
            totals = {name: float(value) for name, value in self._totals.items()}
        return totals | {f"token2wav_{name}": value for name, value in self.token2wav.work_totals().items()}

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            self.wake.notify_all()
        for thread in self._threads:
            thread.join()

    def _early_margin(self) -> float | None:
        """How long before a listener runs dry its tokens are spoken early (None: not now).

        Twice the recent batch time, plus a little: the early chunk must be out before the
        listener's audio is. Only while batches are short: under load an early chunk is an
        extra flow pass the worker has no time for."""
        if not self.early_chunks or self._recent_batch_s > EARLY_MAX_BATCH_S:
            return None
        return 2 * self._recent_batch_s + 0.05

    def _job(self, handle: StreamHandle, now: float):
        """Under the lock: the chunk this handle can run now, if any. With
        ``first_chunk_by_load``, a short first chunk is kept only if the chunk after it can
        follow before it has played (``short_first_chunk_fits``, from the tokens' pace so far
        and the recent flow call time); else the stream waits for the official first chunk."""
        job = self.token2wav.next_job(handle.state)
        if job is None or not job.first or job.finalize or not self.first_chunk_by_load or handle.first_settled:
            return job
        handle.first_settled = True
        state = handle.state
        spoken = len(state.tokens) - 1
        token_s = (now - handle.first_token_at) / spoken if handle.first_token_at is not None and spoken > 0 else 0.0
        # An early chunk can follow with first_hop_len tokens, while the worker has time for one.
        next_tokens = self.token2wav.first_hop_len if self._early_margin() is not None else self.token2wav.hop_len
        playable_s = self.token2wav.first_chunk_playable_s(state)
        # The lane may run the chunk after a short first chunk (Token2Wav.opens_turn).
        if self.first_chunk_lane is not None and self.token2wav.second_on_lane:
            call_s, busy = self._recent_lane_call_s, self._lane_busy
        else:
            call_s, busy = self._recent_call_s, self.running > 0
        if short_first_chunk_fits(playable_s, next_tokens, token_s, call_s, busy):
            return job
        if not self.token2wav.lengthen_first_chunk(state):
            return job
        self._totals["token2wav_first_chunks_lengthened"] += 1
        handle.ready_at = None  # its chunk is ready once the longer chunk's tokens are there
        return self.token2wav.next_job(state)

    def _next_batch(self) -> list:
        now = time.monotonic()
        margin = self._early_margin()
        self._wake_at = None
        ready = []
        for handle in self.handles:
            if handle.pending >= _OUTPUT_CHUNKS or handle.busy:
                continue
            job = self._job(handle, now)
            if job is not None and self._for_lane(job) and not self._lane_busy:
                continue  # the lane is free to take it now
            if job is None and margin is not None and handle.clock.first_audio_at is not None:
                early = self.token2wav.next_job(handle.state, early=True)
                urgent_at = handle.clock.deadline(now) - margin
                if early is not None and urgent_at <= now:
                    job = early
                elif early is not None:
                    self._wake_at = urgent_at if self._wake_at is None else min(self._wake_at, urgent_at)
            if job is not None:
                ready.append((handle.clock.deadline(now), id(handle), handle, job))
            elif handle.state.finished:
                self._finish(handle)
        ready.sort(key=lambda item: item[:2])
        batch: list = []
        useful = width = 0
        for deadline, _, handle, job in ready:
            if len(batch) == self.max_batch:
                break
            frames = self.token2wav.job_frames(job)
            padded = (len(batch) + 1) * max(width, frames)
            # A much longer context than the batch's, not due yet, waits for a batch of its
            # size: now it would run on its own after the others (see _run), holding back
            # whatever arrives meanwhile.
            if batch and deadline > now and padded > PADDING_LIMIT * (useful + frames):
                continue
            batch.append((handle, job))
            useful, width = useful + frames, max(width, frames)
        return batch

    def _finish(self, handle: StreamHandle) -> None:
        self.handles.discard(handle)
        self.loop.call_soon_threadsafe(handle.output.put_nowait, _END)

    def _for_lane(self, job) -> bool:
        """Whether the first-chunk lane runs this job: an opening chunk of its turn (the first;
        with ``second_chunk_on_lane``, after a short first chunk the next too) of a voice it
        has graphs for (a voice registered while serving has none there; the main thread
        takes it)."""
        lane = self.first_chunk_lane
        return lane is not None and self.token2wav.lane_serves(job, lane)

    def _take(self, batch: list) -> list:
        """Mark a batch's handles busy (under the lock) and count its chunks as running."""
        for handle, _ in batch:
            handle.busy = True
        self.running += len(batch)
        return batch

    def _run(self) -> None:
        while True:
            with self.lock:
                batch = self._next_batch()
                while not batch and not self._stopping:
                    self.wake.wait(None if self._wake_at is None else max(0.0, self._wake_at - time.monotonic()))
                    batch = self._next_batch()
                if self._stopping:
                    return
                self._take(batch)
            started = time.monotonic()
            self._run_calls(batch)
            # The whole round of calls: how long until the worker looks at the queue again.
            self._recent_batch_s += 0.2 * (time.monotonic() - started - self._recent_batch_s)

    def _run_first_chunk_lane(self) -> None:
        lane = self.first_chunk_lane
        while True:
            with self.lock:
                batch = self._ready_first_chunks(FIRST_LANE_MAX_BATCH)
                while not batch and not self._stopping:
                    self.wake.wait()
                    batch = self._ready_first_chunks(FIRST_LANE_MAX_BATCH)
                if self._stopping:
                    return
                self._take(batch)
                self._lane_busy = True
            self._run_calls(batch, lane)
            with self.lock:
                self._lane_busy = False
                self.wake.notify_all()  # first chunks the main thread left to the lane

    def _run_calls(self, batch: list, lane: Lane | None = None) -> None:
        """Run a batch as the flow calls ``Token2Wav.plan`` splits it into, in its order (new
        turns' first chunks, then narrowest first), each delivered when done; ``lane``: on the
        first-chunk lane.

        A call runs to its end, and the rest of the batch may take many calls: without a
        first-chunk lane, first chunks that became ready meanwhile go next, so that a new turn
        waits for one call, not for the whole round.
        """
        calls = [[batch[i] for i in group] for group in self.token2wav.plan([job for _, job in batch], lane)]
        while calls:
            self._run_batch(calls.pop(0), lane)
            if self.first_chunk_lane is not None:
                continue
            with self.lock:
                arrived = self._take(self._ready_first_chunks(self.max_batch))
            if arrived:
                plan = self.token2wav.plan([job for _, job in arrived])
                calls[:0] = [[arrived[i] for i in group] for group in plan]

    def _ready_first_chunks(self, limit: int) -> list:
        """Under the lock: (handle, job) of up to ``limit`` first chunks ready to run, of
        handles no thread holds, most urgent first (with a lane: the lane's jobs, see _for_lane)."""
        now = time.monotonic()
        ready = []
        for handle in self.handles:
            if handle.busy or handle.pending >= _OUTPUT_CHUNKS:
                continue
            job = self._job(handle, now)
            if job is not None and (job.first if self.first_chunk_lane is None else self._for_lane(job)):
                ready.append((handle.clock.deadline(now), id(handle), handle, job))
        ready.sort(key=lambda item: item[:2])
        return [(handle, job) for _, _, handle, job in ready[:limit]]

    def _run_batch(self, batch: list, lane: Lane | None = None) -> None:
        """Run one batch of (handle, job) and hand each utterance its audio (or the error)."""
        jobs = [job for _, job in batch]
        call = call_kind(jobs)  # before the run: it moves the streams on
        started = time.monotonic()
        try:
            audio = self.token2wav.run(jobs, lane)
            error = None
        except Exception as exc:  # delivered to each utterance of the batch
            log.exception("token2wav failed")
            error = EngineError(f"audio generation failed: {exc}")
        now = time.monotonic()
        compute_s = (now - started) / max(len(batch), 1)
        with self.lock:
            totals = self._totals
            kind = "token2wav" if lane is None else "token2wav_first_lane"
            totals[f"{kind}_batches"] += 1
            totals[f"{kind}_chunks"] += len(batch)
            totals["token2wav_early_chunks"] += sum(job.early for _, job in batch)
            totals[f"{kind}_busy_seconds"] += now - started
            totals[f"token2wav_calls_{call}"] += 1
            totals[f"token2wav_call_seconds_{call}"] += now - started
            if lane is None:
                self._recent_call_s += 0.2 * (now - started - self._recent_call_s)
            else:
                self._recent_lane_call_s += 0.2 * (now - started - self._recent_lane_call_s)
            self.running -= len(batch)
            for i, (handle, job) in enumerate(batch):
                handle.busy = False
                if handle not in self.handles:
                    continue  # cancelled while running
                if error is not None:
                    self.handles.discard(handle)
                    self.loop.call_soon_threadsafe(handle.output.put_nowait, error)
                    continue
                samples = audio[i]
                self._account(handle, started, now)
                handle.clock.produced(len(samples) / self.token2wav.hift.config.sampling_rate, now)
                handle.pending += 1
                self.loop.call_soon_threadsafe(handle.output.put_nowait, (samples, compute_s))
                if job.finalize:
                    self._finish(handle)
                else:
                    handle.mark_ready(now)  # the next chunk's tokens may be there already

    def _account(self, handle: StreamHandle, started: float, now: float) -> None:
        """Book a delivered chunk's latency by stage (see totals())."""
        totals = self._totals
        ready_at = handle.ready_at if handle.ready_at is not None else started
        handle.ready_at = None
        if handle.clock.first_audio_at is None:
            text_at = handle.text_at if handle.text_at is not None else started
            first_token_at = handle.first_token_at if handle.first_token_at is not None else ready_at
            totals["first_audio_chunks"] += 1
            totals["first_audio_llm_first_token_seconds"] += max(0.0, first_token_at - text_at)
            totals["first_audio_llm_chunk_seconds"] += max(0.0, ready_at - first_token_at)
            totals["first_audio_token2wav_wait_seconds"] += max(0.0, started - ready_at)
            totals["first_audio_token2wav_run_seconds"] += now - started
            return
        runs_out = handle.clock.deadline(now)
        if now > runs_out:
            totals["late_chunks_llm_bound" if ready_at > runs_out else "late_chunks_token2wav_bound"] += 1
