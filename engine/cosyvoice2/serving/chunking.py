"""Chunk planning: which speech tokens an utterance's next audio chunk covers.

Chunking follows the official CosyVoice2 streaming path:

- a chunk is ``hop`` tokens; it is started once ``hop + pre_lookahead`` tokens past the
  last chunk exist (the look-ahead tokens are context, spoken in the next chunk);
- the first hop is padded so that prompt + first chunk ends on a 25-token boundary
  (the flow's chunk-causal attention works in 25-token chunks); ``first_hop_len`` below
  ``hop_len`` makes it the shortest such hop of at least that many tokens;
- hops may grow (``hop * scale`` up to ``max_hop``, as upstream's ``stream_scale_factor``);
  ``scale = 1`` keeps every hop at 25 tokens, as the reference package does;
- the vocoder keeps the last 8 mel frames of each chunk as context for the next, and the
  last 8 x 480 output samples are held back and cross-faded with the next chunk's first
  ones (streaming_vocoder.py); the final chunk flushes everything.

Beyond the official rule: a listener about to run out of audio may get the tokens there
are as an *early* chunk (``next_job(early=True)``), and the first-chunk lane runs a turn's
*opening* chunks (``opens_turn``). The shapes these chunks give the flow and the vocoder
are known per voice ahead of time, so CUDA graphs are captured for them at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tts_gateway.engine.cosyvoice2.serving.request import Request, RequestStatus

# Mel frames of each chunk the vocoder keeps as context for the next (and 8 x 480 samples
# of its excitation and output).
MEL_CACHE_FRAMES = 8


@dataclass(frozen=True)
class ChunkJob:
    request: Request
    end: int  # tokens given to the flow: all tokens up to here
    finalize: bool
    advance: int  # tokens this chunk turns into audio
    early: bool = False  # taken before its regular size because the listener is running out

    @property
    def first(self) -> bool:
        """The utterance's first chunk: its listener has no audio yet."""
        return self.request.stream.offset == 0


def call_kind(jobs) -> str:
    """A flow call's kind: ``final`` when all its chunks are their turns' last, else ``first``
    when all are first (no audio out yet; some may be last too, of one-chunk turns), else
    ``later``. A call mixes last chunks with the others only after the turns' stored frames
    (``call_plan.plan``)."""
    if all(job.finalize for job in jobs):
        return "final"
    return "first" if all(job.first for job in jobs) else "later"


@dataclass(frozen=True)
class ChunkSchedule:
    """The chunking rules of one engine, from its settings and the model's chunk sizes.

    ``lookahead``: the flow's pre-look-ahead tokens; ``chunk_tokens``: its attention chunk;
    ``mel_ratio``: mel frames per token; ``samples_per_frame`` and ``sample_rate``: the
    vocoder's. ``first_by_load``: the scheduler may lengthen a short first chunk to the
    official one (``lengthen_first_chunk``), so both first chunks get their shapes.
    ``second_on_lane``: the first-chunk lane also runs the chunk after a short first chunk.
    """

    hop_len: int
    max_hop_len: int
    scale: int
    first_hop_len: int
    lookahead: int
    chunk_tokens: int
    mel_ratio: int
    samples_per_frame: int
    sample_rate: int
    first_by_load: bool = False
    second_on_lane: bool = False

    def __post_init__(self) -> None:
        if self.hop_len < 1 or self.max_hop_len < self.hop_len or self.scale < 1:
            raise ValueError("need 1 <= hop_len <= max_hop_len and scale >= 1")

    @property
    def cache_samples(self) -> int:
        """Output samples held back from each chunk for the cross-fade (and excitation kept)."""
        return MEL_CACHE_FRAMES * self.samples_per_frame

    # ------------------------------------------------------------------ the next chunk

    def next_job(self, request: Request, early: bool = False) -> ChunkJob | None:
        """The chunk this utterance can run now, if any.

        Regular chunks follow the official streaming rule. ``early``: the listener is about
        to run out of audio, so if a regular chunk is not ready yet, every token that has
        its look-ahead (at least ``first_hop_len`` of them) is spoken now; the regular chunk
        after it still ends where the schedule put it. Text streamed at LLM speed makes
        speech tokens arrive just about in real time, and the first chunk is short: without
        this, the listener would wait for the second chunk's 25 tokens.
        """
        status, tokens, state = request.status, request.tokens, request.stream
        if status.ended or (
            status is RequestStatus.TOKENS_DONE and state.offset == len(tokens) and state.hift_speech is None
        ):
            return None  # every token is spoken and nothing is held back (or none was generated)
        end = self._regular_end(request)
        available = len(tokens) - state.offset
        if len(tokens) >= end + self.lookahead:
            return ChunkJob(request, end + self.lookahead, False, end - state.offset)
        if status is RequestStatus.TOKENS_DONE:
            return ChunkJob(request, len(tokens), True, available)
        spoken = available - self.lookahead
        if early and state.offset > 0 and spoken >= self.first_hop_len:
            return ChunkJob(request, len(tokens), False, spoken, early=True)
        return None

    def spoken(self, job: ChunkJob) -> None:
        """Move the utterance's place in its tokens past a chunk that ran."""
        state = job.request.stream
        if not job.finalize:
            if job.early:
                state.regular_end = self._regular_end(job.request)
            else:
                state.regular_end = None
                # A first chunk shorter than the hop is one more chunk in front of the official
                # schedule (earlier first audio): the schedule's hops start after it, so the
                # listener's next chunk is one hop away, not a grown hop.
                if not (job.first and job.advance < self.hop_len):
                    state.hop = self._grown(state.hop)
        state.offset += job.advance

    def job_frames(self, job: ChunkJob) -> int:
        """Mel frames the job's flow call covers (prompt + all its tokens): its batch cost."""
        return self.mel_ratio * (job.request.prompt.tokens + job.end)

    def _regular_end(self, request: Request) -> int:
        state = request.stream
        if state.regular_end is not None:
            return state.regular_end
        return state.offset + (self.first_hop(request.prompt.tokens) if state.offset == 0 else state.hop)

    def _grown(self, hop: int) -> int:
        """The hop after a regular chunk of this hop (upstream's stream_scale_factor rule)."""
        return min(self.max_hop_len, hop * self.scale)

    # ------------------------------------------------------------------ first chunks

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

    def lengthen_first_chunk(self, request: Request) -> bool:
        """Make a stream that has not spoken yet start with the official first chunk instead
        of the short one; False if its first chunk is that long already."""
        official = self.first_hop(request.prompt.tokens, self.hop_len)
        if request.stream.offset > 0 or official <= self._regular_end(request):
            return False
        request.stream.regular_end = official
        return True

    def first_chunk_playable_s(self, request: Request) -> float:
        """Seconds a stream's listener can play of its short first chunk: its tokens, less the
        tail held back for the cross-fade with the next chunk."""
        samples = self.first_hop(request.prompt.tokens) * self.mel_ratio * self.samples_per_frame - self.cache_samples
        return samples / self.sample_rate

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
        return job.first or job.request.stream.offset == self._short_first_hop(job.request.prompt.tokens)

    # ------------------------------------------------------------------ shapes (CUDA graphs)

    def first_chunk_widths(self, prompt_tokens: int) -> list[int]:
        """The decoder's widths for first chunks run whole: prompt + first hop, in mel frames."""
        return [self.mel_ratio * (prompt_tokens + hop) for hop in self.first_hops(prompt_tokens)]

    def first_chunk_shapes(self, prompt_tokens: int) -> list[tuple[int, int]]:
        """The vocoder input shapes (mel frames, cached excitation samples) of first chunks."""
        return [(self.mel_ratio * hop, 0) for hop in self.first_hops(prompt_tokens)]

    def chunk_shapes(self, prompt_tokens: int) -> list[tuple[int, int]]:
        """The vocoder input shapes (mel frames, cached excitation samples) of a voice's
        non-final chunks: its first chunks, then each hop of the schedule behind the cached frames."""
        behind = [(MEL_CACHE_FRAMES + self.mel_ratio * hop, self.cache_samples) for hop in self._hops()]
        return self.first_chunk_shapes(prompt_tokens) + behind

    def _hops(self) -> list[int]:
        """The regular hops after the first chunk, as they grow (upstream's rule) to their last."""
        hops = [self.hop_len]
        while self._grown(hops[-1]) != hops[-1]:
            hops.append(self._grown(hops[-1]))
        return hops

    def tail_shapes(self, prompt_tokens: int) -> list[tuple[int, int]]:
        """The vocoder input shapes of a voice's chunks whose length the token stream decides, less
        ``chunk_shapes``: last chunks (fewer tokens than a hop and its look-ahead, behind the
        cached frames; a turn's only chunk without them), early chunks and the rest of the hop
        after one (fewer than a hop). A non-final chunk leaves its look-ahead tokens, so a last
        chunk has at least one token while there is a look-ahead."""
        behind = {
            (MEL_CACHE_FRAMES + self.mel_ratio * tokens, self.cache_samples)
            for tokens in range(1, self._hops()[-1] + self.lookahead)
        }
        longest_alone = max(self.first_hops(prompt_tokens)) + self.lookahead - 1
        alone = {(self.mel_ratio * tokens, 0) for tokens in range(1, longest_alone + 1)}
        return sorted((behind | alone) - set(self.chunk_shapes(prompt_tokens)))

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
