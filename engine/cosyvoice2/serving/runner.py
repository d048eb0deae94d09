"""The token2wav runner: runs chunks of many utterances as batched flow and vocoder calls.

It owns what the model calls need beyond the weights: each utterance's caches (the
vocoder's context, streaming_vocoder.py, and in incremental mode the flow's state), the
voice-prefix cache, the CUDA graphs of the flow and the vocoder, and the running totals of
its work (flow_work.py).

The flow runs in one of three modes, each exact (a chunk equals the official flow's
streaming call over prompt + all tokens so far). ``recompute`` is the official one: every
chunk re-runs the flow over prompt + all tokens, so chunk k costs O(k); a batch (on a GPU,
of more than one row) starts its decoder after each voice's shared prompt prefix instead
(prefix_bank.py). ``paged`` starts it after the voice prefix and the turn's stored chunks
too (paged_flow.py): a chunk's decoder work is its own frames, and rows of any turns batch
together. ``incremental`` keeps each utterance's state on its own (incremental.py) and runs
it alone. The last chunk is chunk-causal like the others (``final_attention = "chunk"``, the
official flow's streaming mode) or one pass of full attention over prompt + all tokens
(``"full"``, as the official ``tts()`` loop calls it). Every mode solves with the same
number of Euler steps (``flow_steps``; 10, the official count, by default), and every state
it keeps (incremental caches, voice prefixes, the turn pool, the CUDA graphs' step loop) is
laid out for it.

Synchronous torch code: the scheduler runs it on its worker threads (:meth:`launch`, then
:meth:`finish`; :meth:`run` does both).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from tts_gateway.engine.cosyvoice2.model.cfm import N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.model.flow import DecoderInputs, Flow
from tts_gateway.engine.cosyvoice2.model.hift import HiFT
from tts_gateway.engine.cosyvoice2.serving.call_plan import CallPlanner
from tts_gateway.engine.cosyvoice2.serving.calls import Lane, LaunchedCall
from tts_gateway.engine.cosyvoice2.serving.chunking import ChunkJob, ChunkSchedule
from tts_gateway.engine.cosyvoice2.serving.encoder_graphs import EncoderGraphs
from tts_gateway.engine.cosyvoice2.serving.flow_args import batch_args
from tts_gateway.engine.cosyvoice2.serving.flow_graphs import FlowGraphs
from tts_gateway.engine.cosyvoice2.serving.flow_work import FlowWork
from tts_gateway.engine.cosyvoice2.serving.hift_graphs import HiftGraphs
from tts_gateway.engine.cosyvoice2.serving.incremental import FlowStreamCache, inference_chunk
from tts_gateway.engine.cosyvoice2.serving.paged_flow import PagedFlow
from tts_gateway.engine.cosyvoice2.serving.phase_clock import PhaseClock
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import (
    PrefixBank, VoicePrefixCache, flow_after_prefix, solve_after_prefix,
)
from tts_gateway.engine.cosyvoice2.serving.request import StreamState, VoicePrompt
from tts_gateway.engine.cosyvoice2.serving.streaming_vocoder import StreamingVocoder
from tts_gateway.engine.cosyvoice2.serving.uploads import to_device

if TYPE_CHECKING:
    from tts_gateway.engine.cosyvoice2.serving.incremental_encoder import IncrementalEncoder
    from tts_gateway.engine.cosyvoice2.serving.turn_pool import TurnStatePool


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
        # The work as running totals (see work_totals); two worker threads add to them.
        self.flow_work = FlowWork()
        # With a prefix cache, turns may keep their decoder state in a pool: the paged calls.
        self.paged_flow = None
        if turn_state_bytes and self.prefixes is not None:
            self.paged_flow = PagedFlow.within(
                flow, schedule, self.prefixes, turn_state_bytes, flow_steps, self.flow_work
            )
        # The paged flow and the vocoder share the runner's flow, schedule and prefix cache (set once) but hold
        # nothing of the runner: a runner dropped frees its GPU memory (pool, prefix bank, graphs) at once.
        self.vocoder = StreamingVocoder(hift, schedule, self.flow_work)
        # This thread's call in flight: .clock (PhaseClock), .pinned (_pin).
        self._phases = threading.local()

    @property
    def hift(self) -> HiFT:
        """The vocoder's model (``StreamingVocoder`` runs it)."""
        return self.vocoder.hift

    @property
    def turn_pool(self) -> TurnStatePool | None:
        """The paged flow's pool of turns' decoder state (None: no paged flow), which the flow graphs read."""
        return None if self.paged_flow is None else self.paged_flow.pool

    @property
    def token_encoder(self) -> IncrementalEncoder | None:
        """The paged flow's token encoder, each turn's tokens encoded once (None: no paged flow),
        which start-up gives its graphs."""
        return None if self.paged_flow is None else self.paged_flow.token_encoder

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
        stored = self.paged_flow.stored_frames if on_engine_thread and self.paged_flow is not None else None
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
            work = self.flow_work.open_call()  # the call's share of the work totals
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
                self._phases.clock = self._phases.pinned = None
                self.flow_work.close_call()
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
        self.flow_work.book_phases(call.infix, totals)
        audio = call.host.numpy()
        return [chunk.copy() for chunk in np.split(audio, np.cumsum(call.lengths)[:-1])]

    def _run(self, jobs: list[ChunkJob], lane: Lane | None) -> list[torch.Tensor]:
        """``launch`` on the current stream: each job's audio, on the device."""
        vocoder = self.vocoder
        inputs = [vocoder.hift_input(job, mel) for job, mel in zip(jobs, self._flows(jobs, lane))]
        self._lap("flow_other")
        speech, source = vocoder.run(inputs, self.hift_graphs if lane is None else lane.hift_graphs)
        self._lap("vocoder")
        return [self._emit(job, inputs[i][0], speech[i], source[i]) for i, job in enumerate(jobs)]

    def _emit(self, job: ChunkJob, mel: torch.Tensor, speech: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The chunk's audio (``StreamingVocoder.emit``); at the turn's last chunk its stored flow
        state goes at once (``release``)."""
        audio = self.vocoder.emit(job, mel, speech, source)
        if job.finalize:
            self.release(job.request.stream)
        return audio

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

    @torch.inference_mode()
    @timed_as("unpaged")
    def _flow_batched(self, jobs: list[ChunkJob], finalize: bool, lane: Lane | None = None) -> list[torch.Tensor]:
        """Chunks of several utterances in one flow call (each row equals running it alone)."""
        prompts = [job.request.prompt for job in jobs]
        device = prompts[0].speech_feat.device
        args = batch_args(jobs)
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
            self.flow_work.count("lane_calls_after_prefix")
        return slots

    # ------------------------------------------------------------------ turns' stored chunks

    def _paged_serves(self, jobs: list[ChunkJob], lane: Lane | None) -> bool:
        """Whether these jobs run after their voice prefixes and stored chunks (paged_flow.py):
        chunk-causal calls on the engine's own thread (the lane keeps its graphs of whole first
        chunks) whose voices all fit the prefix bank."""
        if self.paged_flow is None or lane is not None or not all(self._streaming(job.finalize) for job in jobs):
            return False
        return self.paged_flow.has_voices(jobs)

    @torch.inference_mode()
    def _flow_paged(self, jobs: list[ChunkJob]) -> list[torch.Tensor]:
        """Chunks that start after their voice prefix and their turn's stored frames, and keep
        the chunks they complete (``PagedFlow.run``): each costs its own frames. Chunks of turns
        the pool has no room for run without it (after their voice prefix), in one call."""
        mels = self.paged_flow.run(jobs, self.flow_graphs, self._lap)
        for finalize, rest in by_finalize([i for i in range(len(jobs)) if i not in mels], jobs):
            mels.update(zip(rest, self._flow_batched([jobs[i] for i in rest], finalize)))
        return [mels[i] for i in range(len(jobs))]

    def call_frames(self, job: ChunkJob) -> int:
        """The frames a job's flow call covers, less what its turn has stored: what it costs."""
        stored = 0 if self.paged_flow is None else self.paged_flow.stored_frames(job)
        return self.schedule.job_frames(job) - stored

    def release(self, state: StreamState) -> None:
        """Free an utterance's stored flow state (decoder and token encoder) at once (it ended
        or was cancelled; no call of it may be running)."""
        state.flow_cache = None
        if self.paged_flow is not None:
            self.paged_flow.release(state)

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
        args = batch_args([job])
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
            self.flow_work.count("encoder_graph_calls")
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

    # ------------------------------------------------------------------ work totals

    def work_totals(self) -> dict[str, float]:
        """The token2wav work so far, as running totals (exported as
        tts_token2wav_<name>_total): the flow's and the vocoder's, ``flow_*`` (``FlowWork``),
        and with a turn-state pool, its ``turn_state_*`` totals too (``TurnStatePool.totals``)."""
        totals = self.flow_work.totals()
        if self.paged_flow is not None:
            totals |= self.paged_flow.totals()
        return totals

    def _count_call(
        self, jobs: list[ChunkJob], widths: list[int], after_prefix: bool, graphs: FlowGraphs | None
    ) -> None:
        """Book one flow call of these jobs, whose rows need ``widths`` decoder frames each."""
        rows, width = len(widths), max(widths)
        streaming = self._streaming(jobs[0].finalize)
        replayed = self.planner.replayed_row_frames(graphs, rows, width, streaming, after_prefix)
        self.flow_work.book(jobs, widths, width, replayed)
