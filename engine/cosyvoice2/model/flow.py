"""CosyVoice2 flow: speech tokens -> 80-bin mel at 50 Hz, by conditional flow matching.

Pipeline (all of it loads the released ``flow.pt`` strictly; parameter names and shapes
are those of the official ``CausalMaskedDiffWithXvec``):

1. the token encoder (``flow_encoder.py``) turns prompt tokens + new tokens into ``mu``,
   one 80-dim vector per mel frame (2 frames a token), and projects the speaker x-vector
   to 80 dims;
2. the decoder integrates the ODE dx/dt = v(x, t | mu, spk, cond) from Gaussian noise
   (t = 0) to mel (t = 1) with 10 Euler steps on a cosine time grid. ``cond`` holds the
   prompt mel in the prompt frames and zeros elsewhere: the model continues the prompt's
   voice. Each step evaluates the velocity twice in one batch, with and without the
   conditions, and extrapolates away from the unconditional one (classifier-free
   guidance, weight 0.7);
3. the velocity network (``Estimator``) is a 1-D U-Net without resampling: causal
   convolution ResNet blocks and transformer blocks, 1 down stage, 12 mid stages and
   1 up stage (4 transformer blocks each), time-conditioned through an MLP on a
   sinusoidal embedding of t.

Noise: the official decoder draws its starting noise once, at construction, as
``torch.randn(1, 80, 15000)`` after seeding the global RNG with 0, and every call uses
that tensor's first T frames. ``CFM.noise`` is the same tensor, drawn from a private
``torch.Generator`` seeded with 0 (so the global RNG is left alone); callers may pass
their own ``noise`` instead.

Attention masks are built with tensor ops only. The official helper checks for
all-masked rows with ``.item()``, a host sync that stalls the GPU and breaks CUDA-graph
capture; here the same rule (a query row that sees no key sees every key instead) is a
tensor ``|``. Masks are boolean ``[B, 1, Tq, Tk]``, shared by all heads, which SDPA
takes as they are. So the solve can be captured in CUDA graphs (``flow_graphs.py``, one
graph per Euler step replayed for every step, used through ``CFM.graphs``).

Chunk-causality and incremental streaming
----------------------------------------
In streaming mode the estimator's attention is chunk-causal: frame i sees frames
j < (i // 50 + 1) * 50 (static_chunk_size 50 frames = 25 tokens, all left chunks), and
every convolution is causal (kernel 3, left padding), everything else is per frame. The
Euler update is per frame too, and the unconditional CFG row has the same structure.
So at every step, x_t of frames before a chunk boundary S depends only on frames
before S: noise (always the same prefix of one fixed tensor), mu, cond and spk. The
token encoder is chunk-causal with the same boundaries (25 tokens -> 50 frames; its
3-token lookahead uses tokens that are then final). Hence, when tokens are appended,
the outputs of all frames before the last complete 50-frame chunk stay the same, in
every step and in the final mel, and the official way of streaming (re-run the whole
flow over prompt + all tokens so far for every 25-token chunk, so chunk k costs O(k))
can be replaced exactly by an incremental run that keeps, per Euler step and CFG row,
the attention keys/values and the 2-frame causal-conv left context of the committed
frames, and computes only the frames from the last chunk boundary on.

Measured on the tiny model (random weights, float32, mel values up to ~5; tests in
tests/test_cv2_flow.py):

- decoder alone, 100 vs 150 frames (streaming): estimator output / final mel of the
  2 complete chunks differ by 1.4e-6 / 9.5e-7, float rounding of differently shaped
  matmuls, i.e. identical; with 120 vs 150 frames the shorter run's partial chunk
  (frames 100..119, which gain keys in their own chunk) differs by 8.7e-2 / 1.0e-1;
- the official whole flow, 25 prompt tokens + 50 or 62 vs 87 new tokens (streaming,
  finalize=False): complete chunks 1.4e-6, the partial chunk 6.4e-2;
- non-streaming mode (full attention): every frame changes, 0.11..0.32; no reuse;
- ``Flow.inference_chunk`` vs. the official full re-run, streamed chunk by chunk
  (the official padded-first-hop chunking, arbitrary hop sizes, empty prompt, two
  sessions batched): max abs diff <= 2.4e-6.

Cost of the cache: per committed frame and per Euler step and CFG row it holds K and V
of every attention layer (56 layers x 2 x 512 values at full size), so 10 steps x 2
rows x 56 x 1024 x 4 bytes = 4.6 MB per frame in float32 (2.3 MB in bf16): about 3 GB
(1.5 GB) for 3 s of prompt + 10 s of speech. The token encoder streams the same way
(``flow_encoder.IncrementalEncoder``), so a chunk costs the same at any position apart
from attending over the cached keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.cosyvoice2.model.flow_encoder import (
    EncoderStreamState,
    IncrementalEncoder,
    build_token_encoder_parts,
    encode_tokens,
    project_speaker,
)
from engine.cosyvoice2.modeldir.configs import CFMConfig, EstimatorConfig, FlowConfig

if TYPE_CHECKING:
    from engine.cosyvoice2.serving.flow_graphs import FlowGraphs

# The official flow always integrates with 10 Euler steps.
N_TIMESTEPS = 10
# Seed and frame count of the official decoder's fixed noise (50 Hz x 300 s).
NOISE_SEED = 0
NOISE_FRAMES = 50 * 300


# ----------------------------------------------------------------------------- masks


def chunk_attention_mask(
    key_valid: Tensor, query_pos: Tensor, chunk_size: int, key_pos: Tensor | None = None
) -> Tensor:
    """Boolean attention mask ``[B, 1, Tq, Tk]`` (True = may attend), built without host syncs.

    key_valid: ``[B, Tk]``, True for real (non-padding) key frames.
    query_pos: ``[B or 1, Tq]`` absolute frame index of each query.
    key_pos: ``[B or 1, Tk]`` absolute frame index of each key (default: key j is frame j).
    chunk_size: > 0: query i sees keys j < (i // chunk_size + 1) * chunk_size (its own
    chunk and all chunks before it); 0: every real key.

    A query row left with no visible key (only when a row has no real frame) sees every
    key instead, as in the official helper; otherwise softmax would give NaN there.
    """
    allowed = key_valid[:, None, :]
    if chunk_size > 0:
        chunk_end = (torch.div(query_pos, chunk_size, rounding_mode="floor") + 1) * chunk_size
        if key_pos is None:
            key_pos = torch.arange(key_valid.shape[1], device=key_valid.device)[None]
        allowed = allowed & (key_pos[:, None, :] < chunk_end[:, :, None])
    else:
        allowed = allowed.expand(-1, query_pos.shape[1], -1)
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
    return allowed[:, None]


def attention_bias(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask as SDPA's additive form: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


# ----------------------------------------------------------------------------- stream cache


class CFMStreamCache:
    """Decoder state of streaming sessions (``CFM.forward_chunk``): what committed frames leave behind.

    For every Euler step and every CFG row (cond rows then uncond rows, ``2B`` in all) it
    keeps the attention keys/values of the committed frames and, for every causal
    convolution, its input at the last ``kernel - 1`` committed frames. Committed frames
    are whole 50-frame chunks (prompt included) whose states no later token can change.

    Rows are sessions; every call must pass the same sessions in the same order.
    Storage is allocated on the first call and grows by whole chunks.
    """

    def __init__(self) -> None:
        self.committed: list[int] = []  # per session: frames whose states are stored
        self.capacity = 0  # frames the key/value buffers can hold
        self.keys: list[Tensor] = []  # [step * n_attention + layer] -> [2B, heads, capacity, head_dim]
        self.values: list[Tensor] = []
        self.conv_context: list[Tensor] = []  # [step * n_conv + conv] -> [2B, channels, kernel - 1]

    @property
    def started(self) -> bool:
        return bool(self.committed)


class _StepView:
    """The cache as one estimator call sees it: one Euler step, new frames at per-row offsets.

    start: ``[2B]`` first new frame of each row (its committed count, a chunk boundary);
    commit: ``[2B]`` how many of the new frames this call commits; key_len: keys to
    attend over (max of start + new frames).
    """

    def __init__(
        self,
        cache: CFMStreamCache,
        step: int,
        start: Tensor,
        commit: Tensor,
        key_len: int,
        n_attention: int,
        n_conv: int,
    ) -> None:
        self.cache = cache
        self.start = start
        self.commit = commit
        self.key_len = key_len
        self.attention_base = step * n_attention
        self.conv_base = step * n_conv

    def conv_input(self, slot: int, x: Tensor) -> Tensor:
        """``x`` with its stored left context prepended; stores the context for the next call."""
        index = self.conv_base + slot
        extended = torch.cat([self.cache.conv_context[index], x], dim=2)
        context = self.cache.conv_context[index].shape[2]
        # extended[:, :, e] is frame start - context + e, so the frames just before
        # start + commit are extended[:, :, commit : commit + context].
        take = self.commit[:, None, None] + torch.arange(context, device=x.device)
        self.cache.conv_context[index] = extended.gather(2, take.expand(-1, x.shape[1], -1))
        return extended

    def attention_mask(self, new_frames: Tensor, positions: Tensor, chunk: int) -> Tensor:
        """The chunk mask of the new frames (queries) over the cached and new frames (keys)."""
        key_pos = torch.arange(self.key_len, device=positions.device)
        key_valid = key_pos < (self.start + new_frames)[:, None]
        return chunk_attention_mask(key_valid, self.start[:, None] + positions, chunk)

    def keys_values(self, slot: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Writes the new frames' keys/values at their absolute positions; returns all of them.

        Positions past a row's committed frames are scratch: masked out now and
        overwritten by the next call.
        """
        index = self.attention_base + slot
        positions = self.start[:, None] + torch.arange(key.shape[2], device=key.device)
        positions = positions[:, None, :, None].expand_as(key)
        self.cache.keys[index].scatter_(2, positions, key)
        self.cache.values[index].scatter_(2, positions, value)
        return self.cache.keys[index][:, :, : self.key_len], self.cache.values[index][:, :, : self.key_len]


@dataclass(frozen=True)
class VoicePrefix:
    """The decoder's state after a voice's prompt: what every utterance in that voice shares.

    The prompt's complete 50-frame chunks (those whose tokens and look-ahead are all
    prompt tokens) come out of every streaming flow call the same: same tokens, same
    prompt mel, same x-vector, same noise, and chunk-causal attention keeps them blind to
    what follows. So a streaming call may start its decoder after them, attending to
    their stored keys/values. Layout as ``CFMStreamCache`` with two rows (conditioned,
    unconditioned): ``keys[step * n_attention + layer]`` ``[2, heads, frames, head_dim]``,
    ``conv_context[step * n_conv + conv]`` ``[2, channels, kernel - 1]``.
    """

    frames: int
    keys: list[Tensor]
    values: list[Tensor]
    conv_context: list[Tensor]


class PrefixBank:
    """Voice prefixes in fixed tensors, one slot per voice: what batched calls read.

    ``keys[layer]`` is ``[steps, slots, 2, heads, frames, head_dim]`` (Euler step, slot, then
    the prefix's two rows), zero past a slot's own prefix; ``conv_context[conv]`` likewise
    ``[steps, slots, 2, channels, kernel - 1]``; ``start[slot]`` is the slot's prefix length
    (0 while empty). The step is an index, not a list position, so that one CUDA graph of an
    Euler step reads every step's state (flow_graphs). ``put`` writes in place, so such a graph
    stays valid as voices come and go.
    """

    def __init__(self, cfm: CFM, slots: int, frames: int, like: Tensor) -> None:
        if slots < 1 or frames < 0:
            raise ValueError(f"a prefix bank needs >= 1 slot and >= 0 frames, got {slots}, {frames}")
        self.slots = slots
        self.frames = frames
        self.n_attention = len(cfm.estimator.attention_layers)
        self.n_conv = len(cfm.estimator.causal_convs)
        self.keys = [
            like.new_zeros(N_TIMESTEPS, slots, 2, layer.heads, frames, layer.head_dim)
            for layer in cfm.estimator.attention_layers
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.conv_context = [
            like.new_zeros(N_TIMESTEPS, slots, 2, conv.in_channels, conv.context) for conv in cfm.estimator.causal_convs
        ]
        self.start = torch.zeros(slots, dtype=torch.long, device=like.device)

    def put(self, slot: int, prefix: VoicePrefix) -> None:
        if prefix.frames > self.frames:
            raise ValueError(f"a prefix of {prefix.frames} frames does not fit a bank of {self.frames}")
        for bank, stored in ((self.keys, prefix.keys), (self.values, prefix.values)):
            for index, part in enumerate(stored):
                step, layer = divmod(index, self.n_attention)
                bank[layer][step, slot].zero_()
                bank[layer][step, slot, :, :, : prefix.frames] = part
        for index, part in enumerate(prefix.conv_context):
            step, conv = divmod(index, self.n_conv)
            self.conv_context[conv][step, slot] = part
        self.start[slot] = prefix.frames

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *self.conv_context))


class PrefixView:
    """One Euler step of a batch whose rows start after their voices' prefixes (read-only).

    ``slots[r]``: the bank slot of row r's voice (rows are sessions; CFG doubles them, the
    conditioned half first, as in ``CFM.solve``). Every shape depends on the bank and the
    batch only, not on the values, and the step may be a device tensor, so one CUDA graph
    can hold this view for every step.
    """

    def __init__(self, bank: PrefixBank, slots: Tensor) -> None:
        self.bank = bank
        self.step: int | Tensor = 0
        self.slot_of_row = slots.repeat(2)
        self.start = bank.start[self.slot_of_row]
        # Row i of the 2B-row batch takes row `branch[i]` (0 conditioned, 1 not) of its slot.
        self.branch = torch.arange(2, device=slots.device).repeat_interleave(len(slots))

    def at_step(self, step: int | Tensor) -> PrefixView:
        """This view for Euler step ``step``: an int, or a one-element device tensor."""
        self.step = step
        return self

    def _rows(self, stored: Tensor) -> Tensor:
        """Each batch row's part of a bank tensor at this step."""
        step = self.step if isinstance(self.step, int) else self.step.expand(len(self.slot_of_row))
        return stored[step, self.slot_of_row, self.branch]

    def attention_mask(self, new_frames: Tensor, positions: Tensor, chunk: int) -> Tensor:
        """Queries: the new frames, at start + i. Keys: the bank's frames (j, valid below the
        row's own prefix length), then the new frames."""
        start = self.start
        prefix_pos = torch.arange(self.bank.frames, device=positions.device)
        key_pos = torch.cat([prefix_pos.expand(len(start), -1), start[:, None] + positions], dim=1)
        key_valid = torch.cat([prefix_pos < start[:, None], positions < new_frames[:, None]], dim=1)
        return chunk_attention_mask(key_valid, start[:, None] + positions, chunk, key_pos)

    def keys_values(self, slot: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.bank.keys[slot], self.bank.values[slot]
        return torch.cat([self._rows(keys), key], dim=2), torch.cat([self._rows(values), value], dim=2)

    def conv_input(self, slot: int, x: Tensor) -> Tensor:
        return torch.cat([self._rows(self.bank.conv_context[slot]), x], dim=2)


# ----------------------------------------------------------------------------- estimator layers


class CausalConv1d(nn.Conv1d):
    """Conv1d that sees only the current and past frames (left zero padding, or cached context)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.context = kernel_size - 1
        self.cache_slot = -1  # set by Estimator

    def forward(self, x: Tensor, view: _StepView | PrefixView | None = None) -> Tensor:
        if view is None:
            x = F.pad(x, (self.context, 0))
        else:
            x = view.conv_input(self.cache_slot, x)
        return super().forward(x)


class CausalBlock(nn.Module):
    """Causal conv -> LayerNorm over channels -> Mish, on masked input and output."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        # Indices follow the official Sequential (conv, transpose, norm, transpose, mish),
        # whose parameters are stored as block.0.* and block.2.*.
        self.block = nn.ModuleList([CausalConv1d(dim, dim_out, 3), nn.Identity(), nn.LayerNorm(dim_out)])

    def forward(self, x: Tensor, mask: Tensor, view: _StepView | PrefixView | None) -> Tensor:
        conv, _, norm = self.block
        h = conv(x * mask, view)
        h = norm(h.transpose(1, 2)).transpose(1, 2)
        return F.mish(h) * mask


class ResnetBlock(nn.Module):
    """Two causal blocks with the time embedding added between them, plus a 1x1 skip."""

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock(dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, time_emb: Tensor, view: _StepView | PrefixView | None) -> Tensor:
        h = self.block1(x, mask, view)
        h = h + self.mlp(time_emb)[:, :, None]
        h = self.block2(h, mask, view)
        return h + self.res_conv(x * mask)


class SelfAttention(nn.Module):
    """Multi-head self-attention with diffusers' ``Attention`` parameter names."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.cache_slot = -1  # set by Estimator

    def forward(self, x: Tensor, mask: Tensor, view: _StepView | PrefixView | None) -> Tensor:
        batch, frames, _ = x.shape

        def heads(h: Tensor) -> Tensor:
            return h.view(batch, frames, self.heads, self.head_dim).transpose(1, 2)

        query, key, value = heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x))
        if view is not None:
            key, value = view.keys_values(self.cache_slot, key, value)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        return self.to_out[0](out.transpose(1, 2).reshape(batch, frames, self.heads * self.head_dim))


class GeluProjection(nn.Module):
    """Linear then GELU (diffusers' ``GELU`` activation module)."""

    def __init__(self, dim_in: int, dim_out: int, approximate: str) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x), approximate=self.approximate)


class FeedForward(nn.Module):
    def __init__(self, dim: int, act_fn: str, mult: int = 4) -> None:
        super().__init__()
        approximations = {"gelu": "none", "gelu-approximate": "tanh"}
        if act_fn not in approximations:
            raise ValueError(f"unsupported act_fn {act_fn!r} (CosyVoice2 uses 'gelu')")
        # Index 1 held the official dropout; the output projection is stored as net.2.
        self.net = nn.ModuleList(
            [GeluProjection(dim, dim * mult, approximations[act_fn]), nn.Identity(), nn.Linear(dim * mult, dim)]
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](self.net[0](x))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention and feed-forward, each with a residual (matcha's ``BasicTransformerBlock``)."""

    def __init__(self, dim: int, heads: int, head_dim: int, act_fn: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, act_fn)

    def forward(self, x: Tensor, mask: Tensor, view: _StepView | PrefixView | None) -> Tensor:
        x = x + self.attn1(self.norm1(x), mask, view)
        return x + self.ff(self.norm3(x))


class TimestepMLP(nn.Module):
    def __init__(self, in_channels: int, time_embed_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def sinusoidal_embedding(t: Tensor, dim: int, scale: float = 1000.0) -> Tensor:
    """``[B] -> [B, dim]``: sin then cos of scale * t at dim / 2 geometric frequencies 1 .. 1e-4."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angles = scale * t[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


# ----------------------------------------------------------------------------- estimator


class Estimator(nn.Module):
    """The velocity network v(x, t | mu, spk, cond): a causal 1-D U-Net with transformer stages.

    Parameter names follow the official ``CausalConditionalDecoder``: ``down_blocks.0`` /
    ``mid_blocks.i`` / ``up_blocks.0`` are ``[resnet, transformer blocks(, causal conv)]``.
    Only one resolution level is supported (``channels`` of length 1, as in CosyVoice2):
    the official multi-level variant resamples with non-causal convolutions.
    """

    def __init__(self, config: EstimatorConfig) -> None:
        super().__init__()
        if len(config.channels) != 1:
            raise ValueError(f"only one U-Net level is supported, got channels={config.channels}")
        self.config = config
        dim = config.channels[0]
        time_dim = dim * 4

        def transformers() -> nn.ModuleList:
            return nn.ModuleList(
                TransformerBlock(dim, config.num_heads, config.attention_head_dim, config.act_fn)
                for _ in range(config.n_blocks)
            )

        self.time_mlp = TimestepMLP(config.in_channels, time_dim)
        self.down_blocks = nn.ModuleList(
            [nn.ModuleList([ResnetBlock(config.in_channels, dim, time_dim), transformers(), CausalConv1d(dim, dim, 3)])]
        )
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([ResnetBlock(dim, dim, time_dim), transformers()]) for _ in range(config.num_mid_blocks)
        )
        # The up stage takes the down stage's output concatenated to the mid stages' output.
        self.up_blocks = nn.ModuleList(
            [nn.ModuleList([ResnetBlock(2 * dim, dim, time_dim), transformers(), CausalConv1d(dim, dim, 3)])]
        )
        self.final_block = CausalBlock(dim, dim)
        self.final_proj = nn.Conv1d(dim, config.out_channels, 1)

        self.attention_layers = [m for m in self.modules() if isinstance(m, SelfAttention)]
        self.causal_convs = [m for m in self.modules() if isinstance(m, CausalConv1d)]
        for slot, layer in enumerate(self.attention_layers):
            layer.cache_slot = slot
        for slot, conv in enumerate(self.causal_convs):
            conv.cache_slot = slot

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool = False,
        view: _StepView | PrefixView | None = None,
    ) -> Tensor:
        """x, mu, cond: ``[B, 80, T]``; mask: ``[B, 1, T]`` (1 = real frame); t: ``[B]``; spks: ``[B, 80]``.

        With ``view``, the T frames are new frames at per-row offsets ``view.start`` and
        attend to (and extend) the cached earlier frames; streaming mode only.
        """
        time_emb = self.time_mlp(sinusoidal_embedding(t, self.config.in_channels).to(t.dtype))
        frames = x.shape[2]
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, frames), cond], dim=1)
        chunk = self.config.static_chunk_size if streaming else 0
        positions = torch.arange(frames, device=x.device)
        if view is None:
            attn_mask = chunk_attention_mask(mask[:, 0] > 0, positions[None], chunk)
        else:
            if chunk <= 0:
                raise ValueError("cached (incremental) estimation needs the streaming chunk mask")
            attn_mask = view.attention_mask(mask[:, 0].sum(dim=1, dtype=torch.long), positions, chunk)
        # One additive bias for every attention layer. Given the boolean mask, SDPA would build
        # this bias itself in each of its calls: on the H200 that was 5-13% of a solve
        # (bench/flow_profile.py). The scores come out bit for bit the same.
        attn_mask = attention_bias(attn_mask, x.dtype)

        def transform(h: Tensor, blocks: nn.ModuleList) -> Tensor:
            h = h.transpose(1, 2)
            for block in blocks:
                h = block(h, attn_mask, view)
            return h.transpose(1, 2)

        resnet, blocks, conv = self.down_blocks[0]
        skip = transform(resnet(h, mask, time_emb, view), blocks)
        h = conv(skip * mask, view)
        for resnet, blocks in self.mid_blocks:
            h = transform(resnet(h, mask, time_emb, view), blocks)
        resnet, blocks, conv = self.up_blocks[0]
        h = transform(resnet(torch.cat([h, skip], dim=1), mask, time_emb, view), blocks)
        h = conv(h * mask, view)
        h = self.final_block(h, mask, view)
        return self.final_proj(h * mask) * mask


# ----------------------------------------------------------------------------- flow matching


class CFM(nn.Module):
    """Euler ODE solver with classifier-free guidance around the ``Estimator`` (``decoder`` in flow.pt)."""

    def __init__(self, config: CFMConfig) -> None:
        super().__init__()
        if config.cfm_params.solver != "euler":
            raise ValueError(f"only the euler solver is supported, got {config.cfm_params.solver!r}")
        self.config = config
        self.estimator = Estimator(config.estimator)
        generator = torch.Generator().manual_seed(NOISE_SEED)
        noise = torch.randn(1, config.estimator.out_channels, NOISE_FRAMES, generator=generator)
        # Not a parameter of the checkpoint: kept out of the state dict, moved with .to().
        self.register_buffer("noise", noise, persistent=False)
        # CUDA graphs of the solve (flow_graphs.FlowGraphs), set by the engine after capture.
        self.graphs: FlowGraphs | None = None

    def time_grid(self, n_timesteps: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        t_span = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
        if self.config.cfm_params.t_scheduler == "cosine":
            t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        return t_span

    def step_times(self, n_timesteps: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``[n_timesteps, 2]``: each Euler step's t and dt, accumulated as the official solver
        does (t += dt, then dt from the grid), in ``dtype``."""
        t_span = self.time_grid(n_timesteps, device, dtype)
        t, dt = t_span[0], t_span[1] - t_span[0]
        rows = []
        for step in range(n_timesteps):
            rows.append(torch.stack([t, dt]))
            t = t + dt
            if step + 1 < n_timesteps:
                dt = t_span[step + 2] - t
        return torch.stack(rows)

    @staticmethod
    def cfg_rows(mask: Tensor, mu: Tensor, spks: Tensor, cond: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The estimator's ``2B`` rows: the conditioned ones, then the same with mu, spks and cond zeroed."""
        return (
            torch.cat([mask, mask]),
            torch.cat([mu, torch.zeros_like(mu)]),
            torch.cat([spks, torch.zeros_like(spks)]),
            torch.cat([cond, torch.zeros_like(cond)]),
        )

    def euler_step(
        self,
        x: Tensor,
        step: int | Tensor,
        times: Tensor,
        rows: tuple[Tensor, Tensor, Tensor, Tensor],
        streaming: bool,
        view: _StepView | PrefixView | None = None,
    ) -> Tensor:
        """``x`` ``[B, 80, T]`` after Euler step ``step`` of ``times`` (``step_times``); ``rows``
        from ``cfg_rows``. ``step`` may be a one-element device tensor: it is then read on the
        device, so one CUDA graph of this call serves every step (flow_graphs)."""
        t, dt = times[step] if isinstance(step, int) else times.index_select(0, step)[0]
        mask_in, mu_in, spks_in, cond_in = rows
        velocity = self.estimator(
            torch.cat([x, x]), mask_in, mu_in, t.expand(mask_in.shape[0]), spks_in, cond_in, streaming, view
        )
        conditioned, unconditioned = velocity.chunk(2)
        cfg_rate = self.config.cfm_params.inference_cfg_rate
        return x + dt * ((1.0 + cfg_rate) * conditioned - cfg_rate * unconditioned)

    def solve(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool,
        n_timesteps: int = N_TIMESTEPS,
        view_for_step: Callable[[int], _StepView | PrefixView | None] = lambda step: None,
    ) -> Tensor:
        """Integrates from noise ``x`` ``[B, 80, T]`` to mel; returns float32 ``[B, 80, T]``.

        Rows are independent: the estimator runs on ``2B`` rows, the conditioned ones
        then the same rows with mu, spks and cond zeroed.
        """
        times = self.step_times(n_timesteps, mu.device, mu.dtype)
        rows = self.cfg_rows(mask, mu, spks, cond)
        for step in range(n_timesteps):
            x = self.euler_step(x, step, times, rows, streaming, view_for_step(step))
        return x.float()

    def forward(
        self,
        mu: Tensor,
        mask: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool = False,
        noise: Tensor | None = None,
        n_timesteps: int = N_TIMESTEPS,
        graphs: FlowGraphs | None = None,
    ) -> Tensor:
        """Mel ``[B, 80, T]`` for mu/cond ``[B, 80, T]``, mask ``[B, 1, T]``, spks ``[B, 80]``.

        noise: ``[1 or B, 80, >= T]``, sliced to its first T frames (default: ``self.noise``).
        With ``graphs`` (default: ``self.graphs``), a CUDA call with the default noise and step
        count replays the captured graphs of the solve when they exist for its shape bucket.
        """
        frames = mu.shape[2]
        graphs = graphs if graphs is not None else self.graphs
        if noise is None:
            if graphs is not None and n_timesteps == N_TIMESTEPS and mu.is_cuda:
                mel = graphs.run(mu, mask, spks, cond, streaming)
                if mel is not None:
                    return mel
            noise = self.noise
        x = noise[:, :, :frames].to(mu.dtype).expand(mu.shape[0], -1, -1)
        return self.solve(x, mask, mu, spks, cond, streaming, n_timesteps)

    # -- streaming after a shared voice prefix

    def voice_prefix(self, mu: Tensor, spks: Tensor, cond: Tensor, frames: int) -> VoicePrefix:
        """The decoder state after the first ``frames`` frames (whole chunks) of one voice.

        mu, cond: ``[1, 80, >= frames]`` for the voice's prompt frames; spks ``[1, 80]``.
        """
        chunk = self.config.estimator.static_chunk_size
        if chunk <= 0 or frames % chunk or frames > mu.shape[2]:
            raise ValueError(f"a voice prefix is whole {chunk}-frame chunks within the prompt, got {frames}")
        if frames == 0:  # nothing shared: no keys, and the zero left context of a causal conv
            layers = self.estimator.attention_layers * N_TIMESTEPS
            return VoicePrefix(
                frames=0,
                keys=[mu.new_zeros(2, layer.heads, 0, layer.head_dim) for layer in layers],
                values=[mu.new_zeros(2, layer.heads, 0, layer.head_dim) for layer in layers],
                conv_context=self._zero_conv_context(2, mu),
            )
        cache = CFMStreamCache()
        mask = mu.new_ones(1, 1, frames)
        noise = self.noise[:, :, :frames]
        self.forward_chunk(cache, mu[:, :, :frames], mask, spks, cond[:, :, :frames], noise, [0], [frames])
        return VoicePrefix(
            frames=frames,
            keys=[k[:, :, :frames].clone() for k in cache.keys],
            values=[v[:, :, :frames].clone() for v in cache.values],
            conv_context=cache.conv_context,
        )

    def solve_after(self, bank: PrefixBank, slots: Tensor, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        """Streaming-mode mel of the frames after each row's voice prefix.

        Row b's voice prefix is in ``bank`` slot ``slots[b]``, and its column i is frame
        ``bank.start[slots[b]] + i``: mu, cond ``[B, 80, n]``, mask ``[B, 1, n]``. Equals the
        same frames of a whole streaming solve (the prefix frames' states are the stored
        ones), with the fixed noise. With ``graphs`` set, a CUDA call replays a captured
        graph when one exists for its shape bucket.
        """
        if self.graphs is not None and mu.is_cuda:
            mel = self.graphs.run_after_prefix(slots, mu, mask, spks, cond)
            if mel is not None:
                return mel
        return self.solve_after_eager(bank, slots, mu, mask, spks, cond)

    def noise_after(self, bank: PrefixBank, slots: Tensor, frames: int) -> Tensor:
        """The fixed noise of ``frames`` frames after each row's voice prefix: ``[B, 80, frames]``."""
        noise = self.noise[:, :, : bank.frames + frames].expand(len(slots), -1, -1)
        return _gather_frames(noise, bank.start[slots], frames)

    def solve_after_eager(
        self, bank: PrefixBank, slots: Tensor, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor
    ) -> Tensor:
        """``solve_after`` without graphs (and what its graphs capture)."""
        view = PrefixView(bank, slots)
        return self.solve(self.noise_after(bank, slots, mu.shape[2]).to(mu.dtype), mask, mu, spks, cond, True,
                          N_TIMESTEPS, view.at_step)

    # -- incremental (streaming) decoding

    def _zero_conv_context(self, rows: int, like: Tensor) -> list[Tensor]:
        """Every causal conv's left context at the start of a sequence (its zero padding),
        per Euler step: ``[step * n_conv + conv]`` -> ``[rows, channels, kernel - 1]``."""
        return [
            like.new_zeros(rows, conv.in_channels, conv.context)
            for _ in range(N_TIMESTEPS)
            for conv in self.estimator.causal_convs
        ]

    def allocate_cache(self, cache: CFMStreamCache, sessions: int, frames: int, like: Tensor) -> None:
        """Grows ``cache`` (``sessions`` rows) so it can hold ``frames`` frames; keeps its contents."""
        chunk = self.config.estimator.static_chunk_size
        rows = 2 * sessions
        if not cache.started:
            cache.committed = [0] * sessions
            cache.conv_context = self._zero_conv_context(rows, like)
        elif len(cache.committed) != sessions:
            raise ValueError(f"cache holds {len(cache.committed)} sessions, call has {sessions}")
        if frames <= cache.capacity:
            return
        capacity = -(-frames // chunk) * chunk + 2 * chunk  # whole chunks, with room for two more

        def grown(old: Tensor | None, layer: SelfAttention) -> Tensor:
            new = like.new_zeros(rows, layer.heads, capacity, layer.head_dim)
            if old is not None:
                new[:, :, : cache.capacity] = old
            return new

        layers = self.estimator.attention_layers * N_TIMESTEPS
        old_keys = cache.keys or [None] * len(layers)
        old_values = cache.values or [None] * len(layers)
        cache.keys = [grown(old, layer) for old, layer in zip(old_keys, layers)]
        cache.values = [grown(old, layer) for old, layer in zip(old_values, layers)]
        cache.capacity = capacity

    def forward_chunk(
        self,
        cache: CFMStreamCache,
        mu: Tensor,
        mask: Tensor,
        spks: Tensor,
        cond: Tensor,
        noise: Tensor,
        start: list[int],
        commit: list[int],
        n_timesteps: int = N_TIMESTEPS,
    ) -> Tensor:
        """Mel of new frames only (streaming mode), reusing and extending ``cache``.

        mu, cond, noise: ``[B, 80, n]`` for the new frames, row b's frame i being frame
        ``start[b] + i`` of the sequence; mask ``[B, 1, n]``; ``start[b]`` must equal the
        cache's committed count; ``commit[b]`` (a multiple of the chunk size, or 0) new
        frames become committed.
        """
        if n_timesteps != N_TIMESTEPS:
            raise ValueError(f"the stream cache is laid out for {N_TIMESTEPS} steps")
        if list(start) != (cache.committed if cache.started else [0] * len(start)):
            raise ValueError(f"new frames start at {start}, cache has {cache.committed} committed")
        sessions, _, frames = mu.shape
        self.allocate_cache(cache, sessions, max(start) + frames, mu)
        new_frames = mask[:, 0].sum(dim=1).tolist()
        key_len = max(s + int(n) for s, n in zip(start, new_frames))
        start_rows = torch.tensor(start + start, device=mu.device)
        commit_rows = torch.tensor(commit + commit, device=mu.device)
        n_attention = len(self.estimator.attention_layers)
        n_conv = len(self.estimator.causal_convs)

        def view_for_step(step: int) -> _StepView:
            return _StepView(cache, step, start_rows, commit_rows, key_len, n_attention, n_conv)

        mel = self.solve(noise.to(mu.dtype), mask, mu, spks, cond, True, n_timesteps, view_for_step)
        cache.committed = [s + c for s, c in zip(start, commit)]
        return mel


# ----------------------------------------------------------------------------- the whole flow


class FlowStreamCache:
    """State of a group of streaming sessions for ``Flow.inference_chunk`` (row b = session b).

    Holds each session's incremental token-encoder state, the decoder's per-step cache,
    how many tokens (prompt included) were consumed and how many mel frames (prompt
    included) were returned. Every call passes the same sessions in the same order.
    """

    def __init__(self) -> None:
        self.encoder: list[EncoderStreamState] = []
        self.decoder = CFMStreamCache()
        self.tokens_seen: list[int] = []
        self.emitted: list[int] = []

    @property
    def started(self) -> bool:
        return bool(self.encoder)


def _gather_frames(x: Tensor, start: Tensor, frames: int) -> Tensor:
    """``[B, C, T]`` -> ``[B, C, frames]``: row b's columns start[b], start[b] + 1, ... (clamped to T - 1)."""
    columns = (start[:, None] + torch.arange(frames, device=x.device)).clamp(max=max(x.shape[2] - 1, 0))
    return x.gather(2, columns[:, None, :].expand(-1, x.shape[1], -1))


class Flow(nn.Module):
    """Speech tokens + prompt (tokens, mel, x-vector) -> mel of the new tokens; loads ``flow.pt`` strictly."""

    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        if config.input_size != config.encoder.input_size:
            raise ValueError("input_size must equal encoder.input_size")
        self.config = config
        parts = build_token_encoder_parts(config.encoder, config.vocab_size, config.output_size, config.spk_embed_dim)
        self.input_embedding = parts["input_embedding"]
        self.spk_embed_affine_layer = parts["spk_embed_affine_layer"]
        self.encoder = parts["encoder"]
        self.encoder_proj = parts["encoder_proj"]
        self.decoder = CFM(config.decoder)

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        token_len: Tensor,
        prompt_token: Tensor,
        prompt_token_len: Tensor,
        prompt_feat: Tensor,
        prompt_feat_len: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
        noise: Tensor | None = None,
        graphs: FlowGraphs | None = None,
    ) -> Tensor:
        """Mel ``[B, 80, T_new]`` of the new tokens (prompt frames cut off), as the official ``inference``.

        For B > 1 rows are zero-padded on the right; ``inference_batch`` also gives their lengths.
        """
        return self.inference_batch(
            token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, embedding, streaming,
            finalize, noise, graphs=graphs,
        )[0]

    @torch.inference_mode()
    def inference_batch(
        self,
        token: Tensor,
        token_len: Tensor,
        prompt_token: Tensor,
        prompt_token_len: Tensor,
        prompt_feat: Tensor,
        prompt_feat_len: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool | Tensor,
        noise: Tensor | None = None,
        after_prefix: tuple[PrefixBank, Tensor] | None = None,
        graphs: FlowGraphs | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Batched ``inference``: every row equals running it alone.

        token ``[B, N]`` / token_len ``[B]``; prompt_token ``[B, P]`` / prompt_token_len;
        prompt_feat ``[B, Tp, 80]`` / prompt_feat_len (= 2 x prompt tokens); embedding
        ``[B, 192]``. finalize (one flag, or one per row): where False, the last
        ``pre_lookahead_len`` tokens are held back as look-ahead. noise: ``[1 or B, 80,
        >= frames]`` (default: the official fixed noise). after_prefix (streaming only): a
        ``PrefixBank`` and each row's slot in it, ``[B]``; the decoder starts after each
        row's voice prefix instead of at frame 0, which gives the same mel for less work.
        graphs (not with after_prefix): the CUDA graphs to replay instead of the decoder's
        own, e.g. a second worker thread's. Returns mel ``[B, 80, max new frames]`` (float32)
        and the new frame counts ``[B]``.
        """
        config = self.config
        mu, mel_len, spk = encode_tokens(
            self, token, token_len, prompt_token, prompt_token_len, embedding, streaming, finalize,
            config.pre_lookahead_len, config.token_mel_ratio,
        )
        frames = mu.shape[2]
        positions = torch.arange(frames, device=mu.device)
        mask = (positions < mel_len[:, None])[:, None].to(mu.dtype)
        prompt_feat_len = prompt_feat_len.to(mu.device)
        new_len = (mel_len - prompt_feat_len).clamp(min=0)
        if after_prefix is not None:
            if not streaming or noise is not None or graphs is not None:
                raise ValueError("voice prefixes serve streaming calls with the fixed noise and the decoder's graphs")
            bank, slots = after_prefix
            # The decoder starts after each row's prefix: row b's column i is frame start[b] + i.
            start = bank.start[slots]
            width = int((mel_len - start).max())
            mask = (torch.arange(width, device=mu.device) < (mel_len - start)[:, None])[:, None].to(mu.dtype)
            cond = self._prompt_condition(prompt_feat, prompt_feat_len, start, width)
            mel = self.decoder.solve_after(bank, slots, _gather_frames(mu, start, width) * mask, mask, spk, cond)
            return self._rows(mel, prompt_feat_len - start, new_len), new_len
        cond = self._prompt_condition(prompt_feat, prompt_feat_len, torch.zeros_like(prompt_feat_len), frames)
        mel = self.decoder(mu, mask, spk, cond, streaming, noise, graphs=graphs)
        return self._rows(mel, prompt_feat_len, new_len), new_len

    def voice_prefix_frames(self, prompt_tokens: int) -> int:
        """The length of a voice prefix for a prompt of this many tokens (see ``voice_prefix``)."""
        config = self.config
        chunk_tokens = config.encoder.static_chunk_size
        return max(0, prompt_tokens - config.pre_lookahead_len) // chunk_tokens * chunk_tokens * config.token_mel_ratio

    @torch.inference_mode()
    def voice_prefix(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> VoicePrefix:
        """The decoder state every streaming call of this voice shares (see ``VoicePrefix``):
        the prompt's whole chunks whose tokens and look-ahead are all prompt tokens (none
        when the prompt is shorter than one such chunk).

        prompt_token ``[1, P]``, prompt_feat ``[1, 2P, 80]``, embedding ``[1, 192]``.
        """
        config = self.config
        length = torch.tensor([prompt_token.shape[1]], device=prompt_token.device)
        mu, _, spk = encode_tokens(
            self, prompt_token, length, prompt_token[:, :0], torch.zeros_like(length), embedding, True, False,
            config.pre_lookahead_len, config.token_mel_ratio,
        )
        frames = self.voice_prefix_frames(prompt_token.shape[1])
        feat_len = torch.tensor([prompt_feat.shape[1]], device=mu.device)
        cond = self._prompt_condition(prompt_feat, feat_len, torch.zeros_like(feat_len), frames)
        return self.decoder.voice_prefix(mu, spk, cond, frames)

    @torch.inference_mode()
    def inference_chunk(
        self,
        cache: FlowStreamCache,
        token: Tensor,
        token_len: Tensor,
        prompt_token: Tensor,
        prompt_token_len: Tensor,
        prompt_feat: Tensor,
        prompt_feat_len: Tensor,
        embedding: Tensor,
        finalize: bool,
        noise: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Streaming step that computes only frames not already final: the exact replacement of
        re-running ``inference(..., streaming=True)`` on all tokens so far for every chunk.

        Arguments as ``inference_batch`` (``token`` = all tokens so far, growing from call to
        call). Returns the mel frames not returned before, ``[B, 80, max n]``, and n ``[B]``:
        equal to the official full re-run's new-token mel from the previous call's end on.
        Encoder and decoder each keep the states of complete 25-token / 50-frame chunks and
        recompute only from the last chunk boundary (see the module docstring).
        """
        config = self.config
        chunk = config.decoder.estimator.static_chunk_size
        if chunk <= 0 or chunk != config.encoder.static_chunk_size * config.token_mel_ratio:
            raise ValueError("incremental streaming needs the decoder's chunk = the encoder's chunk in mel frames")
        sessions = token.shape[0]
        device = token.device
        if not cache.started:
            cache.encoder = [EncoderStreamState() for _ in range(sessions)]
            cache.tokens_seen = [0] * sessions
            cache.emitted = [int(n) for n in prompt_feat_len.tolist()]
        elif len(cache.encoder) != sessions:
            raise ValueError(f"cache holds {len(cache.encoder)} sessions, call has {sessions}")
        if any(state.finished for state in cache.encoder):
            raise ValueError("a finalized stream was continued")

        # 1. tokens: only the ones each session has not consumed yet
        new_tokens = []
        for row, (n_prompt, n_token) in enumerate(zip(prompt_token_len.tolist(), token_len.tolist())):
            joined = torch.cat([prompt_token[row, :n_prompt], token[row, :n_token]])
            new_tokens.append(joined[cache.tokens_seen[row] :])
            cache.tokens_seen[row] = len(joined)
        encoded = IncrementalEncoder(self).step(cache.encoder, new_tokens, finalize)

        # 2. decoder inputs for the new frames: row b's column i is frame start[b] + i
        start = encoded.mel_start
        committed = cache.decoder.committed if cache.decoder.started else [0] * sessions
        if start.tolist() != committed:
            raise RuntimeError(f"encoder resumes at frames {start.tolist()}, decoder at {committed}")
        mu, new_frames = encoded.mu, encoded.mel_len
        frames = mu.shape[2]
        if frames == 0:
            return mu.new_zeros(sessions, config.output_size, 0).float(), torch.zeros_like(new_frames)
        end = start + new_frames
        commit = torch.zeros_like(end) if finalize else end // chunk * chunk - start
        mask = (torch.arange(frames, device=device) < new_frames[:, None])[:, None].to(mu.dtype)
        cond = self._prompt_condition(prompt_feat, prompt_feat_len.to(device), start, frames)
        if noise is None:
            noise = self.decoder.noise
        noise = _gather_frames(noise[:, :, : int(end.max())].expand(sessions, -1, -1), start, frames)
        spk = project_speaker(self, embedding)
        mel = self.decoder.forward_chunk(
            cache.decoder, mu, mask, spk, cond, noise, start.tolist(), commit.tolist()
        )

        # 3. output: frames from the end of what was returned before
        emitted = torch.tensor(cache.emitted, device=device)
        out_len = (end - emitted).clamp(min=0)
        cache.emitted = torch.maximum(end, emitted).tolist()
        return self._rows(mel, emitted - start, out_len), out_len

    def _prompt_condition(self, prompt_feat: Tensor, prompt_feat_len: Tensor, start: Tensor, frames: int) -> Tensor:
        """``cond`` ``[B, 80, frames]`` for frames start[b] + i: the prompt mel where there is one, else 0."""
        feat = prompt_feat.transpose(1, 2).to(self.encoder_proj.weight.dtype)
        if feat.shape[2] == 0:
            return feat.new_zeros(feat.shape[0], feat.shape[1], frames)
        positions = start[:, None] + torch.arange(frames, device=feat.device)
        inside = (positions < prompt_feat_len[:, None])[:, None, :]
        return _gather_frames(feat, start, frames) * inside

    @staticmethod
    def _rows(mel: Tensor, offset: Tensor, length: Tensor) -> Tensor:
        """Row b's columns offset[b] .. offset[b] + length[b] - 1, left-aligned and zero-padded."""
        width = int(length.max()) if length.numel() else 0
        rows = _gather_frames(mel, offset, width)
        return rows * (torch.arange(width, device=mel.device) < length[:, None])[:, None, :]
