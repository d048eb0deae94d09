"""Incremental token encoding: each utterance keeps its flow encoder's state, so a chunk
encodes only its own tokens (and their look-ahead), not the whole turn again.

Why it is exact is the encoder's chunk-causality (engine/cosyvoice2/model/flow_encoder.py):
a complete 25-token chunk depends only on tokens up to its end (+3 look-ahead). So per
utterance this keeps, for the complete chunks, each attention layer's keys and values, the
look-ahead conv's last 2 conv1 activations and the first stack's last 2 outputs (the
upsampling conv's left context); a step encodes only the tokens after the last complete
chunk and gives the frames of the full re-run to <= 2.5e-6. What still grows with the chunk
index k is attention over the cached frames (and copying the caches into a batch); the
positional projections come from tables kept per model (``PositionTables``); the caches are
copied into a batch a group of sessions at a time (``ENCODER_PASS_ELEMENTS``). Full size, one
thread of a busy 2-core CPU: chunks 2, 12, 24 take 0.10, 0.13, 0.23 s incrementally against
0.16, 1.9, 5.6 s for the full re-run. The decoder's side is serving/incremental.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.flow_encoder import (
    EncoderCache,
    EncoderOutput,
    Parts,
    PositionTables,
    Upsample1D,
    UpsampleConformerEncoder,
    embed_tokens,
    project_frames,
    token_encoder_part,
)
from tts_gateway.engine.cosyvoice2.serving.uploads import to_device


class EncoderPass(Protocol):
    """What runs a step's encoder pass instead of the eager one where it can (the paged calls'
    CUDA graphs, incremental_encoder_graphs.py): the pass's output and mu, or None."""

    def run(
        self, states: Sequence[EncoderStreamState], ids: Tensor, lengths: Tensor, encoded: Tensor, counts: list[int]
    ) -> tuple[EncoderOutput, Tensor] | None: ...


@dataclass
class EncoderStreamState:
    """One session's incremental encode: the cache of its complete chunks.

    Tensors are replaced, never modified in place, so ``fork`` can share them (e.g.
    encode a voice's prompt once and fork the state for every utterance).
    """

    committed: int = 0  # tokens whose output is final (a multiple of the chunk size)
    pending: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # token ids after those
    lookahead_activations: Tensor | None = None  # [D, 2]
    upsample_input: Tensor | None = None  # [2, D]
    keys: list[Tensor] = field(default_factory=list)  # per block [H, frames, d_k]
    values: list[Tensor] = field(default_factory=list)
    finished: bool = False

    def fork(self) -> EncoderStreamState:
        return dataclasses.replace(self, keys=list(self.keys), values=list(self.values))


@dataclass
class IncrementalOutput:
    """Row b's mu columns 0..mel_len[b]-1 are its mel frames mel_start[b], mel_start[b]+1, ...

    Frames before ``mel_final[b]`` will not change any more; the ones after it (the
    incomplete last chunk) are provisional and come again, updated, in the next step.
    """

    mu: Tensor  # [B, 80, F]
    mel_start: Tensor  # [B]
    mel_len: Tensor  # [B]
    mel_final: Tensor  # [B]
    mel_end: list[int]  # mel_start + mel_len, counted on the host
    by_graph: bool = False  # the encoder pass was a CUDA graph's replay (``IncrementalEncoder.graphs``)


class IncrementalEncoder:
    """Streaming token encoder that encodes each chunk once (see the module docstring).

    Equal to ``encode_tokens(..., streaming=True)`` over all tokens so far, restricted
    to the frames from the last complete chunk on. Sessions at different positions are
    batched together; each row's result is what it would be alone.
    """

    def __init__(self, parts: Parts) -> None:
        self.input_embedding = token_encoder_part(parts, "input_embedding")
        self.encoder: UpsampleConformerEncoder = token_encoder_part(parts, "encoder")
        self.encoder_proj = token_encoder_part(parts, "encoder_proj")
        self.positions = PositionTables(self.encoder)
        # The encoder pass by CUDA graphs where they hold a step (set at start-up, opt-in).
        self.graphs: EncoderPass | None = None
        self.chunk = self.encoder.static_chunk_size
        if self.chunk <= 0:
            raise ValueError("incremental encoding needs chunk masks (static_chunk_size > 0)")

    @torch.inference_mode()
    def step(
        self, states: Sequence[EncoderStreamState], tokens: Sequence[Tensor], finalize: bool | Sequence[bool] = False
    ) -> IncrementalOutput:
        """Append ``tokens[b]`` (1-D ids; the prompt tokens go in the first step) to session b.

        Without finalize the last 3 tokens are held back as look-ahead; with it the
        session ends (its state may not be stepped again).
        """
        if not states or len(states) != len(tokens):
            raise ValueError("one token tensor per session, at least one session")
        if any(state.finished for state in states):
            raise ValueError("a finished session was stepped again")
        finals = [finalize] * len(states) if isinstance(finalize, bool) else list(finalize)
        device = self.encoder_proj.weight.device
        dtype = self.encoder_proj.weight.dtype
        lookahead = self.encoder.pre_lookahead_len
        stride = self.encoder.stride

        rows = [torch.cat([s.pending.to(device), t.to(device).long()]) for s, t in zip(states, tokens)]
        # Lengths are known here: counted on the host, so that nothing waits for the device.
        counts = [max(0, len(r) - (0 if f else lookahead)) for r, f in zip(rows, finals)]
        lengths = to_device([len(r) for r in rows], torch.long, device)
        encoded = to_device(counts, torch.long, device)
        starts = [s.committed * stride for s in states]
        mel_start = to_device(starts, torch.long, device)
        mel_end = [start + count * stride for start, count in zip(starts, counts)]
        width = max(counts)
        if width == 0:  # nothing but look-ahead yet
            for state, ids in zip(states, rows):
                state.pending = ids
            empty = torch.zeros(len(states), self.encoder_proj.out_features, 0, device=device, dtype=dtype)
            return IncrementalOutput(empty, mel_start, encoded * stride, mel_start, mel_end)

        ids = nn.utils.rnn.pad_sequence(rows, batch_first=True)
        mel_len = encoded * stride
        replayed = None if self.graphs is None else self.graphs.run(states, ids, lengths, encoded, counts)
        if replayed is not None:
            out, mu = replayed
        else:
            parts = {"input_embedding": self.input_embedding, "encoder": self.encoder}
            frames = embed_tokens(parts, ids, lengths, width + lookahead)
            cache = SessionCaches(self.encoder, states, device, dtype)
            out = self.encoder.forward_frames(frames, encoded, streaming=True, cache=cache, positions=self.positions)
            mu = project_frames({"encoder_proj": self.encoder_proj}, out.ys, mel_len)
        for row, (state, final) in enumerate(zip(states, finals)):
            self._commit(state, row, out, rows[row], counts[row], final)
        committed = to_device([s.committed * stride for s in states], torch.long, device)
        mel_final = torch.where(to_device(finals, torch.bool, device), mel_start + mel_len, committed)
        return IncrementalOutput(mu, mel_start, mel_len, mel_final, mel_end, by_graph=replayed is not None)

    def step_joined(
        self, states: Sequence[EncoderStreamState], joined: Sequence[Tensor], finalize: bool | Sequence[bool] = False
    ) -> IncrementalOutput:
        """``step``, given each session's tokens so far (its prompt's first) instead of its new
        ones: the tokens past those its state has been given are new."""
        given = [s.committed + len(s.pending) for s in states]
        if any(len(ids) < n for ids, n in zip(joined, given)):
            raise ValueError("a session's tokens so far are fewer than it has been given")
        return self.step(states, [ids[n:] for ids, n in zip(joined, given)], finalize)

    def _commit(
        self, state: EncoderStreamState, row: int, out: EncoderOutput, ids: Tensor, encoded: int, final: bool
    ) -> None:
        """Move the row's newly complete chunks into its cache; keep the rest pending."""
        if final:
            state.finished = True
            state.keys, state.values, state.pending = [], [], ids[:0]
            return
        new = encoded // self.chunk * self.chunk  # tokens whose output became final
        state.pending = ids[new:]
        if new == 0:
            return
        history = self.encoder.pre_lookahead_layer.history
        n_first = len(self.encoder.encoders)
        frames = [new] * n_first + [new * self.encoder.stride] * (len(out.keys) - n_first)
        if state.committed:
            state.keys = [torch.cat([old, k[row, :, :n]], 1) for old, k, n in zip(state.keys, out.keys, frames)]
            state.values = [torch.cat([old, v[row, :, :n]], 1) for old, v, n in zip(state.values, out.values, frames)]
            past_activations, past_first_stack = state.lookahead_activations, state.upsample_input
        else:
            state.keys = [k[row, :, :n].clone() for k, n in zip(out.keys, frames)]
            state.values = [v[row, :, :n].clone() for v, n in zip(out.values, frames)]
            past_activations = out.lookahead_activations.new_zeros(out.lookahead_activations.size(1), history)
            past_first_stack = out.upsample_input.new_zeros(Upsample1D.history, out.upsample_input.size(2))
        # The next step's left context: what the two convs read of the last final tokens
        # (from the old context too, were a chunk shorter than that context).
        activations = torch.cat([past_activations, out.lookahead_activations[row, :, :encoded]], dim=1)
        state.lookahead_activations = activations[:, new : new + history].clone()
        first_stack = torch.cat([past_first_stack, out.upsample_input[row, :encoded]], dim=0)
        state.upsample_input = first_stack[new : new + Upsample1D.history].clone()
        state.committed += new


@dataclass
class SessionCaches:
    """The sessions' caches as one batch's left context, padded a group of rows at a time (as
    ``forward_frames`` asks for them)."""

    encoder: UpsampleConformerEncoder
    states: Sequence[EncoderStreamState]
    device: torch.device
    dtype: torch.dtype

    def cached_tokens(self) -> int:
        return max(s.committed for s in self.states)

    def rows(self, start: int, stop: int) -> EncoderCache:
        states = self.states[start:stop]
        cache = self.encoder.empty_cache(len(states), self.device, self.dtype)
        cache.offset = to_device([s.committed for s in states], torch.long, self.device)
        for row, state in enumerate(states):
            if state.committed:
                cache.lookahead_activations[row] = state.lookahead_activations
                cache.upsample_input[row] = state.upsample_input
        if any(s.committed for s in states):
            for block, empty in enumerate(cache.keys):
                cache.keys[block] = _pad_stack([s.keys[block] if s.committed else None for s in states], empty)
                cache.values[block] = _pad_stack([s.values[block] if s.committed else None for s in states], empty)
        return cache


def _pad_stack(rows: list[Tensor | None], empty: Tensor) -> Tensor:
    """Per-row [H, frames, d_k] (None: no frames) -> [B, H, max frames, d_k], zero-padded."""
    width = max((r.size(1) for r in rows if r is not None), default=0)
    if width == 0:
        return empty
    heads, head_dim = empty.size(1), empty.size(3)
    out = empty.new_zeros(len(rows), heads, width, head_dim)
    for row, frames in enumerate(rows):
        if frames is not None:
            out[row, :, : frames.size(1)] = frames
    return out
