"""The flow's token encoder: speech tokens (25 Hz) -> 80-dim conditioning ``mu`` (50 Hz).

This is everything of the official ``CausalMaskedDiffWithXvec`` except its decoder:

- ``input_embedding``: token id -> 512-dim vector;
- ``encoder``: ``UpsampleConformerEncoder``, in order
  1. ``embed``: Linear + LayerNorm, times sqrt(512);
  2. ``pre_lookahead_layer``: a conv that looks 3 tokens ahead, then a causal conv
     (kernel 3), added back to its input;
  3. ``encoders``: 6 pre-norm transformer blocks (self-attention with relative
     positions, "rel_pos_espnet" / Transformer-XL style, then a SiLU feed-forward);
  4. ``up_layer``: nearest-neighbour upsampling x2, then a causal conv (kernel 5);
  5. ``up_embed``: Linear + LayerNorm, times sqrt(512);
  6. ``up_encoders``: 4 more blocks on the 50 Hz frames; ``after_norm``;
- ``encoder_proj``: Linear 512 -> 80, the ``mu`` the flow-matching decoder follows;
- ``spk_embed_affine_layer``: the L2-normalised 192-dim speaker x-vector -> 80 dims.

Parameter names and shapes are the official ones, so ``flow.pt`` loads strictly.
The official encoder hard-codes 512 channels for its look-ahead and upsampling
convs; here they follow ``output_size`` (512 in the real model), which lets tests
use narrow models.

Streaming. With ``streaming=True`` each attention layer sees only its own chunk
and the chunks before it: chunks of ``static_chunk_size`` = 25 tokens in the first
stack and 50 frames after the x2 upsampling, both counted from token 0 of
(prompt + generated) tokens, so the two stacks' chunk borders coincide. Without a
final flag (``finalize=False``) the last 3 tokens are held back as look-ahead for
the look-ahead conv instead of being encoded.

Chunk causality (measured in tests/engine/cosyvoice2/model/test_flow_encoder.py on the official flow
with random weights). With ``streaming=True`` and ``finalize=False``, appending tokens
leaves the output of every *complete* chunk unchanged: max abs difference <= 2e-6
(float rounding of longer matmuls; outputs are of order 4), because every part is
causal at chunk granularity:

- ``embed`` / ``up_embed``, the feed-forwards and all LayerNorms act on each frame
  alone;
- the relative positional encoding depends only on query minus key position: the
  sinusoid of a distance does not depend on the sequence length (the official table
  is built once for 5000 positions and only sliced);
- the look-ahead conv reads tokens t..t+3 and the causal conv the conv1 outputs
  t-2..t, so output t needs tokens t-2..t+3; the 3 held-back tokens make t+1..t+3
  real tokens, which later calls see unchanged;
- the upsampling conv pads on the left only: mel frame m reads tokens
  (m-4)//2..m//2;
- with chunk masks, frame i attends only to frames before the end of its own chunk,
  in every layer, so a complete chunk depends only on tokens up to its end (+3).

What does change: the last, incomplete chunk (its frames attend to more keys as the
chunk fills: 0.05 with the tiny test model, 0.005 at full size with random weights),
and everything with ``streaming=False`` (full attention: 0.1 on frames of earlier
chunks). ``finalize=True`` pads the look-ahead of the last 3 tokens with zeros, so
their frames differ from a continued stream (by ~1 in the tests); since they attend
within their chunk, so may the rest of that (last) chunk, but earlier chunks do not.

Hence ``serving/incremental_encoder.py``'s ``IncrementalEncoder``: per session it keeps, for the complete chunks, each
attention layer's keys and values, the look-ahead conv's last 2 conv1 activations
and the first stack's last 2 outputs (the upsampling conv's left context). A step
encodes only the tokens after the last complete chunk (the new chunk plus its
look-ahead) and gives the frames of the full re-run to <= 2.5e-6. What still grows
with the chunk index k is attention over the cached frames (and copying the caches
into a batch); the positional projections come from tables kept per model
(``PositionTables``). Full size, one thread of a busy 2-core CPU: chunks 2, 12, 24
take 0.10, 0.13, 0.23 s incrementally against 0.16, 1.9, 5.6 s for the full re-run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.modeldir.configs import FlowEncoderConfig

# Fixed in the official UpsampleConformerEncoder (not constructor arguments).
PRE_LOOKAHEAD_LEN = 3
UPSAMPLE_STRIDE = 2
NUM_UP_BLOCKS = 4


def relative_sinusoids(top: int, count: int, dim: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Sinusoidal encodings of the distances top, top-1, ..., top-count+1: [count, dim].

    Even columns sin(r w_k), odd columns cos(r w_k), w_k = 10000^(-2k/dim); computed in
    float32 as the official table is, whose rows are exactly these for any r.
    """
    distance = torch.arange(top, top - count, -1, dtype=torch.float32, device=device)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / dim))
    angle = distance[:, None] * freq
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1).to(dtype)


@dataclass
class AttentionFrames:
    """Who attends to whom in one stack, shared by its layers.

    Keys are the cached frames (slots 0..C-1, row b valid below its offset) followed
    by the new frames, which are also the queries.
    """

    mask: Tensor  # [B, T, C + T] bool: query may attend to key
    distance_index: Tensor  # [B, T, C + T] long: (query - key) position as an index into the distances
    top: int  # the distances are top, top - 1, ..., top - count + 1
    count: int

    @classmethod
    def build(cls, offset: Tensor, lengths: Tensor, width: int, cache_width: int, chunk: int | None) -> AttentionFrames:
        """offset [B]: frames already cached per row; lengths [B]: valid new frames; width: new frames
        (padded); cache_width: cached slots (padded: at least every row's offset)."""
        device = offset.device
        slots = torch.arange(width, device=device)
        cache_slots = torch.arange(cache_width, device=device)
        query_pos = offset[:, None] + slots  # [B, T]
        key_pos = torch.cat([cache_slots.expand(offset.size(0), -1), query_pos], dim=1)  # [B, C + T]
        key_valid = torch.cat([cache_slots < offset[:, None], slots < lengths[:, None]], dim=1)
        mask = key_valid[:, None, :].expand(-1, width, -1)
        if chunk is not None:
            chunk_end = (torch.div(query_pos, chunk, rounding_mode="floor") + 1) * chunk
            mask = mask & (key_pos[:, None, :] < chunk_end[:, :, None])
        # Valid distances run from at most cache_width + width - 1 (last query, first key) down
        # to -(width - 1) (first new query, last new key). The padded width, not the largest
        # offset (which it equals but for padding rows): that would be a read of the device.
        top = cache_width + width - 1
        count = top + width
        distance = query_pos[:, :, None] - key_pos[:, None, :]
        index = (top - distance).clamp(0, count - 1)  # padded cache slots only, masked anyway
        return cls(mask, index, top, count)


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL relative positions.

    score(i, j) = (q_i + u) . k_j + (q_i + v) . W_pos enc(i - j), divided by sqrt(d_k).
    """

    def __init__(self, size: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = size // heads
        self.linear_q = nn.Linear(size, size)
        self.linear_k = nn.Linear(size, size)
        self.linear_v = nn.Linear(size, size)
        self.linear_out = nn.Linear(size, size)
        self.linear_pos = nn.Linear(size, size, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.head_dim))

    def project_positions(self, sinusoids: Tensor) -> Tensor:
        """Distance encodings [R, D] -> per head [H, R, d_k]."""
        return self.linear_pos(sinusoids).view(-1, self.heads, self.head_dim).transpose(0, 1)

    def forward(
        self, x: Tensor, frames: AttentionFrames, positions: Tensor, past: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, D], positions [H, R, d_k] (``project_positions`` of frames' distances)
        -> (out [B, T, D], keys, values [B, H, T, d_k] of the new frames)."""
        batch, width, size = x.shape
        q = self.linear_q(x).view(batch, width, self.heads, self.head_dim)
        k = self.linear_k(x).view(batch, width, self.heads, self.head_dim).transpose(1, 2)
        v = self.linear_v(x).view(batch, width, self.heads, self.head_dim).transpose(1, 2)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))

        content = (q + self.pos_bias_u).transpose(1, 2) @ keys.transpose(2, 3)  # [B, H, T, C + T]
        by_distance = (q + self.pos_bias_v).transpose(1, 2) @ positions.transpose(1, 2)  # [B, H, T, R]
        index = frames.distance_index[:, None].expand(-1, self.heads, -1, -1)
        position = by_distance.gather(3, index)
        scores = (content + position) / math.sqrt(self.head_dim)

        # A finite fill instead of -inf keeps fully masked (padding) rows free of NaN,
        # which would otherwise reach valid rows through 0 * NaN in the value product.
        blocked = ~frames.mask[:, None]
        weights = scores.masked_fill(blocked, torch.finfo(scores.dtype).min).softmax(dim=-1).masked_fill(blocked, 0.0)
        out = (weights @ values).transpose(1, 2).reshape(batch, width, size)
        return self.linear_out(out), k, v


class PositionwiseFeedForward(nn.Module):
    def __init__(self, size: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(size, hidden)
        self.w_2 = nn.Linear(hidden, size)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, size: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(size, heads)
        self.feed_forward = PositionwiseFeedForward(size, hidden)
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)

    def forward(
        self, x: Tensor, frames: AttentionFrames, positions: Tensor, past: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        attended, keys, values = self.self_attn(self.norm_mha(x), frames, positions, past)
        x = x + attended
        return x + self.feed_forward(self.norm_ff(x)), keys, values


class LinearEmbed(nn.Module):
    """Linear -> LayerNorm, scaled by sqrt(size) as the rel_pos_espnet encoding does."""

    def __init__(self, input_size: int, size: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(input_size, size), nn.LayerNorm(size, eps=1e-5))
        self.scale = math.sqrt(size)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.scale


class PreLookaheadLayer(nn.Module):
    """x_t + causal_conv(leaky_relu(conv over x_t..x_{t+lookahead}))."""

    def __init__(self, channels: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    @property
    def history(self) -> int:
        """conv1 activations before the first new frame that conv2 reads."""
        return self.conv2.kernel_size[0] - 1

    def forward(self, frames: Tensor, past: Tensor) -> tuple[Tensor, Tensor]:
        """frames [B, T + lookahead, D]: T frames and then their look-ahead (zeros where none);
        past [B, D, history]: activations of the frames before (zeros at the start).
        Returns (out [B, T, D], conv1 activations [B, D, T])."""
        activations = F.leaky_relu(self.conv1(frames.transpose(1, 2)))
        out = self.conv2(torch.cat([past, activations], dim=2)).transpose(1, 2)
        return out + frames[:, : activations.size(2)], activations


class Upsample1D(nn.Module):
    """Repeat every frame ``stride`` times, then a conv that reads 2*stride frames back."""

    history = 2  # input frames before the first new one the conv reads (2*stride repeated frames)

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, kernel_size=2 * stride + 1)

    def forward(self, x: Tensor, past: Tensor) -> Tensor:
        """x [B, T, D], past [B, history, D] (zeros at the start) -> [B, stride * T, D]."""
        repeated = torch.cat([past, x], dim=1).repeat_interleave(self.stride, dim=1)
        return self.conv(repeated.transpose(1, 2)).transpose(1, 2)


class PositionTables:
    """Each attention layer's projected distance encodings, kept across calls.

    ``linear_pos`` of a distance's sinusoid depends on the weights only, so a table
    per layer, grown (doubled) on demand, replaces projecting every distance again in
    each streaming step, which would grow with the number of frames encoded so far.
    Build it after the weights are loaded; it follows their device and dtype.
    """

    def __init__(self, encoder: UpsampleConformerEncoder) -> None:
        self.attentions = [block.self_attn for block in (*encoder.encoders, *encoder.up_encoders)]
        self.tops = [-1] * len(self.attentions)  # per layer, its table's largest distance...
        self.bottoms = [-1] * len(self.attentions)  # ...and most negative one, negated
        self.tables: list[Tensor | None] = [None] * len(self.attentions)  # [H, tops + bottoms + 1, d_k]

    def lookup(self, layer: int, top: int, count: int) -> Tensor:
        """[H, count, d_k] for the distances top, top - 1, ..., top - count + 1."""
        attention = self.attentions[layer]
        weight = attention.linear_pos.weight
        table = self.tables[layer]
        bottom = count - 1 - top
        if table is None or table.device != weight.device or table.dtype != weight.dtype:
            self.tops[layer] = self.bottoms[layer] = -1
        if top > self.tops[layer] or bottom > self.bottoms[layer]:
            self.tops[layer] = max(top, 2 * self.tops[layer])
            self.bottoms[layer] = max(bottom, self.bottoms[layer])
            size = self.tops[layer] + self.bottoms[layer] + 1
            sinusoids = relative_sinusoids(self.tops[layer], size, weight.size(1), weight.device, weight.dtype)
            self.tables[layer] = table = attention.project_positions(sinusoids)
        start = self.tops[layer] - top
        return table[:, start : start + count]


# The most elements one encoder pass holds per kind of tensor: attention scores (rows x heads x
# query frames x key frames; a layer holds a few such) and the cached keys and values copied into
# a padded batch. A call over whole turns needs frames x frames per row and head: 16 turns of
# ~60 s in one flow call asked for 2.3 GiB per score tensor and ran an 80 GB GPU out of memory;
# an incremental step over many long turns copies ~14 KB of cache per mel frame and row. Larger
# batches are encoded in groups of rows (``forward_frames``; each row's output is what it is
# alone, and a row longer than this bound allows goes alone).
ENCODER_PASS_ELEMENTS = 1 << 26


@dataclass
class EncoderCache:
    """Left context of a batch of rows: what the encoder needs of the frames before the new ones."""

    offset: Tensor  # [B] long: tokens already encoded per row
    lookahead_activations: Tensor  # [B, D, 2]: look-ahead conv1 activations of tokens offset-2, offset-1
    upsample_input: Tensor  # [B, 2, D]: first-stack outputs of tokens offset-2, offset-1
    # Per block (encoders, then up_encoders): [B, H, C, d_k]; row b's first offset[b] frames
    # (x stride in the up blocks) are valid.
    keys: list[Tensor]
    values: list[Tensor]

    def cached_tokens(self) -> int:
        """The padded width of the first blocks' keys: the most tokens a row has cached."""
        return self.keys[0].size(2)

    def rows(self, start: int, stop: int) -> EncoderCache:
        """The left context of rows start .. stop - 1."""
        return EncoderCache(
            self.offset[start:stop], self.lookahead_activations[start:stop], self.upsample_input[start:stop],
            [k[start:stop] for k in self.keys], [v[start:stop] for v in self.values],
        )


class BatchLeftContext(Protocol):
    """A batch's left context as ``forward_frames`` takes it: an EncoderCache, or one that builds
    the padded cache of a group of rows only when asked (so that long caches are copied a group
    at a time)."""

    def cached_tokens(self) -> int: ...

    def rows(self, start: int, stop: int) -> EncoderCache: ...


@dataclass
class EncoderOutput:
    ys: Tensor  # [B, stride * T, D]
    lookahead_activations: Tensor  # [B, D, T]
    upsample_input: Tensor  # [B, T, D]
    keys: list[Tensor]  # per block, the new frames only: [B, H, T (x stride), d_k]
    values: list[Tensor]

    @staticmethod
    def joined(parts: list[EncoderOutput]) -> EncoderOutput:
        """Outputs of consecutive groups of rows (of one padded width) as one batch."""
        return EncoderOutput(
            torch.cat([p.ys for p in parts]),
            torch.cat([p.lookahead_activations for p in parts]),
            torch.cat([p.upsample_input for p in parts]),
            [torch.cat(layer) for layer in zip(*(p.keys for p in parts))],
            [torch.cat(layer) for layer in zip(*(p.values for p in parts))],
        )


class UpsampleConformerEncoder(nn.Module):
    """Our implementation of the official encoder of the same name (see the module docstring)."""

    def __init__(
        self,
        config: FlowEncoderConfig,
        pre_lookahead_len: int = PRE_LOOKAHEAD_LEN,
        upsample_stride: int = UPSAMPLE_STRIDE,
    ) -> None:
        super().__init__()
        config.check_supported()
        self.config = config
        size = config.output_size
        self.static_chunk_size = config.static_chunk_size
        self.embed = LinearEmbed(config.input_size, size)
        self.after_norm = nn.LayerNorm(size, eps=1e-5)
        self.pre_lookahead_layer = PreLookaheadLayer(size, pre_lookahead_len)
        self.encoders = nn.ModuleList(
            ConformerBlock(size, config.attention_heads, config.linear_units) for _ in range(config.num_blocks)
        )
        self.up_layer = Upsample1D(size, upsample_stride)
        self.up_embed = LinearEmbed(config.input_size, size)
        self.up_encoders = nn.ModuleList(
            ConformerBlock(size, config.attention_heads, config.linear_units) for _ in range(NUM_UP_BLOCKS)
        )

    @property
    def pre_lookahead_len(self) -> int:
        return self.pre_lookahead_layer.lookahead

    @property
    def stride(self) -> int:
        return self.up_layer.stride

    def forward(
        self,
        xs: Tensor,
        xs_lens: Tensor,
        context: Tensor | None = None,
        streaming: bool = False,
        context_lens: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The official call: xs [B, T, D_in], xs_lens [B] -> (ys [B, stride*T, D], masks [B, 1, stride*T]).

        ``context`` [B, C <= 3, D_in]: the look-ahead tokens that follow each row's
        valid frames (the official flow passes them when finalize=False); rows
        without look-ahead get zeros, as the official pads. ``context_lens`` [B] gives
        per row how many context frames are real (default: all). ``xs_lens`` above T
        count as T (the official flow passes lengths that include the context).
        """
        width = xs.size(1)
        lookahead = self.pre_lookahead_len
        lengths = xs_lens.clamp(max=width)
        valid = torch.arange(width, device=xs.device)[None, :] < lengths[:, None]
        x = self.embed(xs) * valid[..., None]
        frames = F.pad(x, (0, 0, 0, lookahead))
        if context is not None and context.size(1) > 0:
            if context.size(1) > lookahead:
                raise ValueError(f"context of {context.size(1)} frames; the look-ahead is {lookahead}")
            ahead = self.embed(context)
            if context_lens is not None:
                real = torch.arange(ahead.size(1), device=xs.device)[None, :] < context_lens[:, None]
                ahead = ahead * real[..., None]
            index = lengths[:, None] + torch.arange(ahead.size(1), device=xs.device)  # right after each row
            frames = frames.scatter(1, index[..., None].expand(-1, -1, frames.size(2)), ahead)
        ys = self.forward_frames(frames, lengths, streaming).ys
        masks = torch.arange(self.stride * width, device=xs.device)[None, :] < self.stride * lengths[:, None]
        return ys, masks[:, None, :]

    def forward_frames(
        self,
        frames: Tensor,
        lengths: Tensor,
        streaming: bool,
        cache: BatchLeftContext | None = None,
        positions: PositionTables | None = None,
    ) -> EncoderOutput:
        """The encoder after ``embed``, on new tokens that follow ``cache`` (or the start).

        frames [B, T + 3, D]: embedded tokens, T to encode and then 3 of look-ahead,
        row b's valid tokens (``lengths[b]`` encoded ones + its look-ahead) first and
        zeros after (zeros = no look-ahead, as at the end of an utterance).
        ``positions``: projected distance encodings kept across calls (else computed).
        Rows go in groups where one pass would hold more than ENCODER_PASS_ELEMENTS scores, or
        copy more than that many cached keys and values.
        """
        batch, padded, _ = frames.shape
        if cache is None:
            cache = self.empty_cache(batch, frames.device, frames.dtype)
        queries = self.stride * (padded - self.pre_lookahead_len)  # the up blocks' new frames
        cached = cache.cached_tokens()
        scores = self.config.attention_heads * queries * (self.stride * cached + queries)
        copied = 2 * self.config.output_size * cached * (len(self.encoders) + self.stride * len(self.up_encoders))
        group = max(1, ENCODER_PASS_ELEMENTS // max(scores, copied, 1))
        if batch <= group:
            return self._forward_rows(frames, lengths, streaming, cache.rows(0, batch), positions)
        return EncoderOutput.joined([
            self._forward_rows(frames[i : i + group], lengths[i : i + group], streaming, cache.rows(i, i + group),
                               positions)
            for i in range(0, batch, group)
        ])

    def _forward_rows(
        self, frames: Tensor, lengths: Tensor, streaming: bool, cache: EncoderCache, positions: PositionTables | None
    ) -> EncoderOutput:
        """``forward_frames`` of rows taken in one pass."""
        width = frames.size(1) - self.pre_lookahead_len
        stride = self.stride
        chunk = self.static_chunk_size if streaming and self.static_chunk_size > 0 else None
        n_first = len(self.encoders)
        keys: list[Tensor] = []
        values: list[Tensor] = []

        x, activations = self.pre_lookahead_layer(frames, cache.lookahead_activations)
        attention = AttentionFrames.build(cache.offset, lengths, width, cache.keys[0].size(2), chunk)
        first_stack = self._run_blocks(self.encoders, 0, x, attention, cache, positions, keys, values)

        x = self.up_embed(self.up_layer(first_stack, cache.upsample_input))
        attention = AttentionFrames.build(
            cache.offset * stride,
            lengths * stride,
            width * stride,
            cache.keys[n_first].size(2),
            None if chunk is None else chunk * stride,
        )
        x = self._run_blocks(self.up_encoders, n_first, x, attention, cache, positions, keys, values)
        return EncoderOutput(self.after_norm(x), activations, first_stack, keys, values)

    @staticmethod
    def _run_blocks(
        blocks: nn.ModuleList,
        first: int,
        x: Tensor,
        attention: AttentionFrames,
        cache: EncoderCache,
        positions: PositionTables | None,
        keys: list[Tensor],
        values: list[Tensor],
    ) -> Tensor:
        """One stack; ``first``: its first block's index among all blocks. Appends the new keys/values."""
        if positions is None:
            sinusoids = relative_sinusoids(attention.top, attention.count, x.size(2), x.device, x.dtype)
        for index, block in enumerate(blocks, start=first):
            if positions is None:
                projected = block.self_attn.project_positions(sinusoids)
            else:
                projected = positions.lookup(index, attention.top, attention.count)
            x, k, v = block(x, attention, projected, (cache.keys[index], cache.values[index]))
            keys.append(k)
            values.append(v)
        return x

    def empty_cache(self, batch: int, device: torch.device, dtype: torch.dtype) -> EncoderCache:
        """The left context at the start of an utterance: zeros, no cached frames."""
        size = self.config.output_size
        heads = self.config.attention_heads
        no_frames = torch.zeros(batch, heads, 0, size // heads, device=device, dtype=dtype)
        n_blocks = len(self.encoders) + len(self.up_encoders)
        history = self.pre_lookahead_layer.history
        return EncoderCache(
            offset=torch.zeros(batch, dtype=torch.long, device=device),
            lookahead_activations=torch.zeros(batch, size, history, device=device, dtype=dtype),
            upsample_input=torch.zeros(batch, Upsample1D.history, size, device=device, dtype=dtype),
            keys=[no_frames] * n_blocks,
            values=[no_frames] * n_blocks,
        )


# --- the flow's parts around the encoder -------------------------------------------------

def build_token_encoder_parts(
    config: FlowEncoderConfig, vocab_size: int = 6561, output_size: int = 80, spk_embed_dim: int = 192
) -> dict[str, nn.Module]:
    """The flow's modules other than its decoder, under their official attribute names.

    ``input_size`` of the flow (the token embedding width) is the encoder's input_size.
    """
    return {
        "input_embedding": nn.Embedding(vocab_size, config.input_size),
        "spk_embed_affine_layer": nn.Linear(spk_embed_dim, output_size),
        "encoder": UpsampleConformerEncoder(config),
        "encoder_proj": nn.Linear(config.output_size, output_size),
    }


class TokenEncoder(nn.Module):
    """The four parts as one module (standalone use; a Flow module holds them itself)."""

    def __init__(
        self, config: FlowEncoderConfig, vocab_size: int = 6561, output_size: int = 80, spk_embed_dim: int = 192
    ) -> None:
        super().__init__()
        for name, module in build_token_encoder_parts(config, vocab_size, output_size, spk_embed_dim).items():
            self.add_module(name, module)


Parts = Mapping[str, nn.Module] | nn.Module


def token_encoder_part(parts: Parts, name: str) -> nn.Module:
    return parts[name] if isinstance(parts, Mapping) else getattr(parts, name)


def project_speaker(parts: Parts, embedding: Tensor) -> Tensor:
    """x-vector [B, 192] -> [B, 80]: L2-normalised, then the affine layer."""
    return token_encoder_part(parts, "spk_embed_affine_layer")(F.normalize(embedding, dim=1))


def embed_tokens(parts: Parts, ids: Tensor, lengths: Tensor, width: int) -> Tensor:
    """Token ids [B, L] -> encoder input frames [B, width, D]: token embedding, then the
    encoder's ``embed``; zero beyond each row's length (the official look-ahead padding)."""
    valid = (torch.arange(ids.size(1), device=ids.device)[None, :] < lengths[:, None])[..., None]
    embedded = token_encoder_part(parts, "input_embedding")(ids.clamp(min=0)) * valid
    frames = token_encoder_part(parts, "encoder").embed(embedded) * valid
    return F.pad(frames, (0, 0, 0, width - ids.size(1)))


def join_rows(
    prompt_token: Tensor, prompt_len: Tensor, token: Tensor, token_len: Tensor, width: int | None = None
) -> tuple[Tensor, Tensor]:
    """Per row, prompt tokens then new tokens, packed left: ([B, width], totals [B]), zero
    beyond each row's total. ``width``: at least the largest total, where the caller counted
    it (else it is read from the device, which waits for the work before it)."""
    joined = torch.cat([prompt_token, token], dim=1)
    lengths = prompt_len + token_len
    if width is None:
        width = int(lengths.max())
    slots = torch.arange(width, device=token.device)[None, :]
    source = torch.where(slots < prompt_len[:, None], slots, slots - prompt_len[:, None] + prompt_token.size(1))
    ids = joined.gather(1, source.clamp(max=joined.size(1) - 1))
    return ids.masked_fill(slots >= lengths[:, None], 0), lengths


def encode_tokens(
    parts: Parts,
    token: Tensor,
    token_len: Tensor,
    prompt_token: Tensor,
    prompt_token_len: Tensor,
    embedding: Tensor,
    streaming: bool = False,
    finalize: bool | Tensor = True,
    pre_lookahead_len: int = PRE_LOOKAHEAD_LEN,
    token_mel_ratio: int = UPSAMPLE_STRIDE,
) -> tuple[Tensor, Tensor, Tensor]:
    """The official flow inference up to the decoder, batched over padded rows.

    token [B, N] / token_len [B], prompt_token [B, P] / prompt_token_len [B]: each row
    is its prompt tokens followed by its new ones. finalize: one flag, or one per row
    [B]; where False, the row's last ``pre_lookahead_len`` tokens are look-ahead only.
    ``parts``: the four flow modules, as a mapping or attributes of a module.

    Returns mu [B, 80, T_mel] (prompt frames included, zero beyond ``mel_len``),
    mel_len [B] = token_mel_ratio * encoded tokens, and spk [B, 80].
    """
    encoder: UpsampleConformerEncoder = token_encoder_part(parts, "encoder")
    if pre_lookahead_len != encoder.pre_lookahead_len or token_mel_ratio != encoder.stride:
        raise ValueError("pre_lookahead_len / token_mel_ratio differ from the encoder's")
    ids, lengths = join_rows(prompt_token, prompt_token_len, token, token_len)
    finalize = torch.as_tensor(finalize, device=ids.device).expand(ids.size(0))
    encoded = (lengths - torch.where(finalize, 0, pre_lookahead_len)).clamp(min=0)
    return encode_joined(parts, ids, lengths, encoded, embedding, int(encoded.max()), streaming)


def encode_joined(
    parts: Parts, ids: Tensor, lengths: Tensor, encoded: Tensor, embedding: Tensor, width: int, streaming: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``encode_tokens`` of rows already joined (``join_rows``): ids ``[B, L]`` with ``lengths``
    [B] valid tokens each, of which the first ``encoded[b]`` are encoded (the rest are
    look-ahead), ``width`` >= every ``encoded[b]`` (a larger one pads, exactly: padded frames
    are masked). Reads nothing back from the device, so it can be captured in a CUDA graph.
    Returns mu [B, 80, stride x width], mel_len [B], spk [B, 80]."""
    encoder: UpsampleConformerEncoder = token_encoder_part(parts, "encoder")
    frames = embed_tokens(parts, ids, lengths, width + encoder.pre_lookahead_len)
    ys = encoder.forward_frames(frames, encoded, streaming).ys
    mel_len = encoded * encoder.stride
    return project_frames(parts, ys, mel_len), mel_len, project_speaker(parts, embedding)


def project_frames(parts: Parts, ys: Tensor, mel_len: Tensor) -> Tensor:
    """Encoder output [B, T, D] -> mu [B, 80, T], zero beyond each row's length."""
    valid = torch.arange(ys.size(1), device=ys.device)[None, :] < mel_len[:, None]
    return (token_encoder_part(parts, "encoder_proj")(ys) * valid[..., None]).transpose(1, 2)


# --- incremental streaming ------------------------------------------------------------


