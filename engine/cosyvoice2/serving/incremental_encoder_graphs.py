"""CUDA graphs of the incremental token encoder, for the engine thread's paged calls.

Why: a paged call's token encoder is bound by its launches. One call issues ~600 torch ops
(~3,300 counted with their nested aten calls) whatever its rows, and on an H100 at 64 sessions
that took 26-45 ms of a ~200 ms call, the GPU waiting for the host (docs/benchmarks.md); the
first-chunk lane's whole-prompt encoder, in graphs since (encoder_graphs.py), went from ~20 to
2-5 ms. Here the step's encoder pass (``IncrementalEncoder.step``: embedding, the ten blocks over
the turns' cached keys and values, the projection) is one replay; what stays on the host is
the copy of each turn's cache into the graph's inputs, and the commit of its complete chunks.

Keys: (batch bucket, new-token bucket, cached-token bucket). A call pads its rows to the
batch bucket with row 0's tokens and no cache (their output is cut off), its new tokens to the next width (tokens past a row's
length are zero and masked, as rows of different lengths already are), and its turns' caches to
the next cache width (cached frames past a row's count are masked by its offset). Exact, up to
floating-point rounding (a padded shape sums in another order), for the same reasons as the
eager batch (tests/engine/cosyvoice2/serving/test_incremental_encoder_graphs.py runs the
programs eagerly against the eager step; start-up compares a replay with its program).
A call no key holds (more rows or tokens than the largest) runs eagerly.

Memory: the programs share their static inputs and outputs, one buffer per kind sized for the
largest key (the caches: ~28 KB per cached token and row at full size in bf16, bounded by
``MAX_ROW_TOKENS``; 0.68 GiB in all at full size in bf16 with the defaults), and one graph pool
(its peak is the largest pass's intermediates): calls of one thread never overlap, and a step
copies what it keeps out of the outputs before the next call. With ``max_batch`` 64 there are
236 graphs, 4.45 GiB in all on an H100 (3.3 GB in ``bench/encoder_graphs.py``). The graphs'
distance tables (``PositionTables``) are their own, grown to the largest key before capture and
never after (a replay reads their memory).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tts_gateway.engine.cosyvoice2.model.flow_encoder import (
    EncoderCache, EncoderOutput, Parts, PositionTables, Upsample1D, UpsampleConformerEncoder, embed_tokens,
    project_frames, token_encoder_part,
)
from tts_gateway.engine.cosyvoice2.serving.buckets import (
    CAPTURE_LOCK, batch_buckets, capture_after_warm_up, holding_capture_lock, pad_rows,
)
from tts_gateway.engine.cosyvoice2.serving.incremental_encoder import EncoderStreamState
from tts_gateway.engine.cosyvoice2.serving.uploads import to_device

log = logging.getLogger(__name__)

# The most rows x cached tokens a graph's inputs hold: 64 turns of 256 cached tokens, 8 of
# 2,048. ~0.45 GB of static cache inputs at full size in bf16.
MAX_ROW_TOKENS = 1 << 14
# The most rows x new tokens of a graph: a paged call's decoder frames are held to
# call_plan.MAX_CALL_ROW_FRAMES (13,000, two a token), so wider calls do not come.
MAX_ROW_NEW_TOKENS = 1 << 13
# New tokens of a call (its rows' widest): a chunk's tokens and look-ahead, the pending tokens
# of the last incomplete chunk before them, and in a turn's first paged call its prompt.
NEW_TOKEN_WIDTHS = (25, 50, 100, 150, 200, 250, 300)
# Cached tokens of a call (its rows' most): 0 in a turn's first paged call, then doubling.
CACHED_TOKEN_WIDTHS = (0, 128, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class IncrementalKey:
    batch: int  # padded rows
    width: int  # new tokens encoded (their look-ahead follows)
    cached: int  # cached tokens, padded

    @property
    def size(self) -> tuple[int, int]:
        """How large its graph is (rows x tokens, then rows): the order of capture and choice."""
        return self.batch * (self.width + self.cached), self.batch


class _StaticBuffers:
    """The programs' shared inputs and outputs, sized for the largest keys, flat so that every
    key's view of them is contiguous (``cache``, ``outputs``). Outputs are copied into these
    inside the graph, so that nothing a capture allocated stays held in the pool after it."""

    def __init__(
        self, encoder: UpsampleConformerEncoder, output_size: int, keys: list[IncrementalKey], device, dtype
    ) -> None:
        size, heads = encoder.config.output_size, encoder.config.attention_heads
        self.size, self.output_size, self.heads, self.head_dim = size, output_size, heads, size // heads
        self.n_first, self.stride = len(encoder.encoders), encoder.stride
        self.n_blocks = self.n_first + len(encoder.up_encoders)
        rows = max(k.batch for k in keys)
        cached = max(k.batch * k.cached for k in keys)  # rows x tokens
        new = max(k.batch * k.width for k in keys)
        self.ids = torch.zeros(rows, max(k.width for k in keys) + encoder.pre_lookahead_len, dtype=torch.long,
                               device=device)
        self.lengths, self.encoded, self.offset = (torch.zeros(rows, dtype=torch.long, device=device) for _ in range(3))
        self.lookahead = torch.zeros(rows, size, encoder.pre_lookahead_layer.history, device=device, dtype=dtype)
        self.upsample = torch.zeros(rows, Upsample1D.history, size, device=device, dtype=dtype)

        def flat(tokens: int, block: int) -> Tensor:
            return torch.zeros(tokens * self._scale(block) * size, device=device, dtype=dtype)

        self.keys = [flat(cached, b) for b in range(self.n_blocks)]
        self.values = [flat(cached, b) for b in range(self.n_blocks)]
        self.new_keys = [flat(new, b) for b in range(self.n_blocks)]
        self.new_values = [flat(new, b) for b in range(self.n_blocks)]
        self.ys = torch.zeros(new * self.stride * size, device=device, dtype=dtype)
        self.new_lookahead = torch.zeros(new * size, device=device, dtype=dtype)
        self.new_upsample = torch.zeros(new * size, device=device, dtype=dtype)
        self.mu = torch.zeros(new * self.stride * output_size, device=device, dtype=dtype)

    def _scale(self, block: int) -> int:
        return 1 if block < self.n_first else self.stride  # the up blocks keep stride frames a token

    def _heads(self, flat: Tensor, batch: int, tokens: int, block: int) -> Tensor:
        frames = tokens * self._scale(block)
        return flat[: batch * self.size * frames].view(batch, self.heads, frames, self.head_dim)

    def cache(self, key: IncrementalKey) -> EncoderCache:
        return EncoderCache(
            self.offset[: key.batch], self.lookahead[: key.batch], self.upsample[: key.batch],
            [self._heads(k, key.batch, key.cached, b) for b, k in enumerate(self.keys)],
            [self._heads(v, key.batch, key.cached, b) for b, v in enumerate(self.values)],
        )

    def outputs(self, key: IncrementalKey) -> tuple[EncoderOutput, Tensor]:
        b, w, size = key.batch, key.width, self.size
        out = EncoderOutput(
            self.ys[: b * self.stride * w * size].view(b, self.stride * w, size),
            self.new_lookahead[: b * size * w].view(b, size, w),
            self.new_upsample[: b * w * size].view(b, w, size),
            [self._heads(k, b, w, block) for block, k in enumerate(self.new_keys)],
            [self._heads(v, b, w, block) for block, v in enumerate(self.new_values)],
        )
        return out, self.mu[: b * self.output_size * self.stride * w].view(b, self.output_size, self.stride * w)


class _Program:
    """One key's views of the static buffers, what fills its outputs from its inputs, and its
    graph once captured (without one, ``replay`` runs the same program eagerly)."""

    def __init__(self, graphs: IncrementalEncoderGraphs, key: IncrementalKey) -> None:
        self.graphs, self.key = graphs, key
        buffers = graphs.buffers
        self.ids = buffers.ids[: key.batch, : key.width + graphs.encoder.pre_lookahead_len]
        self.lengths, self.encoded = buffers.lengths[: key.batch], buffers.encoded[: key.batch]
        self.cache = buffers.cache(key)
        self.outputs = buffers.outputs(key)
        self.graph: torch.cuda.CUDAGraph | None = None

    def compute(self) -> tuple[EncoderOutput, Tensor]:
        """The encoder pass on the inputs, into fresh tensors."""
        graphs = self.graphs
        frames = embed_tokens(graphs.parts, self.ids, self.lengths, self.ids.size(1))
        out = graphs.encoder.forward_frames(frames, self.encoded, True, cache=self.cache, positions=graphs.positions)
        return out, project_frames(graphs.parts, out.ys, self.encoded * graphs.encoder.stride)

    def run(self) -> None:
        """The encoder pass into the static outputs (what a graph holds)."""
        out, mu = self.compute()
        static, static_mu = self.outputs
        static.ys.copy_(out.ys)
        static.lookahead_activations.copy_(out.lookahead_activations)
        static.upsample_input.copy_(out.upsample_input)
        for ours, theirs in zip((*static.keys, *static.values), (*out.keys, *out.values), strict=True):
            ours.copy_(theirs)
        static_mu.copy_(mu)

    def replay(self) -> tuple[EncoderOutput, Tensor]:
        if self.graph is None:
            self.run()
        else:
            self.graph.replay()
        return self.outputs


class IncrementalEncoderGraphs:
    """``IncrementalEncoder.step``'s encoder pass by graph replay (module docstring). ``capture``
    makes every key's graph ahead of serving; ``run`` returns None where no key holds a call.
    ``graphs=False``: the same programs run eagerly (CPU tests)."""

    def __init__(
        self, parts: Parts, max_batch: int, *, widths: Sequence[int] = NEW_TOKEN_WIDTHS,
        cached: Sequence[int] = CACHED_TOKEN_WIDTHS, max_row_tokens: int = MAX_ROW_TOKENS,
        max_row_new_tokens: int = MAX_ROW_NEW_TOKENS, graphs: bool = True,
    ) -> None:
        weight = token_encoder_part(parts, "encoder_proj").weight
        if graphs and weight.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the token encoder on a CUDA device, it is on {weight.device}")
        self.parts = {name: token_encoder_part(parts, name) for name in ("input_embedding", "encoder", "encoder_proj")}
        self.encoder: UpsampleConformerEncoder = self.parts["encoder"]
        self.device, self.dtype = weight.device, weight.dtype
        self.batches = batch_buckets(max_batch)
        self.widths, self.cached = tuple(sorted(widths)), tuple(sorted(cached))
        keys = [
            IncrementalKey(b, w, c) for b in self.batches for w in self.widths for c in self.cached
            if b * c <= max_row_tokens and b * w <= max_row_new_tokens
        ]
        if not keys:
            raise ValueError("no incremental encoder shapes within max_row_tokens and max_row_new_tokens")
        output_size = self.parts["encoder_proj"].out_features
        self.buffers = _StaticBuffers(self.encoder, output_size, keys, self.device, self.dtype)
        self.positions = PositionTables(self.encoder)
        self._grow_positions(max(k.width for k in keys), max(k.cached for k in keys))
        self.programs = {key: _Program(self, key) for key in keys}
        self.use_graphs = graphs
        self.capture_seconds = 0.0
        if graphs:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)

    @torch.inference_mode()
    def _grow_positions(self, width: int, cached: int) -> None:
        """Every layer's distance table at the span of the widest keys (``AttentionFrames.build``:
        up to cached + width - 1 frames back, width - 1 ahead; the up blocks at stride frames a token)."""
        stride, n_first = self.encoder.stride, len(self.encoder.encoders)
        for layer in range(len(self.positions.attentions)):
            scale = 1 if layer < n_first else stride
            self.positions.lookup(layer, (cached + width) * scale - 1, (cached + 2 * width) * scale - 1)

    def _tables(self) -> list[int]:
        return [table.data_ptr() for table in self.positions.tables]

    def key(self, rows: int, width: int, cached: int) -> IncrementalKey | None:
        """The smallest key holding a call of ``rows`` rows, ``width`` new tokens at most and
        ``cached`` cached ones at most; None: no key does."""
        keys = [
            IncrementalKey(b, w, c)
            for b in self.batches if b >= rows for w in self.widths if w >= width for c in self.cached if c >= cached
        ]
        held = [k for k in keys if k in self.programs]
        return min(held, key=lambda k: (*k.size, k.width)) if held else None

    def largest_key(self) -> IncrementalKey:
        return max(self.programs, key=lambda key: key.size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every key's graph, largest first (smaller ones then reuse the pool's blocks)."""
        for key in sorted(self.programs, key=lambda k: k.size, reverse=True):
            self._capture(self.programs[key])

    @holding_capture_lock
    def _capture(self, program: _Program) -> None:
        started = time.perf_counter()
        self._fill_for_capture(program.key)
        tables = self._tables()
        graph, _ = capture_after_warm_up(program.run, self._stream, self._pool, warm_up=program.compute)
        if self._tables() != tables:  # the graphs would read tables that are gone
            raise RuntimeError(f"the distance tables grew while {program.key} was captured")
        program.graph = graph
        self.capture_seconds += time.perf_counter() - started

    def _fill_for_capture(self, key: IncrementalKey) -> None:
        """A valid call of the key's shape: full rows, full caches."""
        buffers = self.buffers
        buffers.lengths[: key.batch] = key.width + self.encoder.pre_lookahead_len
        buffers.encoded[: key.batch] = key.width
        buffers.offset[: key.batch] = key.cached

    @torch.inference_mode()
    def replay_error(self, key: IncrementalKey) -> float:
        """Largest |replay - eager| of the key's mu, on what its inputs hold."""
        self._fill_for_capture(key)
        program = self.programs[key]
        replayed = program.replay()[1].clone()
        return float((replayed - program.compute()[1]).abs().max())

    @torch.inference_mode()
    def run(
        self, states: Sequence[EncoderStreamState], ids: Tensor, lengths: Tensor, encoded: Tensor, counts: list[int]
    ) -> tuple[EncoderOutput, Tensor] | None:
        """The step's encoder pass (``forward_frames`` after the states' caches, and mu) for rows
        ``ids`` [B, L] with ``lengths`` tokens of which ``encoded`` (``counts``, on the host) are
        encoded; outputs at the key's padded shape, mu [B, 80, stride x max(counts)] of the
        call's rows. None: no key holds the call."""
        key = self.key(len(states), max(counts), max(s.committed for s in states))
        if key is None:
            return None
        program = self.programs[key]
        rows, lookahead = len(states), self.encoder.pre_lookahead_len
        program.ids.copy_(pad_rows(F.pad(ids, (0, key.width + lookahead - ids.size(1))), key.batch))
        program.lengths.copy_(pad_rows(lengths, key.batch))
        program.encoded.copy_(pad_rows(encoded, key.batch))
        self._fill_caches(program.cache, states, key.batch)
        with CAPTURE_LOCK:  # a replay while the other thread captures a graph would fail (buckets.py)
            out, mu = program.replay()
        return out, mu[:rows, :, : self.encoder.stride * max(counts)].clone()

    def _fill_caches(self, cache: EncoderCache, states: Sequence[EncoderStreamState], batch: int) -> None:
        """Each row's cached keys, values and convolution context into the static cache, in two
        launches: everything zeroed first, as the eager path pads (a row at its start has zero
        context, as ``empty_cache``; the slots past a row's cache are masked, but an attention
        weight of 0 times a non-finite value left there by another turn would be NaN), then
        every row's tensors copied. Padding rows cache nothing: their output is cut off."""
        committed = [s.committed for s in states]
        cache.offset.copy_(to_device(committed + [0] * (batch - len(states)), torch.long, self.device))
        torch._foreach_zero_([cache.lookahead_activations, cache.upsample_input, *cache.keys, *cache.values])
        ours: list[Tensor] = []
        theirs: list[Tensor] = []
        for row, state in enumerate(states):
            if not state.committed:
                continue
            ours += [cache.lookahead_activations[row], cache.upsample_input[row]]
            theirs += [state.lookahead_activations, state.upsample_input]
            for static, stored in zip((*cache.keys, *cache.values), (*state.keys, *state.values), strict=True):
                ours.append(static[row, :, : stored.size(1)])
                theirs.append(stored)
        if ours:
            torch._foreach_copy_(ours, theirs)
