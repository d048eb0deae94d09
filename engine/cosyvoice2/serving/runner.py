"""The token2wav runner: runs chunks of many utterances as batched flow and vocoder calls.

It owns what the model calls need beyond the weights: each utterance's caches (the
vocoder's context, and in incremental mode the flow's state), the voice-prefix cache, the
CUDA graphs of the flow and the vocoder, and the running totals of the flow's work.

The flow runs in one of three modes, each exact (a chunk equals the official flow's
streaming call over prompt + all tokens so far). ``recompute`` is the official one: every
chunk re-runs the flow over prompt + all tokens, so chunk k costs O(k); a batch (on a GPU,
of more than one row) starts its decoder after each voice's shared prompt prefix instead
(prefix_bank.py). ``paged`` starts it after the voice prefix and the turn's stored chunks
too, keeping each turn's decoder state in a pool while it is generated (turn_pool.py), and
its token encoder's state (incremental_encoder.py): a chunk's decoder work is its own frames,
and rows of any turns batch together. ``incremental`` keeps each
utterance's state on its own (incremental.py) and runs it alone. The last chunk is
chunk-causal like the others (``final_attention = "chunk"``, the official flow's streaming
mode) or one pass of full attention over prompt + all tokens (``"full"``, as the official
``tts()`` loop calls it). Every mode solves with the same number of Euler steps
(``flow_steps``; 10, the official count, by default), and every state it keeps (incremental
caches, voice prefixes, the turn pool, the CUDA graphs' step loop) is laid out for it.

Synchronous torch code: the scheduler runs it on its worker threads (:meth:`launch`, then
:meth:`finish`; :meth:`run` does both).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from tts_gateway.engine.cosyvoice2.model.cfm import N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.model.flow import DecoderInputs, EncodedTokens, Flow
from tts_gateway.engine.cosyvoice2.model.flow_encoder import project_speaker
from tts_gateway.engine.cosyvoice2.model.hift import HiFT
from tts_gateway.engine.cosyvoice2.serving.buckets import CAPTURE_LOCK
from tts_gateway.engine.cosyvoice2.serving.call_plan import CallPlanner
from tts_gateway.engine.cosyvoice2.serving.chunking import MEL_CACHE_FRAMES, ChunkJob, ChunkSchedule, call_kind
from tts_gateway.engine.cosyvoice2.serving.encoder_graphs import EncoderGraphs
from tts_gateway.engine.cosyvoice2.serving.flow_graphs import FlowGraphs
from tts_gateway.engine.cosyvoice2.serving.hift_graphs import HiftGraphs
from tts_gateway.engine.cosyvoice2.serving.incremental import FlowStreamCache, inference_chunk
from tts_gateway.engine.cosyvoice2.serving.incremental_encoder import EncoderStreamState, IncrementalEncoder
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import PrefixBank, VoicePrefixCache, flow_after_prefix, solve_after_prefix
from tts_gateway.engine.cosyvoice2.serving.request import StreamState, VoicePrompt
from tts_gateway.engine.cosyvoice2.serving.paged_varlen import attend_reference, flash_attend
from tts_gateway.engine.cosyvoice2.serving.phase_clock import PhaseClock
from tts_gateway.engine.cosyvoice2.serving.turn_pool import (
    PagedAttention, TurnRows, TurnStatePool, flow_paged, solve_paged,
)
from tts_gateway.engine.cosyvoice2.serving.uploads import to_device


def timed_as(phase: str) -> Callable:
    """A runner method whose work is one phase of its thread's call in flight (phase_clock.py);
    what the call launched before it was the flow's other work."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def timed(self: Token2WavRunner, *args, **kwargs):
            self._lap("flow_other")
            result = method(self, *args, **kwargs)
            self._lap(phase)
            return result

        return timed

    return wrap


@dataclass(frozen=True)
class Lane:
    """What a second worker thread runs chunks on while the first runs others: its own CUDA
    stream (of high priority, so that its kernels go first on a busy GPU) and its own CUDA
    graphs (graphs that share a memory pool or static buffers must not replay at the same
    time). Its calls run whole, or with ``after_prefix`` a call of several rows whose voices
    the bank holds runs after their voice prefixes, pinning their slots meanwhile (the first
    thread takes the bank's slots); it keeps nothing in the turn pool."""

    stream: torch.cuda.Stream | None = None
    flow_graphs: FlowGraphs | None = None
    hift_graphs: HiftGraphs | None = None
    encoder_graphs: EncoderGraphs | None = None
    after_prefix: bool = False


@dataclass
class LaunchedCall:
    """A call whose work is enqueued (``Token2WavRunner.launch``): its chunks' audio, one after
    another in ``host`` (pinned host memory on a GPU, filled once ``done`` has passed), their
    ``lengths``, and the phase clock it ran on (``infix``: its thread's, in the totals' names);
    ``work``, its own share of ``work_totals`` (the flow's counters, named without ``flow_``:
    its flow calls, the row-frames they needed and computed, its graph and eager calls).
    ``finish`` sets ``gpu_phase_seconds``, the call's time on its stream by phase (None off a
    GPU; ``gpu_seconds`` is their sum), and unpins the voice-prefix slots the call read
    (``pinned``: a lane's call after prefixes)."""

    host: torch.Tensor
    lengths: list[int]
    done: torch.cuda.Event | None
    clock: PhaseClock
    infix: str
    work: dict[str, int] = field(default_factory=dict)
    gpu_phase_seconds: dict[str, float] | None = None
    pinned: list[int] = field(default_factory=list)

    @property
    def gpu_seconds(self) -> float | None:
        """The call's time on its stream (None off a GPU, or before ``finish``)."""
        return None if self.gpu_phase_seconds is None else sum(self.gpu_phase_seconds.values())


def paged_kernel(flow: Flow) -> PagedAttention:
    """The turn pool's attention: vLLM's paged FlashAttention on a GPU (the engine runs on
    vLLM there), the reference by gathers elsewhere."""
    if not flow.decoder.noise.is_cuda:
        return attend_reference
    return flash_attend(flow.decoder.estimator.attention_layers[0].dim)  # the pool keeps layer inputs


def _padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded into a batch, and their lengths."""
    lengths = to_device([len(row) for row in rows], torch.int32, rows[0].device)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), lengths


def _read_on_this_stream(*tensors: torch.Tensor) -> None:
    """Tensors of an utterance's state that this call reads on the current stream, which may
    not be the stream that made them (a turn's first chunk runs on the first-chunk lane's):
    once they are replaced, the allocator must not hand their memory to the other stream's
    work before this stream's reads of them have run."""
    for tensor in tensors:
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))


def by_finalize(indices: list[int], jobs: list[ChunkJob]) -> Iterator[tuple[bool, list[int]]]:
    """``indices`` of ``jobs`` split by ``finalize``, for calls that take one flag: (flag, part)."""
    for finalize in (False, True):
        part = [i for i in indices if jobs[i].finalize == finalize]
        if part:
            yield finalize, part


class Token2WavRunner:
    """Speech tokens -> 24 kHz audio for chunks of many utterances (:meth:`launch` and :meth:`finish`).

    ``incremental``: keep each utterance's flow state (else recompute, see the module
    docstring); ``prefix_voices``: slots of the voice-prefix cache (recompute mode only);
    ``turn_state_bytes``: with a prefix cache, the budget of the paged pool in which turns
    keep their decoder state (turn_pool.py; 0: none); ``final_attention``: ``"chunk"`` (the
    official flow's streaming mode for the last chunk too) or ``"full"`` (the official
    ``tts()`` loop's full-attention last pass); ``flow_steps``: the Euler steps of every flow
    solve (10 is the official count); ``later_with_first``: later chunks may share first chunks'
    calls (``CallPlanner``). ``flow_graphs`` and ``hift_graphs`` (the engine thread's
    CUDA graphs, captured for ``flow_steps``) are set at start-up.
    """

    def __init__(
        self, flow: Flow, hift: HiFT, schedule: ChunkSchedule, *, incremental: bool = True, prefix_voices: int = 0,
        turn_state_bytes: int = 0, final_attention: str = "full", flow_steps: int = N_TIMESTEPS,
        later_with_first: bool = False,
    ) -> None:
        if final_attention not in ("chunk", "full"):
            raise ValueError(f"final_attention must be 'chunk' or 'full', got {final_attention!r}")
        if flow_steps < 1:
            raise ValueError(f"flow_steps must be >= 1, got {flow_steps}")
        self.flow = flow
        self.flow_steps = flow_steps
        self.hift = hift
        self.schedule = schedule
        self.incremental = incremental
        self.final_streaming = final_attention == "chunk"
        self.planner = CallPlanner(
            schedule, on_gpu=flow.decoder.noise.is_cuda, final_streaming=self.final_streaming,
            later_with_first=later_with_first,
        )
        self.flow_graphs: FlowGraphs | None = None
        self.hift_graphs: HiftGraphs | None = None
        # Incremental streams keep their own flow state: the prefix cache serves recompute only.
        self.prefixes = None
        if prefix_voices and not incremental:
            self.prefixes = VoicePrefixCache(flow, prefix_voices, flow_steps, keep_inputs=bool(turn_state_bytes))
        self.turn_pool = None
        self.token_encoder = None  # paged calls encode each turn's tokens once (_encode_turns)
        if turn_state_bytes and self.prefixes is not None:
            like = next(flow.parameters())
            self.turn_pool = TurnStatePool.within(flow.decoder, turn_state_bytes, like, flow_steps, paged_kernel(flow))
            self.token_encoder = IncrementalEncoder(flow)
        self._window = torch.from_numpy(np.hamming(2 * schedule.cache_samples))
        # The flow's work as running totals (see work_totals); two worker threads add to them.
        self._work: collections.Counter[str] = collections.Counter()
        self._work_lock = threading.Lock()
        # This thread's call in flight: .clock (PhaseClock), .pinned (_pin), .work (_add).
        self._phases = threading.local()

    @classmethod
    def build(
        cls, flow: Flow, hift: HiFT, *, hop_len: int = 25, max_hop_len: int = 100, scale: int = 1,
        first_hop_len: int | None = None, first_by_load: bool = False, second_on_lane: bool = False,
        incremental: bool = True, prefix_voices: int = 0, turn_state_bytes: int = 0, final_attention: str = "full",
        flow_steps: int = N_TIMESTEPS, later_with_first: bool = False,
    ) -> Token2WavRunner:
        """A runner with the chunk schedule these settings and the model's chunk sizes give
        (``first_hop_len`` None: the official first chunk, ``hop_len``)."""
        schedule = ChunkSchedule(
            hop_len=hop_len,
            max_hop_len=max_hop_len,
            scale=scale,
            first_hop_len=hop_len if first_hop_len is None else first_hop_len,
            lookahead=flow.config.pre_lookahead_len,
            chunk_tokens=flow.config.encoder.static_chunk_size,
            mel_ratio=flow.config.token_mel_ratio,
            samples_per_frame=hift.samples_per_frame,
            sample_rate=hift.config.sampling_rate,
            first_by_load=first_by_load,
            second_on_lane=second_on_lane,
        )
        return cls(
            flow, hift, schedule, incremental=incremental, prefix_voices=prefix_voices,
            turn_state_bytes=turn_state_bytes, final_attention=final_attention, flow_steps=flow_steps,
            later_with_first=later_with_first,
        )

    def new_stream(self) -> StreamState:
        """A new utterance's token2wav state, at its first chunk."""
        flow_cache = FlowStreamCache(self.flow_steps) if self.incremental else None
        return StreamState(hop=self.schedule.hop_len, flow_cache=flow_cache)

    # ------------------------------------------------------------------ planning

    def plan(self, jobs: list[ChunkJob], lane: Lane | None = None) -> list[list[int]]:
        """Indices of ``jobs`` in flow calls, in the order to run them (``CallPlanner.plan``);
        ``lane``: the calls run there (its graphs; planned as whole calls, which a call of
        several rows after voice prefixes only makes cheaper, ``Lane.after_prefix``)."""
        on_engine_thread = self.prefixes is not None and lane is None
        prefix = self.prefixes.shortest() if on_engine_thread else None
        stored = self.stored_frames if on_engine_thread and self.turn_pool is not None else None
        return self.planner.plan(jobs, self._flow_graphs(lane), prefix, stored)

    def lane_serves(self, job: ChunkJob, lane: Lane) -> bool:
        """Whether ``lane`` runs this job: one of its turn's opening chunks (``opens_turn``) that
        the lane has a flow graph for, run alone (its graphs cover the voices registered at
        start-up; without graphs, as on a CPU, it runs every opening chunk)."""
        if not self.schedule.opens_turn(job):
            return False
        graphs = lane.flow_graphs
        width = self.planner.decoder_width(self.schedule.job_frames(job), job.finalize)
        return graphs is None or graphs.has(1, width, True)

    def _flow_graphs(self, lane: Lane | None) -> FlowGraphs | None:
        """The flow graphs a call on this lane replays (None: the engine's own thread)."""
        return self.flow_graphs if lane is None else lane.flow_graphs

    # ------------------------------------------------------------------ running chunks

    def run(self, jobs: list[ChunkJob], lane: Lane | None = None) -> list[np.ndarray]:
        """Run chunks of several utterances; returns each one's new audio (float32, 24 kHz):
        ``launch`` then ``finish``."""
        return self.finish(self.launch(jobs, lane))

    @torch.inference_mode()
    def launch(self, jobs: list[ChunkJob], lane: Lane | None = None) -> LaunchedCall:
        """Enqueue a call's GPU work for these chunks of several utterances and move their
        streams past them; their audio reaches the host at ``finish``. Nothing here waits for
        the GPU on the paged path, so a worker thread can launch its next call while this one
        runs (the two are ordered on the stream, and no utterance is in both).

        The flow runs in the calls ``plan`` splits the chunks into (rows padded to the call's
        longest; each row equals running it alone); incremental non-final chunks run per
        utterance (each holds its own state). The vocoder runs once for every group of chunks
        of the same shape, which in steady state is all of them (cached 8 frames + one hop).
        ``lane``: run on a second thread's stream and graphs (None: the engine's own).
        """
        with torch.cuda.stream(lane.stream if lane is not None else None):
            # Each call is timed phase by phase (phase_clock.py), the lane's apart.
            stream = torch.cuda.current_stream(self.flow.decoder.noise.device) if self.planner.on_gpu else None
            clock = PhaseClock(stream)
            self._phases.clock = clock
            self._phases.pinned = pinned = []  # voice-prefix slots the call reads on the lane (_pin)
            self._phases.work = work = collections.Counter()  # the call's share of the work totals (_add)
            try:
                audio = self._run(jobs, lane)
                # One copy to the host for the whole call, which finish waits for.
                lengths = [len(a) for a in audio]
                joined = torch.cat(audio)
                host = torch.empty(joined.shape, dtype=joined.dtype, pin_memory=stream is not None)
                host.copy_(joined, non_blocking=stream is not None)
                self._lap("output")
            except BaseException:
                if pinned:  # nothing more of the call is launched, but what was may still read them
                    try:
                        if stream is not None:
                            stream.synchronize()
                    finally:
                        self.prefixes.unpin(pinned)
                raise
            finally:
                self._phases.clock = self._phases.pinned = self._phases.work = None
            done = None
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
            infix = "" if lane is None else "lane_"  # metrics.PHASE_THREADS
            return LaunchedCall(host, lengths, done, clock, infix, dict(work), pinned=pinned)

    @staticmethod
    def done(call: LaunchedCall | None) -> bool:
        """Whether a launched call's work is done (no call: nothing to wait for); waits for nothing."""
        return call is None or call.done is None or call.done.query()

    def finish(self, call: LaunchedCall) -> list[np.ndarray]:
        """A launched call's audio on the host, once its GPU work is done (waits for it)."""
        try:
            call.clock.wait(call.done)
        finally:  # the engine thread may be waiting for these slots
            if call.pinned:
                self.prefixes.unpin(call.pinned)
                call.pinned = []
        totals = call.clock.close()
        if call.done is not None:
            prefix = "gpu_seconds_"
            call.gpu_phase_seconds = {
                name.removeprefix(prefix): value for name, value in totals.items() if name.startswith(prefix)
            }
        with self._work_lock:
            self._work.update({f"{call.infix}phase_{name}": value for name, value in totals.items()})
            self._work[f"{call.infix}phase_calls"] += 1
        audio = call.host.numpy()
        return [chunk.copy() for chunk in np.split(audio, np.cumsum(call.lengths)[:-1])]

    def _run(self, jobs: list[ChunkJob], lane: Lane | None) -> list[torch.Tensor]:
        """``launch`` on the current stream: each job's audio, on the device."""
        inputs = [self._hift_input(job, mel) for job, mel in zip(jobs, self._flows(jobs, lane))]
        self._lap("flow_other")
        groups: dict[tuple, list[int]] = {}
        for i, (mel, cache_source) in enumerate(inputs):
            groups.setdefault((mel.shape[2], cache_source.shape[2]), []).append(i)
        speech: list[torch.Tensor | None] = [None] * len(jobs)
        source: list[torch.Tensor | None] = [None] * len(jobs)
        for rows in groups.values():
            mel = torch.cat([inputs[i][0] for i in rows])
            cache_source = torch.cat([inputs[i][1] for i in rows])
            wav, src = self._vocode(mel, cache_source, lane)
            for k, i in enumerate(rows):
                speech[i], source[i] = wav[k : k + 1], src[k : k + 1]
        self._lap("vocoder")
        return [self._emit(job, inputs[i][0], speech[i], source[i]) for i, job in enumerate(jobs)]

    def _lap(self, phase: str) -> None:
        """Close a phase of this thread's call in flight (PhaseClock.lap); else nothing."""
        clock = getattr(self._phases, "clock", None)
        if clock is not None:
            clock.lap(phase)

    def _flows(self, jobs: list[ChunkJob], lane: Lane | None = None) -> list[torch.Tensor]:
        """Each job's new mel: batched flow calls as ``plan`` splits them (after the turns'
        stored chunks where there is a turn-state pool); incremental chunks, and single rows
        without a voice prefix to use, run one by one."""
        mels: dict[int, torch.Tensor] = {}
        for group in self.plan(jobs, lane):
            group_jobs = [jobs[i] for i in group]
            if group_jobs[0].request.stream.flow_cache is not None and self._streaming(group_jobs[0].finalize):
                continue
            if self._paged_serves(group_jobs, lane):
                mels.update(zip(group, self._flow_paged(group_jobs)))
                continue
            for finalize, part in by_finalize(group, jobs):
                if len(part) > 1 or (self._streaming(finalize) and self.prefixes is not None and lane is None):
                    mels.update(zip(part, self._flow_batched([jobs[i] for i in part], finalize, lane)))
        return [mels[i] if i in mels else self._flow(job, lane) for i, job in enumerate(jobs)]

    def _streaming(self, finalize: bool) -> bool:
        return self.planner.streaming(finalize)

    def _batch_args(self, jobs: list[ChunkJob]) -> tuple[torch.Tensor, ...]:
        """``Flow.decoder_inputs``' arguments up to ``embedding`` for these jobs, rows padded."""
        device = jobs[0].request.prompt.speech_feat.device
        token, token_len = _padded(
            [to_device(job.request.tokens[: job.end], torch.int32, device) for job in jobs]
        )
        prompt_token, prompt_token_len = _padded([job.request.prompt.speech_tokens[0] for job in jobs])
        return token, token_len, prompt_token, prompt_token_len, *self._prompt_args(jobs)

    @staticmethod
    def _prompt_args(jobs: list[ChunkJob]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The jobs' prompt mel (rows padded), its lengths and their speaker embeddings: the
        decoder's conditions (``Flow.inputs_after``)."""
        prompts = [job.request.prompt for job in jobs]
        return *_padded([p.speech_feat[0] for p in prompts]), torch.cat([p.embedding for p in prompts])

    @torch.inference_mode()
    @timed_as("unpaged")
    def _flow_batched(self, jobs: list[ChunkJob], finalize: bool, lane: Lane | None = None) -> list[torch.Tensor]:
        """Chunks of several utterances in one flow call (each row equals running it alone)."""
        prompts = [job.request.prompt for job in jobs]
        device = prompts[0].speech_feat.device
        args = self._batch_args(jobs)
        streaming = self._streaming(finalize)
        widths = [self.planner.decoder_width(self.schedule.job_frames(job), finalize) for job in jobs]
        prefix_frames = [self.flow.voice_prefix_frames(p.tokens) for p in prompts]
        after = [w - p for w, p in zip(widths, prefix_frames)]  # each row's frames after its voice prefix
        taken = self._prefix_slots(jobs, lane, prefix_frames, max(after)) if streaming else None
        slots = None if taken is None else to_device(taken, torch.long, device)
        if slots is not None:
            widths = after
        graphs = self._flow_graphs(lane)
        self._count_call(jobs, widths, slots is not None, graphs)
        encoder = self._lane_encoder(jobs, lane)
        if slots is not None:
            self._lap("flow_other")
            encoding = self._encoding(args, finalize, encoder)

            def solve(*inputs: torch.Tensor) -> torch.Tensor:
                self._lap("encoder")  # the inputs are made: the token encoder's part ends here
                return self._solve_after_prefix(graphs, *inputs)

            mel, new_len = flow_after_prefix(
                self.flow, self.prefixes.bank, slots, *args, finalize=finalize, solve=solve, encoding=encoding
            )
        else:
            mel, new_len = self._flow_call(args, streaming, finalize, graphs, encoder)
        mel_ratio = self.schedule.mel_ratio
        return [
            mel[i : i + 1, :, job.request.stream.offset * mel_ratio : int(new_len[i])] for i, job in enumerate(jobs)
        ]

    def _prefix_slots(
        self, jobs: list[ChunkJob], lane: Lane | None, prefix_frames: list[int], width_after: int
    ) -> list[int] | None:
        """The bank slots of these streaming jobs' voices (``prefix_frames`` each) where their
        call starts after the voice prefixes (``width_after`` frames at most a row), else None.
        More voices than the cache holds would rebuild prefixes batch after batch. On the
        engine thread, asked first whether a prefix serves: taking a slot may build a voice's
        prefix. On the lane (``Lane.after_prefix``), calls of several rows (one row replays its
        whole graph faster) whose voices the bank holds already, their slots pinned until the
        call's GPU work is done (``finish``)."""
        prefixes = self.prefixes
        prompts = [job.request.prompt for job in jobs]
        if prefixes is None or not 0 < len({id(p) for p in prompts}) <= prefixes.capacity:
            return None
        if lane is not None:
            if not lane.after_prefix or len(jobs) < 2:
                return None
            return self._pin(jobs, lane, min(prefix_frames), width_after)
        if not self._prefix_serves(jobs):
            return None
        prefixes.make_room(max(prefix_frames), prompts[0].speech_feat)
        return prefixes.slots(prompts)

    def _pin(self, jobs: list[ChunkJob], lane: Lane, shortest_prefix: int, width_after: int) -> list[int] | None:
        """The lane's call after its voices' prefixes: their slots, pinned for the call in flight
        (``finish`` unpins them once its GPU work is done, ``launch`` if the call fails), where
        every voice has a prefix and the lane has a graph of the call after them; else None and
        the call runs whole (no slower than without the setting)."""
        pinned = getattr(self._phases, "pinned", None)
        if pinned is None:
            raise RuntimeError("a lane's call after voice prefixes runs inside launch, which unpins its slots")
        graphs = lane.flow_graphs
        if shortest_prefix == 0 or (
            graphs is not None and not graphs.has(len(jobs), width_after, True, after_prefix=True)
        ):
            return None
        slots = self.prefixes.pin([job.request.prompt for job in jobs])
        if slots is not None:
            pinned.extend(slots)
            self._count("lane_calls_after_prefix")
        return slots

    # ------------------------------------------------------------------ turns' stored chunks

    def _paged_serves(self, jobs: list[ChunkJob], lane: Lane | None) -> bool:
        """Whether these jobs run after their voice prefixes and stored chunks: chunk-causal
        calls on the engine's own thread (the lane keeps its graphs of whole first chunks)
        whose voices all fit the prefix bank."""
        if self.turn_pool is None or lane is not None or not all(self._streaming(job.finalize) for job in jobs):
            return False
        prompts = {id(job.request.prompt): job.request.prompt for job in jobs}.values()
        if len(prompts) > self.prefixes.capacity:
            return False
        like = next(iter(prompts)).speech_feat
        self.prefixes.make_room(max(self.flow.voice_prefix_frames(p.tokens) for p in prompts), like)
        return self.prefixes.slots(list(prompts)) is not None

    @torch.inference_mode()
    def _flow_paged(self, jobs: list[ChunkJob]) -> list[torch.Tensor]:
        """Chunks that start after their voice prefix and their turn's stored frames, and keep
        the chunks they complete (turn_pool.py): each costs its own frames. Chunks of turns the
        pool has no room for run without it (after their voice prefix), in one call."""
        mels: dict[int, torch.Tensor] = {}
        fallen = [i for i, job in enumerate(jobs) if getattr(job.request.stream.turn, "fell_back", False)]
        paged = [i for i in range(len(jobs)) if i not in fallen]
        if paged:
            mels.update((paged[k], mel) for k, mel in self._paged_call([jobs[i] for i in paged]).items())
        # A turn that fell back comes back once the pool has room for it again, one a call (each
        # judged by the pool as the calls before left it), in a paged call of its own: it would
        # widen the others' (all of it after its voice prefix is new there, as on the recompute
        # path). Not for its last chunk: nothing would use what it stored.
        back = next((i for i in fallen if not jobs[i].finalize and self._pool_has_room(jobs[i])), None)
        if back is not None:
            jobs[back].request.stream.turn = None
            served = self._paged_call([jobs[back]])
            if served:
                mels[back] = served[0]
                self.turn_pool.count_return()
        for finalize, rest in by_finalize([i for i in range(len(jobs)) if i not in mels], jobs):
            mels.update(zip(rest, self._flow_batched([jobs[i] for i in rest], finalize)))
        return [mels[i] for i in range(len(jobs))]

    def _pool_has_room(self, job: ChunkJob) -> bool:
        """Whether the pool would take the job's turn now, its pages counted to the job's end
        (its look-ahead included: at most a page more than its call stores)."""
        prefix = self.flow.voice_prefix_frames(job.request.prompt.tokens)
        return self.turn_pool.has_room(prefix, self.schedule.job_frames(job))

    def _paged_call(self, jobs: list[ChunkJob]) -> dict[int, torch.Tensor]:
        """One paged call of these jobs: the mel of each job it served, by index (those it did
        not serve fell back)."""
        slots = [self.prefixes.slot(job.request.prompt) for job in jobs]
        states = [job.request.stream for job in jobs]
        prompt_feat, prompt_feat_len, embedding = self._prompt_args(jobs)
        encoded, ends = self._encode_turns(jobs, embedding)
        padded: list[int | None] = []

        def inputs_from(starts: list[int]) -> tuple[DecoderInputs, list[int]]:
            # A row whose encoded frames end before its start has no new frame (as inputs_after gives it).
            row_ends = [max(s, e) for s, e in zip(starts, ends)]
            width = max(e - s for s, e in zip(starts, row_ends))
            start = to_device(starts, torch.long, prompt_feat.device)
            return self.flow.inputs_after(encoded, prompt_feat, prompt_feat_len, start, width), row_ends

        def solve(rows: TurnRows, *inputs: torch.Tensor) -> torch.Tensor:
            mel, replayed = self._solve_paged(rows, *inputs)
            padded.append(replayed)
            return mel

        result, turns = flow_paged(
            self.flow, self.prefixes.bank, self.turn_pool, slots, [s.turn for s in states], inputs_from,
            keep=[not job.finalize for job in jobs], solve=solve,
        )
        for state, turn in zip(states, turns):
            state.turn = turn
            if turn.fell_back:  # it goes on by recompute: its encoder state serves no later call
                state.encoder = None
        self._lap("decoder")
        served = [i for i, s in enumerate(result.served) if s]
        if not served:
            return {}
        start, end, mel, replayed = result.start, result.end, result.mel, padded[0]
        computed = len(served) * mel.shape[2] if replayed is None else replayed
        self._book([jobs[i] for i in served], [end[i] - start[i] for i in served], computed, replayed is None)
        mels = {}
        for row, i in enumerate(served):
            # The chunk's audio starts at the first frame of its first token (earlier frames of
            # a call, back to its last stored chunk, were spoken before).
            request = jobs[i].request
            first = self.schedule.mel_ratio * (request.prompt.tokens + request.stream.offset)
            if first < start[i]:
                raise RuntimeError(f"a chunk's frames start at {first}, its call at {start[i]}")
            mels[i] = mel[row : row + 1, :, first - start[i] : end[i] - start[i]]
        return mels

    @timed_as("encoder")
    def _encode_turns(self, jobs: list[ChunkJob], embedding: torch.Tensor) -> tuple[EncodedTokens, list[int]]:
        """A paged call's token encoding, each turn's tokens encoded once: its stream keeps the
        encoder's state of its complete chunks from call to call (incremental_encoder.py), so a
        call encodes only the tokens after them (a turn's first paged call: its prompt's and all
        so far), attending over the kept ones: a call's encoder work grows linearly with its
        turn, not quadratically. The decoder commits the same whole chunks, so the encoder
        holds the frames the decoder starts at. ``embedding``: the rows' speaker embeddings.
        Also each row's end frame, counted on the host."""
        states, joined = [], []
        for job in jobs:
            stream, prompt = job.request.stream, job.request.prompt
            if stream.encoder is None:
                stream.encoder = EncoderStreamState()
            start = self.flow.voice_prefix_frames(prompt.tokens) + self.stored_frames(job)
            if stream.encoder.committed * self.schedule.mel_ratio > start:
                raise RuntimeError(f"the token encoder has moved past frame {start}, where the decoder starts")
            states.append(stream.encoder)
            device = prompt.speech_tokens.device
            turn_tokens = to_device(job.request.tokens[: job.end], torch.long, device)
            joined.append(torch.cat([prompt.speech_tokens[0].long(), turn_tokens]))
        out = self.token_encoder.step_joined(states, joined, [job.finalize for job in jobs])
        if out.by_graph:
            self._count("encoder_graph_calls")
        speaker = project_speaker(self.flow, embedding)
        return EncodedTokens(out.mu, out.mel_start, out.mel_start + out.mel_len, speaker), out.mel_end

    def _solve_paged(
        self, rows: TurnRows, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor
    ) -> tuple[torch.Tensor, int | None]:
        """The decoder after the rows' prefixes and stored chunks, and the row-frames its graph
        computed: the engine thread's graph replay when one exists for the shape, else the
        eager solve (None)."""
        if self.flow_graphs is not None:
            replayed = self.flow_graphs.run_paged(rows, mu, mask, spks, cond)
            if replayed is not None:
                return replayed
        bank = self.prefixes.bank
        return solve_paged(self.flow.decoder, bank, self.turn_pool, rows, mu, mask, spks, cond), None

    def call_frames(self, job: ChunkJob) -> int:
        """The frames a job's flow call covers, less what its turn has stored: what it costs."""
        return self.schedule.job_frames(job) - self.stored_frames(job)

    def stored_frames(self, job: ChunkJob) -> int:
        """Decoder frames of the job's turn already stored (its voice prefix aside)."""
        turn = job.request.stream.turn
        return 0 if turn is None or self.turn_pool is None else turn.frames

    def release(self, state: StreamState) -> None:
        """Free an utterance's stored flow state (decoder and token encoder) at once (it ended
        or was cancelled; no call of it may be running)."""
        state.flow_cache = None
        state.encoder = None
        if state.turn is not None:
            self.turn_pool.release(state.turn)
            state.turn = None

    def _prefix_serves(self, jobs: list[ChunkJob]) -> bool:
        """Whether these non-final jobs start after their voice prefixes: unless a graph of the
        whole solve serves them (the engine captures those for one row only: a one-row replay
        is latency-bound, and the prefix's extra gathers cost more than its frames save)."""
        graphs = self.flow_graphs
        width = self.planner.decoder_width(max(map(self.schedule.job_frames, jobs)), False)
        return graphs is None or not graphs.has(len(jobs), width, True)

    def prepare_voices(self, prompts: list[VoicePrompt], widest_prompt_tokens: int) -> PrefixBank | None:
        """At start-up: the voice-prefix bank for these voices (``VoicePrefixCache.prepare``),
        or None without a prefix cache. Capture the flow's graphs after this: they read it."""
        if self.prefixes is None:
            return None
        return self.prefixes.prepare(prompts, widest_prompt_tokens)

    @torch.inference_mode()
    @timed_as("unpaged")
    def _flow(self, job: ChunkJob, lane: Lane | None = None) -> torch.Tensor:
        state = job.request.stream
        args = self._batch_args([job])
        graphs = self._flow_graphs(lane)
        streaming = self._streaming(job.finalize)
        if state.flow_cache is None or not streaming:
            width = self.planner.decoder_width(self.schedule.job_frames(job), job.finalize)
            self._count_call([job], [width], False, graphs)
        if not streaming:
            # The official tts() loop speaks the last chunk with full (not chunk-causal)
            # attention over prompt + all tokens: one pass that costs O(utterance), once.
            mel, _ = self._flow_call(args, False, True, graphs)
        elif state.flow_cache is not None:
            mel, _ = inference_chunk(self.flow, state.flow_cache, *args, finalize=job.finalize)
            return mel
        else:
            mel, _ = self._flow_call(args, True, job.finalize, graphs, self._lane_encoder([job], lane))
        return mel[:, :, state.offset * self.schedule.mel_ratio :]

    def _lane_encoder(self, jobs: list[ChunkJob], lane: Lane | None) -> tuple[EncoderGraphs, list[int]] | None:
        """The lane's token-encoder graphs, with each job's prompt + tokens as they count them."""
        if lane is None or lane.encoder_graphs is None:
            return None
        return lane.encoder_graphs, [job.request.prompt.tokens + len(job.request.tokens[: job.end]) for job in jobs]

    def _flow_call(
        self, args: tuple, streaming: bool, finalize: bool, graphs: FlowGraphs | None,
        encoder: tuple[EncoderGraphs, list[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``Flow.inference_batch`` with the decoder solved by ``_decode``; its token encoder is a
        phase of its own (the first-chunk lane's calls run here: what their first audio costs),
        by ``encoder``'s graphs (with the rows' token counts) where they hold a streaming call."""
        self._lap("flow_other")
        encoding = self._encoding(args, finalize, encoder) if streaming else None
        inputs = self.flow.decoder_inputs(*args, streaming, finalize, encoding=encoding)
        self._lap("encoder")
        return self.flow.new_frames(self._decode(inputs, streaming, graphs), inputs), inputs.new_len

    def _encoding(
        self, args: tuple, finalize: bool, encoder: tuple[EncoderGraphs, list[int]] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A streaming call's token encoding by ``encoder``'s graphs (with the rows' token
        counts) where they hold the call, else None (``Flow.decoder_inputs`` encodes eagerly)."""
        if encoder is None:
            return None
        encoder_graphs, totals = encoder
        token, token_len, prompt_token, prompt_token_len, _, _, embedding = args
        encoding = encoder_graphs.run(token, token_len, prompt_token, prompt_token_len, embedding, totals, finalize)
        if encoding is not None:
            self._count("encoder_graph_calls")
        return encoding

    def _decode(self, inputs: DecoderInputs, streaming: bool, graphs: FlowGraphs | None) -> torch.Tensor:
        """The decoder's mel for these inputs: a CUDA graph's replay when one exists for the
        call's shape bucket, else the eager solve."""
        if graphs is not None and inputs.mu.is_cuda:
            mel = graphs.run(inputs.mu, inputs.mask, inputs.spk, inputs.cond, streaming)
            if mel is not None:
                return mel
        decoder = self.flow.decoder
        return decoder(inputs.mu, inputs.mask, inputs.spk, inputs.cond, streaming, n_timesteps=self.flow_steps)

    def _solve_after_prefix(
        self, graphs: FlowGraphs | None, slots: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor,
        spks: torch.Tensor, cond: torch.Tensor,
    ) -> torch.Tensor:
        """The decoder after the rows' voice prefixes: the thread's graph replay (``graphs``)
        when one exists for the shape, else the eager solve."""
        if graphs is not None and mu.is_cuda:
            mel = graphs.run_after_prefix(slots, mu, mask, spks, cond)
            if mel is not None:
                return mel
        return solve_after_prefix(self.flow.decoder, self.prefixes.bank, slots, mu, mask, spks, cond)

    # ------------------------------------------------------------------ the vocoder

    def _vocode(
        self, mel: torch.Tensor, cache_source: torch.Tensor, lane: Lane | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        graphs = self.hift_graphs if lane is None else lane.hift_graphs
        with CAPTURE_LOCK:  # it draws noise: not while the other thread captures a graph
            if graphs is not None:
                replayed = graphs.run(mel, cache_source)
                if replayed is not None:
                    return replayed
            self._count("vocoder_eager_calls")
            return self.hift(mel, cache_source)

    def _hift_input(self, job: ChunkJob, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's mel behind the cached frames of the last chunk, and the cached source."""
        state = job.request.stream
        mel = mel.to(self._hift_dtype)
        if state.hift_mel is None:
            return mel, mel.new_zeros(1, 1, 0)
        _read_on_this_stream(state.hift_mel, state.hift_source)
        return torch.cat([state.hift_mel, mel], dim=2), state.hift_source

    def _emit(self, job: ChunkJob, mel: torch.Tensor, speech: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The chunk's audio (float32, on the device): cross-faded with the last chunk's tail, its
        own tail held back for the next (all of it at the end of the turn); moves the utterance
        past the chunk."""
        state = job.request.stream
        cache_samples = self.schedule.cache_samples
        if state.hift_speech is not None:
            _read_on_this_stream(state.hift_speech)
            speech = self._cross_fade(speech, state.hift_speech)
        if job.finalize:
            state.hift_mel = state.hift_source = state.hift_speech = None
            self.release(state)  # the flow's stored state goes at once
        else:
            state.hift_mel = mel[:, :, -MEL_CACHE_FRAMES:]
            state.hift_source = source[:, :, -cache_samples:]
            state.hift_speech = speech[:, -cache_samples:]
            speech = speech[:, :-cache_samples]
        self.schedule.spoken(job)
        return speech[0].float()

    @property
    def _hift_dtype(self) -> torch.dtype:
        return next(self.hift.parameters()).dtype

    def _cross_fade(self, speech: torch.Tensor, previous_tail: torch.Tensor) -> torch.Tensor:
        """Blend the held-back tail of the last chunk into the start of this one."""
        n = self.schedule.cache_samples
        if self._window.device != speech.device:  # once: a copy per chunk would wait for the GPU
            self._window = self._window.to(speech.device)
        window = self._window
        head = speech[:, :n].double() * window[:n] + previous_tail.double() * window[n:]
        return torch.cat([head.to(speech.dtype), speech[:, n:]], dim=1)

    # ------------------------------------------------------------------ work totals

    def work_totals(self) -> dict[str, float]:
        """The token2wav work so far, as running totals (exported as
        tts_token2wav_<name>_total): ``flow_calls``, of which ``flow_eager_calls`` had no CUDA
        graph, ``flow_encoder_graph_calls`` had their token encoder replayed from one, and
        ``flow_lane_calls_after_prefix`` were the first-chunk lane's calls after voice prefixes;
        ``flow_vocoder_eager_calls``, vocoder calls no graph held;
        ``flow_row_frames_{first,later,final}``, the mel frames the decoder had to
        compute for each kind of chunk (rows x their own widths: what the work grows with);
        ``flow_padded_row_frames``, what it computed (rows and frames padded to the call's
        widest row, or to its graph's bucket). Padded / needed is the share spent on padding.
        With a turn-state pool, its ``turn_state_*`` totals too (``TurnStatePool.totals``). The
        engine thread's calls phase by phase (phase_clock.py): ``flow_phase_calls``, and
        ``flow_phase_gpu_seconds_<phase>`` (on a GPU) and ``flow_phase_thread_seconds_<phase>``;
        the first-chunk lane's as ``flow_lane_phase_*``."""
        with self._work_lock:
            totals = {f"flow_{name}": float(value) for name, value in self._work.items()}
        if self.turn_pool is not None:
            totals |= {f"turn_state_{name}": float(value) for name, value in self.turn_pool.totals().items()}
        return totals

    def _count(self, total: str) -> None:
        self._add({total: 1})

    def _add(self, counts: dict[str, int]) -> None:
        """Add to the work totals, and to the share of the call this thread is launching."""
        with self._work_lock:
            self._work.update(counts)
        call = getattr(self._phases, "work", None)
        if call is not None:
            call.update(counts)

    def _count_call(self, jobs: list[ChunkJob], widths: list[int], after_prefix: bool, graphs: FlowGraphs | None) -> None:
        """Book one flow call of these jobs, whose rows need ``widths`` decoder frames each."""
        rows, width = len(widths), max(widths)
        streaming = self._streaming(jobs[0].finalize)
        replayed = self.planner.replayed_row_frames(graphs, rows, width, streaming, after_prefix)
        self._book(jobs, widths, rows * width if replayed is None else replayed, replayed is None)

    def _book(self, jobs: list[ChunkJob], widths: list[int], padded: int, eager: bool) -> None:
        kind = call_kind(jobs)  # as the scheduler books the call's time: per call, not per row
        self._add({
            "calls": 1, "eager_calls": int(eager), f"row_frames_{kind}": sum(widths), "padded_row_frames": padded,
        })
