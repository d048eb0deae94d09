"""Streaming token2wav: speech tokens -> 24 kHz audio, chunk by chunk, for many utterances.

Chunking follows the official CosyVoice2 streaming path:

- a chunk is ``hop`` tokens; it is started once ``hop + pre_lookahead`` tokens past the
  last chunk exist (the look-ahead tokens are context, spoken in the next chunk);
- the first hop is padded so that prompt + first chunk ends on a 25-token boundary
  (the flow's chunk-causal attention works in 25-token chunks); ``first_hop_len`` below
  ``hop_len`` makes it the shortest such hop of at least that many tokens;
- hops may grow (``hop * scale`` up to ``max_hop``, as upstream's ``stream_scale_factor``);
  ``scale = 1`` keeps every hop at 25 tokens, as the reference package does;
- HiFT keeps the last 8 mel frames and the last 8 x 480 source samples of each chunk as
  context for the next, and the last 8 x 480 output samples are held back and
  cross-faded (Hamming window) with the next chunk's first ones; the final chunk
  flushes everything.

The flow runs in one of two exact modes. ``recompute`` is the official one: every chunk
re-runs the flow over prompt + all tokens so far, so chunk k costs O(k). A batch (on a
GPU, of more than one row) starts its decoder after each voice's shared prompt prefix instead
(``Flow.voice_prefix``, kept in a ``PrefixBank`` of ``prefix_voices`` slots for the most
recently used voices): the same mel for less work, since the prompt's whole chunks come out
the same in every call.
``incremental`` keeps the flow's per-chunk state (``Flow.inference_chunk``) and computes
only the new chunk: the same mel within float rounding, at a memory cost per session
(see engine/cosyvoice2/model/flow.py). In both, the final chunk is what the official path
makes it: one flow pass with full attention over prompt + all tokens (the official loop
calls its last chunk without the streaming flag), so the end of a turn costs one
utterance-length pass.

This module is synchronous torch code; the engine runs it on its worker thread and
batches chunks of many utterances (:meth:`Token2Wav.run`).
"""

from __future__ import annotations

import collections
import functools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cosyvoice2.model.flow import Flow, FlowStreamCache, PrefixBank
from engine.cosyvoice2.model.hift import HiFT

if TYPE_CHECKING:
    from engine.cosyvoice2.serving.flow_graphs import FlowGraphs
    from engine.cosyvoice2.serving.hift_graphs import HiftGraphs

MEL_CACHE_FRAMES = 8
# A flow call's cost, in row-frames (rows x context frames: what its compute grows with).
# Measured on the H200 (full size, bf16; docs/cosyvoice2.md): a solve costs ~0.028 ms per
# row-frame, plus ~39 ms per call under a CUDA graph (~1400 row-frames). Run eagerly, the
# kernel launches of its 10 estimator calls take ~375 ms whatever its size (~13 000
# row-frames): the GPU waits on the CPU, and a smaller eager call saves nothing.
CALL_ROW_FRAMES = 1400
EAGER_FLOOR_ROW_FRAMES = 13000
# A call runs to its end, and whatever becomes urgent meanwhile (a new turn's first chunk)
# waits for it: a call of several rows is held to about an eager call's launch floor of
# work (~0.4 s), so eager calls, which cost that anyway, are not split for it.
MAX_CALL_ROW_FRAMES = EAGER_FLOOR_ROW_FRAMES
# Rows of one flow call are padded to its longest context; the worker keeps a much longer,
# not yet due context out of a batch whose padding it would raise by more than this.
PADDING_LIMIT = 1.25


def cheapest_groups(widths: list[int], cost: Callable[[int, int], float]) -> list[list[int]]:
    """Indices of rows of these context widths split into calls, narrowest call first, so
    that the calls' total ``cost(rows, widest row)`` is the least possible.

    Rows are padded to their call's widest, so the best split takes runs of the rows
    sorted by width: an exact dynamic programme over the cut points (quadratic in rows).
    """
    order = sorted(range(len(widths)), key=widths.__getitem__)
    best = [0] * (len(order) + 1)  # best[j]: the cheapest split of the j narrowest rows
    cut = [0] * (len(order) + 1)  # ... whose last call starts at row cut[j]
    for j in range(1, len(order) + 1):
        width = widths[order[j - 1]]
        best[j], cut[j] = min((best[i] + cost(j - i, width), i) for i in range(j))
    groups: list[list[int]] = []
    j = len(order)
    while j:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


@dataclass(frozen=True)
class VoicePrompt:
    """A voice's flow conditioning, on the model's device."""

    speech_tokens: torch.Tensor  # [1, P] int32
    speech_feat: torch.Tensor  # [1, 2P, 80]
    embedding: torch.Tensor  # [1, 192]

    @property
    def tokens(self) -> int:
        return int(self.speech_tokens.shape[1])


@dataclass
class StreamState:
    """One utterance's place in the token stream and its vocoder caches."""

    prompt: VoicePrompt
    tokens: list[int] = field(default_factory=list)
    tokens_done: bool = False  # the LLM stage has produced its last token
    offset: int = 0  # tokens already turned into audio
    hop: int = 0  # current hop (set from the schedule at the first chunk)
    # Where the next regular chunk ends, once an early chunk has taken part of its tokens
    # (None: offset + hop). Regular chunks keep ending where the schedule puts them.
    regular_end: int | None = None
    finished: bool = False
    flow_cache: FlowStreamCache | None = None
    hift_mel: torch.Tensor | None = None  # [1, 80, 8]
    hift_source: torch.Tensor | None = None  # [1, 1, 8 * 480]
    hift_speech: torch.Tensor | None = None  # [1, 8 * 480]


@dataclass(frozen=True)
class ChunkJob:
    state: StreamState
    end: int  # tokens given to the flow: all tokens up to here
    finalize: bool
    advance: int  # tokens this chunk turns into audio
    early: bool = False  # taken before its regular size because the listener is running out

    @property
    def first(self) -> bool:
        """The utterance's first chunk: its listener has no audio yet."""
        return self.state.offset == 0


@dataclass(frozen=True)
class Lane:
    """What a second worker thread runs chunks on while the first runs others: its own CUDA
    stream (of high priority, so that its kernels go first on a busy GPU) and its own CUDA
    graphs (graphs that share a memory pool or static buffers must not replay at the same
    time). It runs without voice prefixes: the bank's slots change on the first thread."""

    stream: torch.cuda.Stream | None = None
    flow_graphs: FlowGraphs | None = None
    hift_graphs: HiftGraphs | None = None


def call_kind(jobs) -> str:
    """A flow call's kind, by its chunks (a call holds one kind, see ``Token2Wav.plan``):
    ``final`` (full attention over the whole turn), ``first`` (no audio out yet), ``later``."""
    return "final" if jobs[0].finalize else "first" if all(job.first for job in jobs) else "later"


def _own_graphs(lane: Lane | None) -> FlowGraphs | None:
    """The flow graphs a call passes to the flow: a lane's own, or None for the decoder's."""
    return lane.flow_graphs if lane is not None else None


class Token2Wav:
    def __init__(
        self,
        flow: Flow,
        hift: HiFT,
        *,
        hop_len: int = 25,
        max_hop_len: int = 100,
        scale: int = 1,
        incremental: bool = True,
        first_hop_len: int | None = None,
        first_by_load: bool = False,
        second_on_lane: bool = False,
        prefix_voices: int = 0,
    ) -> None:
        if hop_len < 1 or max_hop_len < hop_len or scale < 1:
            raise ValueError("need 1 <= hop_len <= max_hop_len and scale >= 1")
        self.flow = flow
        self.hift = hift
        self.hop_len = hop_len
        self.first_hop_len = hop_len if first_hop_len is None else first_hop_len
        # The worker may lengthen a short first chunk to the official one (lengthen_first_chunk):
        # both first chunks then get their shapes (first_hops).
        self.first_by_load = first_by_load
        # The first-chunk lane also runs the chunk after a short first chunk (opens_turn).
        self.second_on_lane = second_on_lane
        self.max_hop_len = max_hop_len
        self.scale = scale
        self.incremental = incremental
        self.lookahead = flow.config.pre_lookahead_len
        self.mel_ratio = flow.config.token_mel_ratio
        self.samples_per_frame = hift.samples_per_frame
        self.cache_samples = MEL_CACHE_FRAMES * self.samples_per_frame
        self._window = torch.from_numpy(np.hamming(2 * self.cache_samples))
        # The flow's chunk-causal attention works in blocks of this many tokens.
        self.chunk_tokens = flow.config.encoder.static_chunk_size
        # Optional CUDA graphs of the vocoder (engine/cosyvoice2/serving/hift_graphs.py), set by the engine.
        self.hift_graphs = None
        # Voice prefixes of the decoder in a bank of prefix_voices slots (see the module docstring);
        # recompute mode only: incremental streams keep their own flow state.
        self.prefix_voices = 0 if incremental else prefix_voices
        self.bank: PrefixBank | None = None
        self._bank_fixed = False
        # Voice -> its bank slot, most recently used last (the prompt too: its id stays its own while held).
        self._slots: OrderedDict[int, tuple[VoicePrompt, int]] = OrderedDict()
        # The flow's work as running totals (see work_totals); two worker threads add to them.
        self._work: collections.Counter[str] = collections.Counter()
        self._work_lock = threading.Lock()

    def work_totals(self) -> dict[str, float]:
        """The flow's work so far, as running totals (recompute mode; exported as
        tts_token2wav_<name>_total): ``flow_calls``, of which ``flow_eager_calls`` had no CUDA
        graph; ``flow_row_frames_{first,later,final}``, the mel frames the decoder had to
        compute for each kind of chunk (rows x their own widths: what the work grows with);
        ``flow_padded_row_frames``, what it computed (rows and frames padded to the call's
        widest row, or to its graph's bucket). Padded / needed is the share spent on padding."""
        with self._work_lock:
            return {f"flow_{name}": float(value) for name, value in self._work.items()}

    def _count_call(self, jobs: list[ChunkJob], widths: list[int], after_prefix: bool, graphs: FlowGraphs | None) -> None:
        """Book one flow call of these jobs, whose rows need ``widths`` decoder frames each."""
        finalize = jobs[0].finalize
        rows, width = len(widths), max(widths)
        replayed = self._replayed_row_frames(graphs, rows, width, not finalize, after_prefix)
        padded = rows * width if replayed is None else replayed
        kind = call_kind(jobs)
        with self._work_lock:
            work = self._work
            work["calls"] += 1
            work["eager_calls"] += replayed is None
            work[f"row_frames_{kind}"] += sum(widths)
            work["padded_row_frames"] += padded

    def new_stream(self, prompt: VoicePrompt) -> StreamState:
        return StreamState(prompt=prompt, hop=self.hop_len, flow_cache=FlowStreamCache() if self.incremental else None)

    def first_hop(self, prompt_tokens: int, least: int | None = None) -> int:
        """The first chunk's hop: the shortest >= ``least`` (first_hop_len) that ends prompt +
        chunk on a chunk boundary (at least hop_len: the official hop + padding to the boundary)."""
        chunk = self.chunk_tokens
        least = self.first_hop_len if least is None else least
        return math.ceil((prompt_tokens + least) / chunk) * chunk - prompt_tokens

    def first_hops(self, prompt_tokens: int) -> list[int]:
        """The first chunks a voice's streams may start with: the short one (first_hop_len),
        and with ``first_by_load`` the official one too, if longer."""
        hops = [self.first_hop(prompt_tokens)]
        official = self.first_hop(prompt_tokens, self.hop_len)
        return hops + [official] if self.first_by_load and official > hops[0] else hops

    def first_chunk_widths(self, prompt_tokens: int) -> list[int]:
        """The decoder's widths for first chunks run whole: prompt + first hop, in mel frames."""
        return [self.mel_ratio * (prompt_tokens + hop) for hop in self.first_hops(prompt_tokens)]

    def first_chunk_shapes(self, prompt_tokens: int) -> list[tuple[int, int]]:
        """The vocoder input shapes (mel frames, cached excitation samples) of first chunks."""
        return [(self.mel_ratio * hop, 0) for hop in self.first_hops(prompt_tokens)]

    def _short_first_hop(self, prompt_tokens: int) -> int | None:
        """The first chunk's hop when it is shorter than a regular hop and the lane runs the
        chunk after it (``second_on_lane``); else None."""
        first = self.first_hop(prompt_tokens)
        return first if self.second_on_lane and first < self.hop_len else None

    def opens_turn(self, job: ChunkJob) -> bool:
        """Whether the job is one of its turn's opening chunks, those the first-chunk lane runs:
        the first chunk, and with ``second_on_lane`` after a short first chunk the regular
        chunk after it (its listener then holds a fraction of a second of audio)."""
        if job.finalize or job.early:
            return False
        return job.first or job.state.offset == self._short_first_hop(job.state.prompt.tokens)

    def lane_widths(self, prompt_tokens: int) -> list[int]:
        """The decoder's widths of a voice's opening chunks (``opens_turn``), run whole:
        prompt + tokens to the chunk's end, in mel frames."""
        widths = self.first_chunk_widths(prompt_tokens)
        short = self._short_first_hop(prompt_tokens)
        return widths if short is None else widths + [self.mel_ratio * (prompt_tokens + short + self.hop_len)]

    def lane_shapes(self, prompt_tokens: int) -> list[tuple[int, int]]:
        """The vocoder input shapes of a voice's opening chunks (``opens_turn``)."""
        shapes = self.first_chunk_shapes(prompt_tokens)
        if self._short_first_hop(prompt_tokens) is None:
            return shapes
        return shapes + [(MEL_CACHE_FRAMES + self.mel_ratio * self.hop_len, self.cache_samples)]

    def lengthen_first_chunk(self, state: StreamState) -> bool:
        """Make a stream that has not spoken yet start with the official first chunk instead
        of the short one; False if its first chunk is that long already."""
        official = self.first_hop(state.prompt.tokens, self.hop_len)
        if state.offset > 0 or official <= self._regular_end(state):
            return False
        state.regular_end = official
        return True

    def first_chunk_playable_s(self, state: StreamState) -> float:
        """Seconds a stream's listener can play of its short first chunk: its tokens, less the
        tail held back for the cross-fade with the next chunk."""
        samples = self.first_hop(state.prompt.tokens) * self.mel_ratio * self.samples_per_frame - self.cache_samples
        return samples / self.hift.config.sampling_rate

    def chunk_shapes(self, prompt_tokens: int) -> list[tuple[int, int]]:
        """The vocoder input shapes (mel frames, cached excitation samples) of a voice's
        non-final chunks: its first chunks, then each hop of the schedule behind the cached frames."""
        shapes = self.first_chunk_shapes(prompt_tokens)
        hop = self.hop_len
        while True:
            shapes.append((MEL_CACHE_FRAMES + self.mel_ratio * hop, self.cache_samples))
            if self._grown(hop) == hop:
                return shapes
            hop = self._grown(hop)

    def _grown(self, hop: int) -> int:
        """The hop after a regular chunk of this hop (upstream's stream_scale_factor rule)."""
        return min(self.max_hop_len, hop * self.scale)

    def next_job(self, state: StreamState, early: bool = False) -> ChunkJob | None:
        """The chunk this utterance can run now, if any.

        Regular chunks follow the official streaming rule. ``early``: the listener is about
        to run out of audio, so if a regular chunk is not ready yet, every token that has
        its look-ahead (at least ``first_hop_len`` of them) is spoken now; the regular chunk
        after it still ends where the schedule put it. Text streamed at LLM speed makes
        speech tokens arrive just about in real time, and the first chunk is short: without
        this, the listener would wait for the second chunk's 25 tokens.
        """
        if state.finished:
            return None
        end = self._regular_end(state)
        available = len(state.tokens) - state.offset
        if len(state.tokens) >= end + self.lookahead:
            return ChunkJob(state, end + self.lookahead, False, end - state.offset)
        if state.tokens_done:
            if not state.tokens:  # nothing was generated: nothing to say
                state.finished = True
                return None
            return ChunkJob(state, len(state.tokens), True, available)
        spoken = available - self.lookahead
        if early and state.offset > 0 and spoken >= self.first_hop_len:
            return ChunkJob(state, len(state.tokens), False, spoken, early=True)
        return None

    def _regular_end(self, state: StreamState) -> int:
        if state.regular_end is not None:
            return state.regular_end
        return state.offset + (self.first_hop(state.prompt.tokens) if state.offset == 0 else state.hop)

    def job_frames(self, job: ChunkJob) -> int:
        """Mel frames the job's flow call covers (prompt + all its tokens): its batch cost."""
        return self.mel_ratio * (job.state.prompt.tokens + job.end)

    # ------------------------------------------------------------------ running chunks

    @torch.inference_mode()
    def run(self, jobs: list[ChunkJob], lane: Lane | None = None) -> list[np.ndarray]:
        """Run chunks of several utterances; returns each one's new audio (float32, 24 kHz).

        In recompute mode the flow runs once for all non-final chunks (rows padded to the
        longest; each row equals running it alone), and once for all final chunks;
        incremental non-final chunks run per utterance (each holds its own state). HiFT runs once
        for every group of chunks of the same shape, which in steady state is all of them
        (cached 8 frames + one hop). ``lane``: run on a second thread's stream and graphs
        (None: the engine's own).
        """
        with torch.cuda.stream(lane.stream if lane is not None else None):
            inputs = [self._hift_input(job, mel) for job, mel in zip(jobs, self._flows(jobs, lane))]
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
            return [self._emit(job, inputs[i][0], speech[i], source[i]) for i, job in enumerate(jobs)]

    def _vocode(
        self, mel: torch.Tensor, cache_source: torch.Tensor, lane: Lane | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        graphs = self.hift_graphs if lane is None else lane.hift_graphs
        if graphs is not None:
            replayed = graphs.run(mel, cache_source)
            if replayed is not None:
                return replayed
        return self.hift(mel, cache_source)

    def lane_serves(self, job: ChunkJob, lane: Lane) -> bool:
        """Whether ``lane`` runs this job: one of its turn's opening chunks (``opens_turn``) that
        the lane has a flow graph for, run alone (its graphs cover the voices registered at
        start-up; without graphs, as on a CPU, it runs every opening chunk)."""
        if not self.opens_turn(job):
            return False
        graphs = lane.flow_graphs
        return graphs is None or graphs.has(1, self._decoder_width(self.job_frames(job), job.finalize), True)

    def _flow_graphs(self, lane: Lane | None) -> FlowGraphs | None:
        """The flow graphs a call on this lane replays (None: the engine's own thread)."""
        return self.flow.decoder.graphs if lane is None else lane.flow_graphs

    def plan(self, jobs: list[ChunkJob], lane: Lane | None = None) -> list[list[int]]:
        """Indices of ``jobs`` in flow calls, in the order to run them.

        Non-final recompute chunks and final chunks (full attention) go in separate calls,
        and so do first chunks (no audio out yet) and later ones: a new turn's first chunk
        must not wait for a long turn's call, which a single row's padding would otherwise
        often make the cheaper choice. Each such kind is split into the calls that cost least
        in all (see ``cheapest_groups``), none of several rows above ``MAX_CALL_ROW_FRAMES``.
        Calls of first chunks run first, then the rest, narrowest first; incremental chunks,
        which run one by one, go together. ``lane``: the calls run there (see ``run``).
        """
        kinds: dict[tuple[bool, bool], list[int]] = {}
        incremental = []
        for i, job in enumerate(jobs):
            if not job.finalize and job.state.flow_cache is not None:
                incremental.append(i)
            else:
                kinds.setdefault((job.finalize, job.first), []).append(i)
        groups = [incremental] if incremental else []
        # The shortest prefix in the bank: what a call after the prefixes saves at least.
        prefix = min((self.flow.voice_prefix_frames(p.tokens) for p, _ in self._slots.values()), default=None)
        graphs = self._flow_graphs(lane)
        for (finalize, _), rows in kinds.items():
            widths = [self.job_frames(jobs[i]) for i in rows]
            cost = functools.partial(
                self._call_cost, finalize=finalize, prefix=prefix if lane is None else None, graphs=graphs
            )
            groups += [[rows[k] for k in group] for group in cheapest_groups(widths, cost)]
        return sorted(groups, key=lambda group: (
            not any(jobs[i].first for i in group), max(self.job_frames(jobs[i]) for i in group)
        ))

    def _call_cost(
        self, rows: int, frames: int, finalize: bool, prefix: int | None, graphs: FlowGraphs | None
    ) -> float:
        """A flow call's cost in row-frames (see ``CALL_ROW_FRAMES``) for ``rows`` contexts of
        up to ``frames``, infinite for a call of several rows above ``MAX_CALL_ROW_FRAMES``;
        ``prefix``: the frames a call after the voice prefixes starts at (None: none);
        ``graphs``: the flow graphs the call would replay. A graph computes its bucket's rows
        and frames: on a GPU that padding is work too (batch buckets 1, 2, 4, 8, ... pad five
        rows to eight), so a call that replays one costs its bucket's row-frames."""
        width = self._decoder_width(frames, finalize)
        whole = self._replayed_row_frames(graphs, rows, width, not finalize)
        after_prefix = not finalize and prefix is not None and whole is None  # as _flow_batched decides
        cost = CALL_ROW_FRAMES + rows * (frames - prefix if after_prefix else frames)
        if rows > 1 and cost > MAX_CALL_ROW_FRAMES:
            return math.inf
        if not self._on_gpu:  # no launch floor, no graphs
            return cost
        if whole is not None:
            return CALL_ROW_FRAMES + whole
        if after_prefix:
            after = self._replayed_row_frames(graphs, rows, width - prefix, True, after_prefix=True)
            if after is not None:
                return CALL_ROW_FRAMES + after
        return max(EAGER_FLOOR_ROW_FRAMES, cost)

    @property
    def _on_gpu(self) -> bool:
        return self.flow.decoder.noise.is_cuda

    def _replayed_row_frames(
        self, graphs: FlowGraphs | None, rows: int, width: int, streaming: bool, after_prefix: bool = False
    ) -> int | None:
        """The rows x frames a call of this shape computes when it replays one of ``graphs``
        (its bucket's, padding included); None when it runs eagerly (no graph, or a CPU)."""
        if graphs is None or not self._on_gpu or not graphs.has(rows, width, streaming, after_prefix):
            return None
        return graphs.buckets.key(rows, width, streaming, after_prefix).row_frames

    def _decoder_width(self, frames: int, finalize: bool) -> int:
        """The decoder's width for a call of this context: the look-ahead tokens are context only."""
        return frames - (0 if finalize else self.mel_ratio * self.lookahead)

    def _flows(self, jobs: list[ChunkJob], lane: Lane | None = None) -> list[torch.Tensor]:
        """Each job's new mel: batched flow calls as ``plan`` splits them; incremental chunks,
        and single rows without a voice prefix to use, run one by one."""
        mels: dict[int, torch.Tensor] = {}
        for group in self.plan(jobs, lane):
            finalize = jobs[group[0]].finalize
            if jobs[group[0]].state.flow_cache is not None and not finalize:
                continue
            if len(group) > 1 or (not finalize and self.prefix_voices and lane is None):
                mels.update(zip(group, self._flow_batched([jobs[i] for i in group], finalize, lane)))
        return [mels[i] if i in mels else self._flow(job, lane) for i, job in enumerate(jobs)]

    def _flow_batched(self, jobs: list[ChunkJob], finalize: bool, lane: Lane | None = None) -> list[torch.Tensor]:
        """Chunks of several utterances in one flow call (each row equals running it alone)."""
        prompts = [job.state.prompt for job in jobs]
        device = prompts[0].speech_feat.device

        def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            lengths = torch.tensor([len(row) for row in rows], dtype=torch.int32, device=device)
            return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), lengths

        token, token_len = padded(
            [torch.tensor(job.state.tokens[: job.end], dtype=torch.int32, device=device) for job in jobs]
        )
        prompt_token, prompt_token_len = padded([p.speech_tokens[0] for p in prompts])
        prompt_feat, prompt_feat_len = padded([p.speech_feat[0] for p in prompts])
        embedding = torch.cat([p.embedding for p in prompts])
        after_prefix = None
        # More voices than the bank holds would rebuild prefixes batch after batch. Asked
        # first whether a prefix serves: taking a slot may build a voice's prefix.
        if (
            lane is None and not finalize and 0 < len({id(p) for p in prompts}) <= self.prefix_voices
            and self._prefix_serves(jobs)
        ):
            self._make_room(max(self.flow.voice_prefix_frames(p.tokens) for p in prompts), prompts[0].speech_feat)
            slots = [self._voice_slot(p) for p in prompts]
            if None not in slots:
                after_prefix = (self.bank, torch.tensor(slots, device=device))
        widths = [self._decoder_width(self.job_frames(job), finalize) for job in jobs]
        if after_prefix is not None:
            widths = [w - self.flow.voice_prefix_frames(p.tokens) for w, p in zip(widths, prompts)]
        graphs = self._flow_graphs(lane)
        self._count_call(jobs, widths, after_prefix is not None, graphs)
        mel, new_len = self.flow.inference_batch(
            token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, embedding,
            streaming=not finalize, finalize=finalize, after_prefix=after_prefix, graphs=_own_graphs(lane),
        )
        return [
            mel[i : i + 1, :, job.state.offset * self.mel_ratio : int(new_len[i])] for i, job in enumerate(jobs)
        ]

    def _prefix_serves(self, jobs: list[ChunkJob]) -> bool:
        """Whether these non-final jobs start after their voice prefixes: unless a graph of the
        whole solve serves them (the engine captures those for one row only: a one-row replay
        is latency-bound, and the prefix's extra gathers cost more than its frames save)."""
        graphs = self.flow.decoder.graphs
        width = self._decoder_width(max(map(self.job_frames, jobs)), False)
        return graphs is None or not graphs.has(len(jobs), width, True)

    def prepare_voices(self, prompts: list[VoicePrompt], widest_prompt_tokens: int) -> PrefixBank | None:
        """At start-up: the bank, as wide as the prefix of a prompt of ``widest_prompt_tokens``
        (the longest of the registered voices), holding the first voices' prefixes. CUDA graphs
        of the flow read the bank, so its width is fixed from here on: capture them after
        this; a voice registered later with a longer prompt runs without its prefix."""
        if not self.prefix_voices:
            return None
        self._make_room(self.flow.voice_prefix_frames(widest_prompt_tokens), next(self.flow.parameters()))
        self._bank_fixed = True
        for prompt in prompts[: self.prefix_voices]:
            self._voice_slot(prompt)
        return self.bank

    def _make_room(self, frames: int, like: torch.Tensor) -> None:
        """A bank at least ``frames`` wide, unless its width is fixed (``prepare_voices``)."""
        if self.bank is None or (frames > self.bank.frames and not self._bank_fixed):
            self.bank = PrefixBank(self.flow.decoder, self.prefix_voices, frames, like)
            self._slots.clear()

    def _voice_slot(self, prompt: VoicePrompt) -> int | None:
        """The voice's slot in the bank, its prefix built on first use in place of the least
        recently used voice's; None when its prefix is wider than the bank."""
        key = id(prompt)
        if key in self._slots:
            self._slots.move_to_end(key)
            return self._slots[key][1]
        if self.flow.voice_prefix_frames(prompt.tokens) > self.bank.frames:
            return None
        if len(self._slots) < self.prefix_voices:
            slot = len(self._slots)
        else:
            _, (_, slot) = self._slots.popitem(last=False)
        self.bank.put(slot, self.flow.voice_prefix(prompt.speech_tokens, prompt.speech_feat, prompt.embedding))
        self._slots[key] = (prompt, slot)
        return slot

    def _flow(self, job: ChunkJob, lane: Lane | None = None) -> torch.Tensor:
        state, prompt = job.state, job.state.prompt
        device = prompt.speech_feat.device
        token = torch.tensor([state.tokens[: job.end]], dtype=torch.int32, device=device)
        args = (
            token,
            torch.tensor([token.shape[1]], dtype=torch.int32, device=device),
            prompt.speech_tokens,
            torch.tensor([prompt.tokens], dtype=torch.int32, device=device),
            prompt.speech_feat,
            torch.tensor([prompt.speech_feat.shape[1]], dtype=torch.int32, device=device),
            prompt.embedding,
        )
        if state.flow_cache is None or job.finalize:
            width = self._decoder_width(self.job_frames(job), job.finalize)
            self._count_call([job], [width], False, self._flow_graphs(lane))
        if job.finalize:
            # The official path speaks the last chunk with full (not chunk-causal) attention
            # over prompt + all tokens: one pass that costs O(utterance), once.
            mel = self.flow.inference(*args, streaming=False, finalize=True, graphs=_own_graphs(lane))
        elif state.flow_cache is not None:
            mel, _ = self.flow.inference_chunk(state.flow_cache, *args, finalize=False)
            return mel
        else:
            mel = self.flow.inference(*args, streaming=True, finalize=False, graphs=_own_graphs(lane))
        return mel[:, :, state.offset * self.mel_ratio :]

    def _hift_input(self, job: ChunkJob, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's mel behind the cached frames of the last chunk, and the cached source."""
        state = job.state
        mel = mel.to(self._hift_dtype)
        if state.hift_mel is None:
            return mel, mel.new_zeros(1, 1, 0)
        return torch.cat([state.hift_mel, mel], dim=2), state.hift_source

    def _emit(self, job: ChunkJob, mel: torch.Tensor, speech: torch.Tensor, source: torch.Tensor) -> np.ndarray:
        state = job.state
        if state.hift_speech is not None:
            speech = self._cross_fade(speech, state.hift_speech)
        if job.finalize:
            state.finished = True
            state.hift_mel = state.hift_source = state.hift_speech = None
            state.flow_cache = None  # frees the flow's per-chunk state at once
        else:
            state.hift_mel = mel[:, :, -MEL_CACHE_FRAMES:]
            state.hift_source = source[:, :, -self.cache_samples :]
            state.hift_speech = speech[:, -self.cache_samples :]
            speech = speech[:, : -self.cache_samples]
            if job.early:
                state.regular_end = self._regular_end(state)
            else:
                state.regular_end = None
                # A first chunk shorter than the hop is one more chunk in front of the official
                # schedule (earlier first audio): the schedule's hops start after it, so the
                # listener's next chunk is one hop away, not a grown hop.
                if not (job.first and job.advance < self.hop_len):
                    state.hop = self._grown(state.hop)
        state.offset += job.advance
        return speech[0].float().cpu().numpy()

    @property
    def _hift_dtype(self) -> torch.dtype:
        return next(self.hift.parameters()).dtype

    def _cross_fade(self, speech: torch.Tensor, previous_tail: torch.Tensor) -> torch.Tensor:
        """Blend the held-back tail of the last chunk into the start of this one."""
        n = self.cache_samples
        if self._window.device != speech.device:  # once: a copy per chunk would wait for the GPU
            self._window = self._window.to(speech.device)
        window = self._window
        head = speech[:, :n].double() * window[:n] + previous_tail.double() * window[n:]
        return torch.cat([head.to(speech.dtype), speech[:, n:]], dim=1)
