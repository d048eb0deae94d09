"""The CosyVoice2 engine on the gateway's engine interface.

Data path of one utterance::

    agent text -> TextNormalizer -> Qwen tokenizer -> LM stage (bistream) -> speech tokens
               -> scheduler -> token2wav runner (flow + HiFT, chunked, batched) -> 24 kHz audio chunks

This module is the front end: it loads the model directory and its voices, starts the
serving layer (serving/), and turns each utterance into one :class:`Request`. The LM stage
runs per utterance (plain torch here; vLLM on a GPU); the scheduler's worker threads run
token2wav for every utterance, most urgent listener first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import torch

from tts_gateway.engine.base import (
    AudioChunk,
    Engine,
    EngineError,
    EngineStats,
    UnknownVoice,
    Utterance,
    UtteranceOptions,
    Voice,
    drive,
)
from tts_gateway.engine.cosyvoice2.alignment import WordClock
from tts_gateway.engine.cosyvoice2.frontend.voices import UnknownVoiceError, VoiceStore
from tts_gateway.engine.cosyvoice2.model import fused_kernels
from tts_gateway.engine.cosyvoice2.model.cfm import N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.model.loading import DTYPES, CosyVoice2Models, load_models
from tts_gateway.engine.cosyvoice2.serving import startup
from tts_gateway.engine.cosyvoice2.serving.lm.stage import LMStage, LMStream
from tts_gateway.engine.cosyvoice2.serving.lm.torch_stage import TorchLMStage
from tts_gateway.engine.cosyvoice2.serving.request import Request, RequestStatus, VoicePrompt
from tts_gateway.engine.cosyvoice2.serving.runner import Token2WavRunner
from tts_gateway.engine.cosyvoice2.serving.scheduler import END, Scheduler
from tts_gateway.engine.cosyvoice2.settings import CosyVoice2Settings
from tts_gateway.engine.text import TextNormalizer
from tts_gateway.engine.text.spoken_words import SpokenWords

log = logging.getLogger(__name__)


class CosyVoice2Engine(Engine):
    name = "cosyvoice2"

    def __init__(self, settings: CosyVoice2Settings) -> None:
        self.settings = settings
        self.sample_rate = 24000
        self.models: CosyVoice2Models | None = None
        self.voice_store: VoiceStore | None = None
        self.lm: LMStage | None = None
        self.runner: Token2WavRunner | None = None
        self.scheduler: Scheduler | None = None
        self._utterances: set[CosyVoice2Utterance] = set()
        self._prompts: dict[str, VoicePrompt] = {}
        self._watchdog: asyncio.Task | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        settings = self.settings
        if not settings.model_dir:
            raise EngineError("engine.cosyvoice2.model_dir is not set: point it at a CosyVoice2-0.5B model directory")
        if settings.llm_backend == "vllm":
            startup.set_token2wav_mps_client(settings.vllm)  # before this process touches CUDA
        device = startup.device_of(settings.device)
        dtype = DTYPES[settings.dtype]
        if settings.llm_backend == "vllm":
            if settings.vllm.async_scheduling:
                # On vLLM 0.26 the warm-up's first round returned a token past its stop: by vLLM's
                # code, the pipelined step after a stop token is already scheduled for the request.
                raise EngineError("[engine.cosyvoice2.vllm] async_scheduling = true cannot serve bistream rounds on "
                                  "this vLLM (a round returned a token past its stop); set it to false")
            if device.type != "cuda":
                raise EngineError("llm_backend = 'vllm' needs a CUDA GPU; use llm_backend = 'torch' on this machine")
            # vLLM first: it sizes its KV cache from the memory it finds free.
            self.lm = await startup.start_vllm_stage(settings)
        if settings.flow_cudnn_attention:  # after the vLLM stage, whose import turned it off
            torch.backends.cuda.enable_cudnn_sdp(True)
        # Before any flow call: the CUDA graphs capture whichever kernels are on.
        fused_kernels.enabled = settings.flow_fused_kernels
        if device.type == "cuda":
            log.info("flow attention: cuDNN SDPA %s", "on" if torch.backends.cuda.cudnn_sdp_enabled() else "off")
            if settings.flow_fused_kernels and not fused_kernels.available():
                log.warning("flow_fused_kernels: Triton does not import here; the flow runs torch ops")
            else:
                log.info(
                    "flow norms and paged conv context: %s",
                    "fused Triton kernels" if settings.flow_fused_kernels else "torch ops",
                )
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
        voices = self.voice_store.list()
        if not voices:
            raise EngineError(
                f"no voices registered in {self.voices_dir}; add one with "
                "`tts-gateway voice add NAME --wav PROMPT.wav --text TRANSCRIPT`"
            )
        log.info("voices: %s (default %s)", ", ".join(v.name for v in self.voices()), self.default_voice)
        self.runner = runner = self._runner(device)
        if settings.flow_steps != N_TIMESTEPS:  # a trade-off this project cannot measure: say so at start
            log.warning(
                "flow_steps = %d Euler steps, not the official %d: a speed/quality trade-off not measured here",
                settings.flow_steps, N_TIMESTEPS,
            )
        # The voice-prefix bank first: the flow's graphs read it.
        slots = runner.prefixes.capacity if runner.prefixes is not None else 0
        prompts = [self._prompt(info.id)[0] for info in voices[:slots]]
        bank = await asyncio.to_thread(runner.prepare_voices, prompts, max(v.speech_tokens for v in voices))
        if bank is not None:
            log.info(
                "flow voice prefixes: %d slots of %d frames (%.2f GiB)", bank.slots, bank.frames, bank.nbytes / 2**30
            )
        pool = runner.turn_pool
        if pool is not None:
            log.info(
                "turns' decoder state: %d pages of %d frames (%.2f GiB)", pool.pages, pool.page_frames, pool.nbytes / 2**30
            )
        prompt_tokens = [info.speech_tokens for info in voices]
        if device.type == "cuda" and settings.graph_max_batch > 0:
            await asyncio.to_thread(startup.capture_flow_graphs, runner, settings, device)
        if device.type == "cuda" and settings.hift_graphs:
            await asyncio.to_thread(
                startup.capture_hift_graphs, runner, settings.max_batch, prompt_tokens, settings.hift_graphs_all_lengths
            )
        if device.type == "cuda" and settings.paged_encoder_graphs and runner.token_encoder is not None:
            await asyncio.to_thread(startup.capture_incremental_encoder_graphs, runner, settings.max_batch)
        lane = None
        if device.type == "cuda" and settings.first_chunk_lane:
            lane = await asyncio.to_thread(startup.first_chunk_lane, runner, settings, prompt_tokens, device)
        if device.type == "cuda":
            startup.check_memory(settings, device)
        self.scheduler = Scheduler(
            runner, settings.max_batch, asyncio.get_running_loop(), early_chunks=settings.early_chunks,
            first_chunk_lane=lane, first_chunk_by_load=settings.first_chunk_by_load,
            launch_ahead=settings.launch_ahead,
            # A CPU's calls cost their rows: nothing to gain by waiting for more.
            min_call_rows=min(settings.min_call_rows, settings.max_batch) if device.type == "cuda" else 1,
            playing_first=settings.playing_listeners_first,
            urgent_between_calls=settings.urgent_chunks_between_calls,
            first_chunk_waits_round=settings.first_chunk_waits_round,
        )
        await self._warm_up()
        self._watchdog = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """The watchdog: a stage that stopped making progress (Scheduler.stalled) or an LM
        backend that died fails every utterance at once, and the engine reports itself failed
        (failure()), instead of leaving its listeners waiting forever."""
        timeout = self.settings.stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            reason = self.scheduler.stalled(timeout) or self.lm.failure()
            if reason is not None:
                log.error("the engine can serve no more: %s", reason)
                self.scheduler.fail_all(reason)  # each utterance raises it, and cancels its LM stream
                return

    def _runner(self, device: torch.device) -> Token2WavRunner:
        settings = self.settings
        # auto: incremental on CPU, where the flow is compute-bound and runs one row at a time;
        # paged on GPU, where rows of any turns batch and each costs its own frames (recompute
        # where there are no voice prefixes to continue from).
        mode = settings.flow_mode
        if mode == "auto":
            mode = "incremental" if device.type == "cpu" else "paged" if settings.prefix_voices else "recompute"
        if mode == "paged" and not settings.prefix_voices:
            raise EngineError("flow_mode 'paged' needs prefix_voices >= 1 (turns continue from their voice's prefix)")
        return Token2WavRunner.build(
            self.models.flow, self.models.hift, hop_len=settings.token_hop_len, max_hop_len=settings.token_max_hop_len,
            scale=settings.stream_scale_factor, first_hop_len=settings.token_first_hop_len,
            first_by_load=settings.first_chunk_by_load, second_on_lane=settings.second_chunk_on_lane,
            incremental=mode == "incremental", prefix_voices=settings.prefix_voices,
            turn_state_bytes=int(settings.token2wav_cache_gb * 2**30) if mode == "paged" else 0,
            final_attention=settings.final_chunk_attention, flow_steps=settings.flow_steps,
            later_with_first=settings.later_chunks_with_first,
        )

    async def _warm_up(self) -> None:
        """Speak one short line end to end so the first real request pays no start-up cost."""

        async def discard(_chunk: AudioChunk) -> None:
            pass

        await drive(self.open_utterance(UtteranceOptions(self.default_voice)), discard, text="Hello.")

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for utterance in list(self._utterances):
            utterance.cancel()
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
        if self.lm is not None:
            await self.lm.close()

    @property
    def voices_dir(self) -> Path:
        return self.settings.voices_path

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
        """A voice's flow conditioning on the model's device (made once), its prompt text ids
        and prompt speech tokens (for the LM stage)."""
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
            self._allow_vocoder_shapes(prompt)
        return prompt, prepared.prompt_text_ids[0].tolist(), prepared.speech_tokens[0].tolist()

    def _allow_vocoder_shapes(self, prompt: VoicePrompt) -> None:
        """A voice's chunk shapes for the vocoder's graphs, captured on their first use (a voice
        registered while serving has none from start-up)."""
        runner = self.runner
        if runner is None:
            return
        schedule = runner.schedule
        if runner.hift_graphs is not None:
            for shape in schedule.chunk_shapes(prompt.tokens):
                runner.hift_graphs.allow(*shape)
        lane = self.scheduler.first_chunk_lane if self.scheduler is not None else None
        if lane is not None and lane.hift_graphs is not None:
            for shape in schedule.lane_shapes(prompt.tokens):
                lane.hift_graphs.allow(*shape)

    # ------------------------------------------------------------ utterances

    def open_utterance(self, options: UtteranceOptions) -> CosyVoice2Utterance:
        if self.scheduler is None or self.lm is None or self.models is None:
            raise EngineError("engine is not started")
        failure = self.failure()
        if failure is not None:
            raise EngineError(f"the engine can serve no more: {failure}")
        prompt, prompt_text, prompt_speech = self._prompt(options.voice)
        utterance = CosyVoice2Utterance(self, prompt, prompt_text, prompt_speech, options.speed, options.word_timings)
        self._utterances.add(utterance)
        return utterance

    def failure(self) -> str | None:
        if self.scheduler is not None and self.scheduler.failure is not None:
            return self.scheduler.failure
        return self.lm.failure() if self.lm is not None else None

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        queued, running = scheduler.counts() if scheduler is not None else (0, 0)
        gauges, totals = self.lm.metrics() if self.lm is not None else ({}, {})
        if scheduler is not None:
            totals.update(scheduler.totals())
        return EngineStats(queued=queued, running=running, utterances=len(self._utterances), extra=gauges, totals=totals)


class CosyVoice2Utterance(Utterance):
    """One utterance: its text goes to the LM stage, its speech tokens and audio through its
    :class:`Request`, whose status says where it stands."""

    def __init__(self, engine: CosyVoice2Engine, prompt: VoicePrompt, prompt_text, prompt_speech, speed: float,
                 word_timings: bool):
        self._engine = engine
        self._scheduler = engine.scheduler
        self._speed = speed
        self._tokenizer = engine.models.frontend.tokenizer
        self._normalizer = TextNormalizer("auto")
        self._spoken_words = SpokenWords()
        schedule = engine.runner.schedule
        pace = len(prompt_speech) / max(len(prompt_text), 1)  # the voice's speech tokens per text token
        # None when the client wants no word timings: none of their bookkeeping either.
        self._words = WordClock(schedule.mel_ratio * schedule.samples_per_frame, pace) if word_timings else None
        self.request = Request(prompt, engine.runner.new_stream(), asyncio.Queue())
        self._scheduler.add(self.request)
        self._lm: LMStream = engine.lm.open(
            prompt_text, prompt_speech, self._tokens, self._lm_done,
            on_text_read=self._words.text_read if self._words is not None else None,
        )

    def push_text(self, text: str) -> None:
        if self.request.status is RequestStatus.OPEN:
            self._send(self._normalizer.push(text))

    def flush(self) -> None:
        if self.request.status is RequestStatus.OPEN:
            self._send(self._normalizer.flush())

    def end_input(self) -> None:
        if self.request.status is RequestStatus.OPEN:
            self.flush()
            self._scheduler.end_input(self.request)
            self._lm.end_text()

    def _send(self, text: str) -> None:
        if text:
            self._scheduler.text_sent(self.request)
            spans = self._normalizer.take_spans()  # taken either way, so that they do not pile up
            if self._words is None:
                self._lm.push_text_ids(self._tokenizer.encode(text))
                return
            self._spoken_words.feed(text, spans)
            ids, ends = self._tokenizer.encode_with_ends(text)
            self._words.add_text(text, ends, self._spoken_words.words_of(text))
            self._lm.push_text_ids(ids)

    def _tokens(self, tokens: list[int]) -> None:
        if self._words is not None:
            self._words.speech(len(tokens))
        self._scheduler.push_tokens(self.request, tokens)

    def cancel(self) -> None:
        """Stop at once: free the engine's work and end the iterator, dropping the audio not
        taken yet (also after the last chunk was made: a listener that barged in hears no more)."""
        self._lm.cancel()
        self._scheduler.cancel(self.request)
        self._engine._utterances.discard(self)
        output = self.request.output
        while not output.empty():
            output.get_nowait()
        output.put_nowait(END)

    def _lm_done(self, error: BaseException | None) -> None:
        if error is None:
            if self._words is not None:
                self._words.speech_ended()
            self._scheduler.tokens_done(self.request)
            return
        log.error("speech token generation failed: %s", error)
        self._scheduler.fail(self.request, EngineError(f"speech token generation failed: {error}"))
        self._lm.cancel()
        self._engine._utterances.discard(self)

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        try:
            while True:
                item = await self.request.output.get()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    self._lm.cancel()  # a failed utterance's speech tokens are of no use
                    raise item if isinstance(item, EngineError) else EngineError(str(item))
                self._scheduler.taken(self.request)
                samples, compute_s, final = item
                made = len(samples)
                if self._speed != 1.0:
                    samples = _change_speed(samples, self._speed)
                played_s = len(samples) / self._engine.sample_rate
                words = () if self._words is None else self._words.chunk(made, played_s, final)
                yield AudioChunk(samples, words=words, compute_s=compute_s)
        finally:
            self._engine._utterances.discard(self)


def _change_speed(samples: np.ndarray, speed: float) -> np.ndarray:
    """Tempo change by resampling the chunk's time axis (pitch moves with it)."""
    n = max(1, int(round(len(samples) / speed)))
    positions = np.linspace(0, len(samples) - 1, n)
    return np.interp(positions, np.arange(len(samples)), samples).astype(np.float32)
