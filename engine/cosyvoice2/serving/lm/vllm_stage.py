"""The LLM stage on vLLM: every utterance is one streaming-input request of one AsyncLLM.

vLLM batches all utterances' decoding steps continuously on the GPU. Per utterance:

- the :class:`~engine.cosyvoice2.model.llm.BistreamPlanner` turns arriving text into rounds;
- each round is one ``StreamingInput`` (:mod:`tts_gateway.engine.cosyvoice2.serving.lm.vllm_rounds` has the
  translation), given to vLLM only once the previous round has ended, because the planner
  needs the speech tokens of one round to plan the next;
- speech tokens are handed to the engine as vLLM returns them;
- cancel (client cancel, disconnect, barge-in) cancels the request's task, which aborts
  the vLLM request at once and frees its KV cache.

The voice prompt (sos, prompt text and prompt speech, interleaved) opens every request of
that voice, so vLLM's prefix cache serves it after the first utterance; the hit rate is
exported (``tts_llm_prefix_cache_*``).

vLLM is imported where it is used, so that CPU tests can drive this module with an
engine that follows vLLM's streaming-input rules on the plain-torch model.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tts_gateway.engine.cosyvoice2.modeldir.configs import LLMConfig
from tts_gateway.engine.cosyvoice2.serving.lm.planner import BistreamPlanner, Chunk, offline_chunk
from tts_gateway.engine.cosyvoice2.serving.lm.stage import LMStage, LMStream
from tts_gateway.engine.cosyvoice2.modeldir.configs import SamplingConfig
from tts_gateway.engine.cosyvoice2.serving.lm.vllm_rounds import RoundRequest, RoundTracker, round_request
from tts_gateway.engine.cosyvoice2.settings import VLLMSettings

log = logging.getLogger(__name__)

LOGITS_PROCESSOR = "tts_gateway.engine.cosyvoice2.serving.lm.vllm_model:CosyVoice2LogitsProcessor"


@dataclass
class LLMStageCounters:
    """What vLLM reports each step, kept for the gateway's metrics."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found there
    generated_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    inter_token_seconds: float = 0.0  # gaps between a request's consecutive tokens, as vLLM times them
    inter_tokens: int = 0


def token_gaps(iteration_stats) -> list[float]:
    """vLLM's gaps between consecutive tokens of each request in one engine step (seconds)."""
    gaps = getattr(iteration_stats, "inter_token_latencies_iter", None)
    if gaps is None:  # the name before vLLM 0.10
        gaps = getattr(iteration_stats, "time_per_output_tokens_iter", ())
    return list(gaps)


def _stat_logger(counters: LLMStageCounters):
    """A vLLM stat-logger factory that writes into ``counters`` (runs on the event loop)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                counters.running = scheduler_stats.num_running_reqs
                counters.waiting = scheduler_stats.num_waiting_reqs
                counters.kv_cache_usage = scheduler_stats.kv_cache_usage
                counters.prefix_queries += scheduler_stats.prefix_cache_stats.queries
                counters.prefix_hits += scheduler_stats.prefix_cache_stats.hits
                counters.steps += 1
            if iteration_stats is not None:
                counters.generated_tokens += iteration_stats.num_generation_tokens
                counters.prompt_tokens += iteration_stats.num_prompt_tokens
                gaps = token_gaps(iteration_stats)
                counters.inter_token_seconds += sum(gaps)
                counters.inter_tokens += len(gaps)

        def log_engine_initialized(self) -> None:
            pass

    return _Logger


def engine_args(settings: VLLMSettings, model_path: str, *, seed: int = 0):
    from vllm.engine.arg_utils import AsyncEngineArgs

    extra = {}
    if settings.dtype == "float32":
        # FlashAttention has no float32 kernels; Triton's attention does.
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        extra["attention_backend"] = AttentionBackendEnum.TRITON_ATTN
    return AsyncEngineArgs(
        **extra,
        model=model_path,
        skip_tokenizer_init=True,  # prompts are unified token ids
        dtype=settings.dtype,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        enforce_eager=settings.enforce_eager,
        enable_prefix_caching=settings.enable_prefix_caching,
        logits_processors=[LOGITS_PROCESSOR],
        async_scheduling=settings.async_scheduling,  # see VLLMSettings
        seed=seed,
        disable_log_stats=False,
    )


def start_engine(settings: VLLMSettings, model_path: str, counters: LLMStageCounters):
    """An AsyncLLM serving the converted LM at ``model_path``."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from tts_gateway.engine.cosyvoice2.serving.lm.vllm_plugin import register

    register()  # this process; vLLM's own processes run the entry point
    # vLLM forks its engine process by default. A fork after this process has run torch's
    # multi-threaded CPU ops (converting llm.pt does) can leave the child's CPU thread pool
    # deadlocked, a known hazard of fork after OpenMP; on the H200, engines started right
    # after a conversion stalled before loading their model, twice. A spawned engine starts
    # clean (it finds the model through the entry point).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    extra = settings.engine_core_environment()
    if extra:
        # MPS takes a client's settings from its environment when its CUDA context is made.
        # This process makes its own first, so that only vLLM's engine core, started inside
        # the window below, runs with them (vLLM may touch CUDA here too while it starts).
        import torch

        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")
    with environment(extra):  # the engine core starts inside
        return AsyncLLM.from_engine_args(engine_args(settings, model_path), stat_loggers=[_stat_logger(counters)])


@contextlib.contextmanager
def environment(extra: dict[str, str]):
    """``os.environ`` with ``extra`` set, as it was again afterwards: a process started
    meanwhile inherits ``extra``, this one keeps its own environment."""
    before = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def streaming_input(request: RoundRequest, *, greedy: bool):
    """The ``StreamingInput`` of one round."""
    from vllm import SamplingParams
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=request.max_tokens,
        # The logits processor leaves the exact ras distribution: sample it as it is.
        temperature=0.0 if greedy else 1.0,
        top_p=1.0,
        top_k=0,
        ignore_eos=True,
        stop_token_ids=request.stop_token_ids,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
        extra_args=request.rule.to_extra_args(),
    )
    return StreamingInput(prompt=TokensPrompt(prompt_token_ids=request.prompt_token_ids), sampling_params=params)


def request_params():
    """The request-level params vLLM validates a streaming request with (each round brings its own)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=1, output_kind=RequestOutputKind.DELTA, detokenize=False)


class VLLMLMStage(LMStage):
    """Decodes every utterance on one AsyncLLM."""

    def __init__(self, engine, llm_config: LLMConfig, settings: VLLMSettings, counters: LLMStageCounters):
        self.engine = engine
        self.config = llm_config
        self.vocab = llm_config.vocab
        self.settings = settings
        self.counters = counters
        self.sampling: SamplingConfig | None = llm_config.sampling
        self.greedy = False  # True: argmax instead of ras (equality checks against the torch backend)
        self._streams: set[VLLMStream] = set()
        self._ids = itertools.count()

    @classmethod
    async def start(cls, settings: VLLMSettings, model_path: str, llm_config: LLMConfig) -> VLLMLMStage:
        counters = LLMStageCounters()
        engine = start_engine(settings, model_path, counters)
        stage = cls(engine, llm_config, settings, counters)
        try:
            await stage.warm_up(settings.warmup_batch_sizes)
        except BaseException:
            engine.shutdown()
            raise
        return stage

    async def warm_up(self, batch_sizes: Sequence[int]) -> None:
        """Run each batch size once (a bistream round, then a final round) before serving.

        New batch shapes can make vLLM compile kernels; seconds of that inside a live turn
        is a stall, so it happens here, before the gateway reports ready.
        """
        vocab = self.vocab
        text = [i % vocab.text_vocab_size for i in range(100, 110)]

        def rounds() -> list[Chunk]:
            return [
                Chunk(ids=(vocab.sos_eos, *text[:5]), stop=frozenset({vocab.fill_class}), max_tokens=15),
                Chunk(ids=(*text[5:], vocab.task_id), stop=frozenset({vocab.eos_class}), max_tokens=40, final=True),
            ]

        for n in sorted(set(batch_sizes)):
            started = time.perf_counter()
            await asyncio.gather(*(self.run_rounds(rounds()) for _ in range(n)))
            log.info("vLLM warm-up: %d concurrent utterances in %.2f s", n, time.perf_counter() - started)

    def failure(self) -> str | None:
        if self.engine.errored:
            return "the vLLM engine process has died; restart the gateway (its log says why)"
        return None

    def metrics(self) -> tuple[dict[str, float], dict[str, float]]:
        c = self.counters
        gauges = {
            "llm_streams": float(self.running()),
            "llm_running_requests": float(c.running),
            "llm_waiting_requests": float(c.waiting),
            "llm_kv_cache_usage_ratio": c.kv_cache_usage,
        }
        totals = {
            "llm_generated_tokens": float(c.generated_tokens),
            "llm_prompt_tokens": float(c.prompt_tokens),
            "llm_prefix_cache_queried_tokens": float(c.prefix_queries),
            "llm_prefix_cache_hit_tokens": float(c.prefix_hits),
            "llm_steps": float(c.steps),
            "llm_inter_token_seconds": c.inter_token_seconds,
            "llm_inter_tokens": float(c.inter_tokens),
        }
        return gauges, totals

    def open(self, prompt_text_ids, prompt_speech_tokens, on_tokens, on_done, on_text_read=None) -> LMStream:
        stream = VLLMStream(self, list(prompt_text_ids), list(prompt_speech_tokens), on_tokens, on_done, on_text_read)
        self._streams.add(stream)
        return stream

    def running(self) -> int:
        return len(self._streams)

    def request_id(self) -> str:
        return f"cv2-{next(self._ids)}"

    async def close(self) -> None:
        for stream in list(self._streams):
            stream.cancel()
        self.engine.shutdown()

    # ------------------------------------------------------------ whole requests (tests, warm-up)

    async def run_rounds(
        self, rounds: Sequence[Chunk], *, greedy: bool = False, trace: list[RoundTracker] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> list[int]:
        """Decode fixed rounds as one streaming request (no text arriving); returns the speech tokens.

        ``trace`` collects each round with what it emitted (for replaying the decoding elsewhere);
        ``on_tokens`` is given the speech tokens as they come.
        """
        runner = _RoundRunner(self, greedy, on_tokens=on_tokens)
        tokens = await runner.run(iter(rounds))
        if trace is not None:
            trace.extend(runner.rounds)
        return tokens

    async def generate_offline(
        self, text_ids: Sequence[int], prompt_text=(), prompt_speech=(), *, greedy=False, trace=None
    ) -> list[int]:
        chunk = offline_chunk(self.vocab, text_ids, prompt_text, prompt_speech)
        return await self.run_rounds([chunk], greedy=greedy, trace=trace)


class _RoundRunner:
    """Runs rounds on one vLLM streaming request, each after the previous one has ended.

    ``next_round`` is awaited for every round (it may wait for text); it gets the speech
    tokens of the round before, returns the next round, or None to end the request
    (after a final round, the request ends by itself).
    """

    def __init__(
        self, stage: VLLMLMStage, greedy: bool, on_tokens: Callable[[list[int]], None] | None = None,
        on_text_read: Callable[[int], None] | None = None,
    ):
        self.stage = stage
        self.greedy = greedy
        self.on_tokens = on_tokens
        self.on_text_read = on_text_read
        self._text_read: int | None = None  # last reported
        self.tokens: list[int] = []
        self.history: list[int] = []
        self.context = 0  # positions in the request's context
        self.text_tokens = 0  # text tokens received (bounds the final round)
        self._tracker: RoundTracker | None = None
        self.rounds: list[RoundTracker] = []  # every round given, with what it emitted
        self._round_over = asyncio.Event()
        self.input_error: Exception | None = None  # raised while making a round (see _inputs)

    async def run(self, rounds) -> list[int]:
        async def next_round(_emitted):
            return next(rounds, None)

        await self.drive(next_round)
        return self.tokens

    async def drive(self, next_round) -> None:
        stage = self.stage
        outputs = stage.engine.generate(self._inputs(next_round), request_params(), stage.request_id())
        async for output in outputs:
            completion = output.outputs[0]
            tracker = self._tracker
            if tracker is None:
                raise RuntimeError("the LLM returned tokens before a round was given")
            new = tracker.feed(completion.token_ids)
            self.context += len(completion.token_ids)
            if new:
                self.tokens += new
                if self.on_text_read is not None and tracker.chunk.text_read != self._text_read:
                    self._text_read = tracker.chunk.text_read
                    self.on_text_read(self._text_read)
                if self.on_tokens is not None:
                    self.on_tokens(new)
            tracker.finish_reason = completion.finish_reason
            if completion.finish_reason is not None or tracker.done:
                if tracker.chunk.final and tracker.chunk.max_tokens is None and len(self.tokens) >= self._reply_limit():
                    log.warning("speech token limit reached without eos; ending the utterance")
                tracker.done = True
                self.context -= 1  # the round's last sampled token does not stay in the context
                self._round_over.set()
            if output.finished:
                break
        if self.input_error is not None:
            raise RuntimeError(f"the utterance's next round could not be made: {self.input_error}") from self.input_error

    async def _inputs(self, next_round):
        """The rounds as vLLM takes them. A failure here must not pass for the end of the text:
        vLLM ends the request when its input generator stops, so it is kept and raised by
        ``drive`` once the request is over."""
        try:
            async for item in self._rounds(next_round):
                yield item
        except Exception as exc:
            self.input_error = exc

    async def _rounds(self, next_round):
        emitted: list[int] = []
        while True:
            chunk = await next_round(emitted)
            if chunk is None:
                return
            room = self.stage.settings.max_model_len - self.context - len(chunk.ids)
            request = round_request(
                chunk, self.stage.vocab, None if self.greedy else self.stage.sampling, self.history,
                min(room - 1, max(1, self._reply_limit() - len(self.tokens))), room,
            )
            self._check_room(request)
            self.context += len(request.prompt_token_ids)
            self._tracker = RoundTracker(chunk, self.stage.vocab)
            self.rounds.append(self._tracker)
            self._round_over.clear()
            yield streaming_input(request, greedy=self.greedy)
            if chunk.final:
                return
            await self._round_over.wait()
            emitted = self._tracker.emitted
            self.history = self._tracker.history_after(self.history)

    def _reply_limit(self) -> int:
        """Speech tokens the whole reply may have: a model that never samples eos ends there."""
        return int(self.stage.max_speech_per_text_token * max(self.text_tokens, 1))

    def _check_room(self, request: RoundRequest) -> None:
        """The round's limit, plus the stop token that ends it, must fit the model's length."""
        limit = self.stage.settings.max_model_len
        if request.rule.limit < 1 or self.context + len(request.prompt_token_ids) + request.rule.limit + 1 > limit:
            raise RuntimeError(
                f"the utterance does not fit max_model_len={limit} tokens of voice prompt, text and speech; "
                "split the text into shorter contexts or raise max_model_len"
            )


class VLLMStream(LMStream):
    """One utterance: text pieces in (event loop thread), speech tokens out through ``on_tokens``."""

    def __init__(self, stage: VLLMLMStage, prompt_text, prompt_speech, on_tokens, on_done, on_text_read=None) -> None:
        self._stage = stage
        self._planner = BistreamPlanner(
            stage.vocab, prompt_text, prompt_speech, stage.config.mix_ratio, first_round_budget=True
        )
        self._runner = _RoundRunner(stage, greedy=stage.greedy, on_tokens=on_tokens, on_text_read=on_text_read)
        self._text: collections.deque[int] = collections.deque()
        self._text_ended = False
        self._text_arrived = asyncio.Event()
        self._on_done = on_done
        self._cancelled = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def rounds(self) -> list[RoundTracker]:
        """The rounds given to vLLM so far, with what each emitted."""
        return self._runner.rounds

    def push_text_ids(self, ids: Sequence[int]) -> None:
        if ids:
            self._runner.text_tokens += len(ids)
            self._text.extend(ids)
            self._text_arrived.set()

    def end_text(self) -> None:
        self._text_ended = True
        self._text_arrived.set()

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self._task.cancel()
            self._stage._streams.discard(self)

    async def _next_round(self, emitted: list[int]) -> Chunk | None:
        planner = self._planner
        if planner.round_open:
            planner.round_done(emitted)
        while True:
            # One token at a time, as the official frontend feeds it: a round starts as soon
            # as its 5 text tokens are there, however the text was split into pieces.
            while self._text:
                chunk = planner.push_text([self._text.popleft()])
                if chunk is not None:
                    return chunk
            if self._text_ended:
                return planner.finish()
            self._text_arrived.clear()
            await self._text_arrived.wait()

    async def _run(self) -> None:
        error: BaseException | None = None
        try:
            await self._runner.drive(self._next_round)
        except asyncio.CancelledError:
            return  # generate() aborted the vLLM request on its way out
        except Exception as exc:  # reported to the utterance, which raises it as EngineError
            log.exception("speech token generation failed")
            error = exc
        self._stage._streams.discard(self)
        if not self._cancelled:
            self._on_done(error)
