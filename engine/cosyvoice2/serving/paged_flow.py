"""The token2wav runner's paged flow: chunks that start after their voice prefix and their turn's stored chunks.

In ``paged`` mode (the runner's recompute mode with a turn-state pool, runner.py) each turn
keeps its decoder state in a pool while it is generated (turn_pool.py), and its token
encoder's state (incremental_encoder.py): a chunk's decoder work is its own frames, and rows
of any turns batch together. A turn the pool has no room for falls back: it goes on by
recompute after its voice prefix, and comes back once the pool has room for it again.

The runner decides which of its calls are paged (chunk-causal calls on the engine's own
thread whose voices all fit the prefix bank, ``PagedFlow.has_voices``) and runs what a paged
call does not serve (the chunks of turns that fell back) in calls of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tts_gateway.engine.cosyvoice2.model.flow import DecoderInputs, EncodedTokens, Flow
from tts_gateway.engine.cosyvoice2.model.flow_encoder import project_speaker
from tts_gateway.engine.cosyvoice2.serving.chunking import ChunkJob, ChunkSchedule
from tts_gateway.engine.cosyvoice2.serving.flow_args import prompt_args
from tts_gateway.engine.cosyvoice2.serving.flow_graphs import FlowGraphs
from tts_gateway.engine.cosyvoice2.serving.flow_work import FlowWork
from tts_gateway.engine.cosyvoice2.serving.incremental_encoder import EncoderStreamState, IncrementalEncoder
from tts_gateway.engine.cosyvoice2.serving.paged_varlen import attend_reference, flash_attend
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import VoicePrefixCache
from tts_gateway.engine.cosyvoice2.serving.request import StreamState
from tts_gateway.engine.cosyvoice2.serving.turn_pool import (
    PagedAttention, TurnRows, TurnStatePool, flow_paged, solve_paged,
)
from tts_gateway.engine.cosyvoice2.serving.uploads import to_device


def paged_kernel(flow: Flow) -> PagedAttention:
    """The turn pool's attention: vLLM's paged FlashAttention on a GPU (the engine runs on
    vLLM there), the reference by gathers elsewhere."""
    if not flow.decoder.noise.is_cuda:
        return attend_reference
    return flash_attend(flow.decoder.estimator.attention_layers[0].dim)  # the pool keeps layer inputs


class PagedFlow:
    """Paged flow calls of ``flow``'s chunks (``schedule``'s) after their voices' prefixes in
    ``prefixes`` and their turns' stored frames in ``pool``, each turn's tokens encoded once by
    ``token_encoder``. It books its calls in ``work``. Its calls run inside the runner's
    inference mode, each given the ``lap`` that closes the phases of the thread's call in
    flight (``Token2WavRunner._lap``; passed per call, so that the paged flow holds nothing of
    the runner)."""

    def __init__(
        self, flow: Flow, schedule: ChunkSchedule, prefixes: VoicePrefixCache, pool: TurnStatePool,
        token_encoder: IncrementalEncoder, work: FlowWork,
    ) -> None:
        self.flow = flow
        self.schedule = schedule
        self.prefixes = prefixes
        self.pool = pool
        self.token_encoder = token_encoder
        self.work = work

    @classmethod
    def within(
        cls, flow: Flow, schedule: ChunkSchedule, prefixes: VoicePrefixCache, state_bytes: int, steps: int,
        work: FlowWork,
    ) -> PagedFlow:
        """A paged flow whose pool keeps the turns' decoder state of ``steps`` Euler steps in
        ``state_bytes`` (``TurnStatePool.within``)."""
        like = next(flow.parameters())
        pool = TurnStatePool.within(flow.decoder, state_bytes, like, steps, paged_kernel(flow))
        return cls(flow, schedule, prefixes, pool, IncrementalEncoder(flow), work)

    def release(self, state: StreamState) -> None:
        """Free the turn's pages and its token encoder's state (it ended or was cancelled)."""
        state.encoder = None
        if state.turn is not None:
            self.pool.release(state.turn)
            state.turn = None

    def totals(self) -> dict[str, float]:
        """The pool's running totals, as ``turn_state_<name>`` (``TurnStatePool.totals``)."""
        return {f"turn_state_{name}": float(value) for name, value in self.pool.totals().items()}

    def has_voices(self, jobs: list[ChunkJob]) -> bool:
        """Whether the prefix bank holds the voices of all these jobs, whose calls would start
        after them (making room, and building the prefixes of voices new to it)."""
        prompts = {id(job.request.prompt): job.request.prompt for job in jobs}.values()
        if len(prompts) > self.prefixes.capacity:
            return False
        like = next(iter(prompts)).speech_feat
        self.prefixes.make_room(max(self.flow.voice_prefix_frames(p.tokens) for p in prompts), like)
        return self.prefixes.slots(list(prompts)) is not None

    def run(
        self, jobs: list[ChunkJob], graphs: FlowGraphs | None, lap: Callable[[str], None]
    ) -> dict[int, torch.Tensor]:
        """The mel of each of these chunks the pool served, by index: each started after its voice
        prefix and its turn's stored frames, and the chunks it completes are kept (each costs
        its own frames). Chunks of turns the pool has no room for are left out (they fell back).
        ``graphs``: the engine thread's flow graphs; ``lap``: closes a phase of the call in flight."""
        mels: dict[int, torch.Tensor] = {}
        fallen = [i for i, job in enumerate(jobs) if getattr(job.request.stream.turn, "fell_back", False)]
        paged = [i for i in range(len(jobs)) if i not in fallen]
        if paged:
            mels.update((paged[k], mel) for k, mel in self.call([jobs[i] for i in paged], graphs, lap).items())
        # A turn that fell back comes back once the pool has room for it again, one a call (each
        # judged by the pool as the calls before left it), in a paged call of its own: it would
        # widen the others' (all of it after its voice prefix is new there, as on the recompute
        # path). Not for its last chunk: nothing would use what it stored.
        back = next((i for i in fallen if not jobs[i].finalize and self._has_room(jobs[i])), None)
        if back is not None:
            jobs[back].request.stream.turn = None
            served = self.call([jobs[back]], graphs, lap)
            if served:
                mels[back] = served[0]
                self.pool.count_return()
        return mels

    def _has_room(self, job: ChunkJob) -> bool:
        """Whether the pool would take the job's turn now, its pages counted to the job's end
        (its look-ahead included: at most a page more than its call stores)."""
        prefix = self.flow.voice_prefix_frames(job.request.prompt.tokens)
        return self.pool.has_room(prefix, self.schedule.job_frames(job))

    def call(
        self, jobs: list[ChunkJob], graphs: FlowGraphs | None, lap: Callable[[str], None]
    ) -> dict[int, torch.Tensor]:
        """One paged call of these jobs: the mel of each job it served, by index (those it did
        not serve fell back). Its phases: the token encoder's, then the decoder's."""
        slots = [self.prefixes.slot(job.request.prompt) for job in jobs]
        states = [job.request.stream for job in jobs]
        prompt_feat, prompt_feat_len, embedding = prompt_args(jobs)
        lap("flow_other")
        encoded, ends = self._encode_turns(jobs, embedding)
        lap("encoder")
        padded: list[int | None] = []

        def inputs_from(starts: list[int]) -> tuple[DecoderInputs, list[int]]:
            # A row whose encoded frames end before its start has no new frame (as inputs_after gives it).
            row_ends = [max(s, e) for s, e in zip(starts, ends)]
            width = max(e - s for s, e in zip(starts, row_ends))
            start = to_device(starts, torch.long, prompt_feat.device)
            return self.flow.inputs_after(encoded, prompt_feat, prompt_feat_len, start, width), row_ends

        def solve(rows: TurnRows, *inputs: torch.Tensor) -> torch.Tensor:
            mel, replayed = self._solve(graphs, rows, *inputs)
            padded.append(replayed)
            return mel

        result, turns = flow_paged(
            self.flow, self.prefixes.bank, self.pool, slots, [s.turn for s in states], inputs_from,
            keep=[not job.finalize for job in jobs], solve=solve,
        )
        for state, turn in zip(states, turns):
            state.turn = turn
            if turn.fell_back:  # it goes on by recompute: its encoder state serves no later call
                state.encoder = None
        lap("decoder")
        served = [i for i, s in enumerate(result.served) if s]
        if not served:
            return {}
        start, end, mel, replayed = result.start, result.end, result.mel, padded[0]
        self.work.book([jobs[i] for i in served], [end[i] - start[i] for i in served], mel.shape[2], replayed)
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
            self.work.count("encoder_graph_calls")
        speaker = project_speaker(self.flow, embedding)
        return EncodedTokens(out.mu, out.mel_start, out.mel_start + out.mel_len, speaker), out.mel_end

    def _solve(
        self, graphs: FlowGraphs | None, rows: TurnRows, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor,
        cond: torch.Tensor,
    ) -> tuple[torch.Tensor, int | None]:
        """The decoder after the rows' prefixes and stored chunks, and the row-frames its graph
        computed: the engine thread's graph replay (``graphs``) when one exists for the shape,
        else the eager solve (None)."""
        if graphs is not None:
            replayed = graphs.run_paged(rows, mu, mask, spks, cond)
            if replayed is not None:
                return replayed
        return solve_paged(self.flow.decoder, self.prefixes.bank, self.pool, rows, mu, mask, spks, cond), None

    @staticmethod
    def stored_frames(job: ChunkJob) -> int:
        """Decoder frames of the job's turn already stored (its voice prefix aside)."""
        turn = job.request.stream.turn
        return 0 if turn is None else turn.frames
