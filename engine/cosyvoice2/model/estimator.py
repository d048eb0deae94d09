"""The flow decoder's velocity network v(x, t | mu, spk, cond) and its layers.

A 1-D U-Net without resampling: causal convolution ResNet blocks and transformer blocks,
1 down stage, 12 mid stages and 1 up stage (4 transformer blocks each), time-conditioned
through an MLP on a sinusoidal embedding of t. Parameter names follow the official
``CausalConditionalDecoder`` (diffusers' attention blocks), so ``flow.pt`` loads strictly.

Attention masks are built with tensor ops only. The official helper checks for
all-masked rows with ``.item()``, a host sync that stalls the GPU and breaks CUDA-graph
capture; here the same rule (a query row that sees no key sees every key instead) is a
tensor ``|``. Masks are boolean ``[B, 1, Tq, Tk]``, shared by all heads, turned once per
call into the additive bias SDPA takes.

Cached frames: a call may compute only new frames that continue earlier ones (a voice's
shared prompt prefix, or an utterance's committed chunks). The estimator then reads the
earlier frames' state through a :class:`CachedFrames` view that every causal convolution
and attention layer consults: a convolution asks for its left context, an attention layer
hands over its new frames' queries, keys and values (or, to a view that keeps layer inputs,
its carried query and its input) to be attended over all frames.
Where that state is kept, and for how long, is the serving layer's business
(engine/cosyvoice2/serving/prefix_bank.py, incremental.py); the module only computes.

Layer norms: on CUDA tensors each causal block's norm, Mish and mask (and the add after the
block), and each transformer block's residual add with the norm after it, run as one fused
Triton kernel each (model/fused_norms.py, switched by model/fused_kernels.py); elsewhere as the
plain torch ops. Views see the same convolution and attention inputs either way.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.fused_norms import RowStore, add_norm, norm_mish_mask, write_rows
from tts_gateway.engine.cosyvoice2.modeldir.configs import EstimatorConfig


class CachedFrames(Protocol):
    """The state of frames before a call's new ones, as the estimator's layers read it.

    ``slot`` numbers a layer among the estimator's causal convolutions or attention layers
    (``Estimator.causal_convs`` / ``attention_layers``). A view that ``keeps_inputs`` holds
    each attention layer's input instead of its keys and values (a quarter of their size): the
    new frames' inputs are written into its ``input_store``, then it is asked ``attend_inputs``.
    Any other view is asked ``attend``."""

    keeps_inputs: bool

    def conv_input(self, slot: int, x: Tensor) -> Tensor:
        """``x`` (the new frames) with the convolution's left context in front."""

    def attend(self, slot: int, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> Tensor:
        """The layer's attention of the new frames over the earlier frames and themselves:
        ``query``, ``key``, ``value`` and the result ``[B, T, heads, head_dim]``; ``mask`` is
        what ``attention_mask`` gave, as an additive bias."""

    def input_store(self, slot: int) -> RowStore:
        """Where the layer's new inputs go, ``(target, index)``: input row ``i`` of the new
        frames (``[B * T, dim]`` in order) is written to ``target[index[i]]``, by the norm that
        makes it (``fused_norms.add_norm``) or else by the layer."""

    def attend_inputs(self, slot: int, query: Tensor, scale: float) -> Tensor:
        """The layer's attention over its inputs (``SelfAttention.forward``), the new frames'
        among them once written to ``input_store``: ``query`` and the result ``[B, T, heads,
        dim]``, every head attending over the same inputs with softmax ``scale``."""

    def attention_mask(self, new_frames: Tensor, positions: Tensor, chunk: int) -> Tensor | None:
        """The chunk mask of the new frames (queries) over the earlier and new frames (keys),
        or None where ``attend`` / ``attend_inputs`` apply the chunk rule themselves."""


class StoredKeysValues(Protocol):
    """A view that hands the earlier frames' keys and values to SDPA (``attend_over_stored``)."""

    def keys_values(self, slot: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's keys and values ``[B, heads, frames, head_dim]`` of the earlier frames,
        then the new ones'."""


def attend_over_stored(
    view: StoredKeysValues, slot: int, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None
) -> Tensor:
    """``CachedFrames.attend`` by SDPA over the keys and values ``view`` returns in full."""
    key, value = view.keys_values(slot, key.transpose(1, 2), value.transpose(1, 2))
    return F.scaled_dot_product_attention(query.transpose(1, 2), key, value, attn_mask=mask).transpose(1, 2)


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


# ----------------------------------------------------------------------------- layers


def _fuse_loaded(layer: SelfAttention, _incompatible_keys) -> None:
    """A load_state_dict post-hook: loaded weights (the official state dict) are stacked again at once."""
    layer.fuse_projections()


def _stack_time_loaded(estimator: Estimator, _incompatible_keys) -> None:
    """The Estimator's: its own stack (its attention layers' hooks restack theirs)."""
    estimator.stack_time_projections()


def refill(held: Tensor | None, value: Tensor) -> Tensor:
    """A derived weight buffer holding ``value``: ``held`` written in place where it has the
    shape, dtype and device (CUDA graphs captured over it keep its address), else a new one."""
    value = value.detach()
    if held is not None and (held.shape, held.dtype, held.device) == (value.shape, value.dtype, value.device):
        with torch.inference_mode():  # held may have been made in inference mode
            held.copy_(value)
        return held
    return value.clone(memory_format=torch.contiguous_format)


class CausalConv1d(nn.Conv1d):
    """Conv1d that sees only the current and past frames (left zero padding, or cached context)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.context = kernel_size - 1
        self.cache_slot = -1  # set by Estimator

    def forward(self, x: Tensor, view: CachedFrames | None = None) -> Tensor:
        if view is not None:
            return super().forward(view.conv_input(self.cache_slot, x))
        # Zero context on both sides, the right one's outputs dropped: the same outputs as
        # padding the left alone, without a padded copy of the input.
        frames = x.shape[2]
        return F.conv1d(x, self.weight, self.bias, padding=self.context)[:, :, :frames]


class CausalBlock(nn.Module):
    """Causal conv -> LayerNorm over channels -> Mish, on masked input and output (plus an
    optional addend, which the fused kernel folds in)."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        # Indices follow the official Sequential (conv, transpose, norm, transpose, mish),
        # whose parameters are stored as block.0.* and block.2.*.
        self.block = nn.ModuleList([CausalConv1d(dim, dim_out, 3), nn.Identity(), nn.LayerNorm(dim_out)])

    def forward(
        self, x: Tensor, mask: Tensor, view: CachedFrames | None, addend: Tensor | None = None,
        frames_major: bool = False,
    ) -> Tensor:
        """``mish(norm(conv(x * mask))) * mask (+ addend)``; ``addend`` broadcastable to the
        output ``[B, C, T]``; ``frames_major`` as in :func:`fused_norms.norm_mish_mask`."""
        return self.on_masked(x * mask, mask, view, addend, frames_major)

    def on_masked(
        self, x: Tensor, mask: Tensor, view: CachedFrames | None, addend: Tensor | None = None,
        frames_major: bool = False,
    ) -> Tensor:
        """:meth:`forward` of an input already masked."""
        conv, _, norm = self.block
        return norm_mish_mask(conv(x, view), norm, mask, addend, frames_major)


class ResnetBlock(nn.Module):
    """Two causal blocks with the time embedding's projection (``mlp``) added between them,
    plus a 1x1 skip."""

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock(dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, time_term: Tensor, view: CachedFrames | None) -> Tensor:
        """``[B, C, T]``, in ``[B, T, C]`` memory where the fused kernels run: the transformer
        blocks after it work on frames as rows. ``time_term`` ``[B, dim_out]``: ``mlp`` of the
        time embedding (``Estimator.time_terms``)."""
        masked = x * mask  # block1's input and the skip's, masked once
        h = self.block1.on_masked(masked, mask, view, addend=time_term[:, :, None])
        return self.block2(h, mask, view, addend=self.res_conv(masked), frames_major=True)


class SelfAttention(nn.Module):
    """Multi-head self-attention with diffusers' ``Attention`` parameter names.

    Keys and values are linear in the layer's input (no bias), so attention over them is
    attention over the inputs themselves: ``q . (W_k x) = (W_k^T q) . x`` and ``sum_j p_j W_v
    x_j = W_v sum_j p_j x_j``. A view that keeps the inputs (``CachedFrames.keeps_inputs``) is
    given the query so carried over, ``dim`` wide per head, and its result is carried back
    per head: the same attention, from a quarter of the state (``dim`` values per frame
    instead of keys and values of ``heads x head_dim`` each).

    :meth:`fold_input_attention` multiplies those carries into the projections once, so that
    attention through such a view is one matrix product in front and one behind (see there).
    Any other attention projects its queries, keys and values in one product, over
    ``qkv_weight`` (:meth:`fuse_projections`)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.cache_slot = -1  # set by Estimator
        # The folded products (fold_input_attention), None until folded. Buffers, so that they
        # move and convert with the module; not persistent, so the state dict stays the official one.
        self.qk_weight: Tensor | None
        self.vo_weight: Tensor | None
        self.register_buffer("qk_weight", None, persistent=False)
        self.register_buffer("vo_weight", None, persistent=False)
        # to_q, to_k and to_v stacked (fuse_projections), at construction and after every load.
        self.qkv_weight: Tensor
        self.register_buffer("qkv_weight", None, persistent=False)
        self.fuse_projections()
        self.register_load_state_dict_post_hook(_fuse_loaded)

    def forward(self, x: Tensor, mask: Tensor | None, view: CachedFrames | None, stored: bool = False) -> Tensor:
        """``stored``: a view that keeps inputs has ``x`` in its ``input_store`` already."""
        if view is not None and view.keeps_inputs:
            return self._attend_inputs(x, view, stored)
        batch, frames, _ = x.shape
        # One product for the three projections; each is a strided view of it, heads apart.
        projected = F.linear(x, self.qkv_weight).view(batch, frames, 3, self.heads, self.head_dim)
        query, key, value = projected.unbind(2)
        if view is not None:
            out = view.attend(self.cache_slot, query, key, value, mask)
        else:
            out = F.scaled_dot_product_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask
            ).transpose(1, 2)
        return self.to_out[0](out.reshape(batch, frames, self.heads * self.head_dim))

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Rebuild what the layer derives from its weights: ``to_q``, ``to_k`` and ``to_v``
        stacked into ``qkv_weight``, and the folded products where they were folded
        (:meth:`fold_input_attention`); in place where held already (CUDA graphs keep their
        addresses). Done at construction and whenever weights are loaded; call it again after
        changing them in place. (Forward passes read the copies, so no gradient reaches the
        official modules' weights through them: an inference module.)"""
        self.qkv_weight = refill(self.qkv_weight, torch.cat([self.to_q.weight, self.to_k.weight, self.to_v.weight]))
        if self.qk_weight is not None:
            self.fold_input_attention()

    @torch.no_grad()
    def fold_input_attention(self) -> None:
        """Fold the projections for attention over the layer's inputs (a view that ``keeps_inputs``).

        ``qk_weight`` ``[heads * dim, dim]``: head h's rows are ``W_k,h^T W_q,h``, so ``x
        qk_weight^T`` is every head's query carried to input space. ``vo_weight`` ``[dim, heads *
        dim]``: head h's columns are ``W_o,h W_v,h`` (``W_o,h``: to_out's columns of head h), so
        the heads' results times ``vo_weight^T`` plus to_out's bias is the layer's output. Each
        head's query and value projections then run inside those two products instead of as
        separate per-head products with their layout copies. The products are taken in float32,
        then stored in the weights' dtype and device. Fold after the weights are loaded and
        converted, and again after they change, not while a CUDA graph captures; folding again
        writes into the buffers already held (CUDA graphs keep their addresses)."""
        dtype, device = self.to_q.weight.dtype, self.to_q.weight.device
        w_q, w_k, w_v = (
            linear.weight.float().view(self.heads, self.head_dim, self.dim)
            for linear in (self.to_q, self.to_k, self.to_v)
        )
        w_o = self.to_out[0].weight.float().view(self.dim, self.heads, self.head_dim)
        qk = torch.einsum("hdc,hde->hce", w_k, w_q).reshape(self.heads * self.dim, self.dim)
        vo = torch.einsum("ohd,hdc->ohc", w_o, w_v).reshape(self.dim, self.heads * self.dim)
        self.qk_weight = refill(self.qk_weight, qk.to(dtype=dtype, device=device))
        self.vo_weight = refill(self.vo_weight, vo.to(dtype=dtype, device=device))

    def _attend_inputs(self, x: Tensor, view: CachedFrames, stored: bool) -> Tensor:
        """Attention through a view that keeps this layer's inputs (see the class)."""
        batch, frames, _ = x.shape
        scale = self.head_dim**-0.5
        if not stored:
            write_rows(view.input_store(self.cache_slot), x)
        if self.qk_weight is not None and self.vo_weight is not None:
            query = F.linear(x, self.qk_weight).view(batch, frames, self.heads, self.dim)
            out = view.attend_inputs(self.cache_slot, query, scale)
            return F.linear(out.reshape(batch, frames, self.heads * self.dim), self.vo_weight, self.to_out[0].bias)
        # Not folded (a view used without fold_input_attention): carry per head, the same attention.
        query = self.to_q(x).view(batch, frames, self.heads, self.head_dim)
        w_k = self.to_k.weight.view(self.heads, self.head_dim, self.dim)
        w_v = self.to_v.weight.view(self.heads, self.head_dim, self.dim)
        out = view.attend_inputs(self.cache_slot, torch.einsum("bthd,hdc->bthc", query, w_k), scale)
        out = torch.einsum("bthc,hdc->bthd", out, w_v)
        return self.to_out[0](out.reshape(batch, frames, self.heads * self.head_dim))


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
    """Pre-norm self-attention and feed-forward, each with a residual (matcha's ``BasicTransformerBlock``).

    The feed-forward's residual is left to the caller (see :meth:`forward`): added by the next
    block together with its first norm, in one fused kernel where those run."""

    def __init__(self, dim: int, heads: int, head_dim: int, act_fn: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, act_fn)

    def forward(
        self, x: Tensor, pending: Tensor | None, mask: Tensor | None, view: CachedFrames | None
    ) -> tuple[Tensor, Tensor]:
        """The block on ``x + pending`` ``[B, T, C]`` (``pending``: the previous block's
        feed-forward output, or None), as ``(stream, delta)``: the block's output is ``stream +
        delta``, the add left to the next block or the stage's end."""
        # A view that keeps attention inputs gets this layer's from the norm that makes them.
        store = view.input_store(self.attn1.cache_slot) if view is not None and view.keeps_inputs else None
        x, normed = add_norm(x, pending, self.norm1, store)
        x, normed = add_norm(x, self.attn1(normed, mask, view, stored=store is not None), self.norm3)
        return x, self.ff(normed)


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
        self.resnets = [m for m in self.modules() if isinstance(m, ResnetBlock)]  # in the order forward runs them
        # Every ResNet block's time projection stacked (fuse_projections).
        self.time_weight: Tensor
        self.time_bias: Tensor
        self.register_buffer("time_weight", None, persistent=False)
        self.register_buffer("time_bias", None, persistent=False)
        self.stack_time_projections()  # the attention layers stacked theirs when made
        self.register_load_state_dict_post_hook(_stack_time_loaded)

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Rebuild everything derived from the weights: every ResNet block's projection of the
        time embedding stacked into one (``time_terms``: a solver step runs one Mish and one
        product for the time instead of one of each per block), and each attention layer's
        (``SelfAttention.fuse_projections``). Done at construction and whenever weights are
        loaded; call it again after changing weights in place."""
        for layer in self.attention_layers:
            layer.fuse_projections()
        self.stack_time_projections()

    @torch.no_grad()
    def stack_time_projections(self) -> None:
        """The ResNet blocks' time projections stacked into ``time_weight`` and ``time_bias``."""
        projections = [resnet.mlp[1] for resnet in self.resnets]
        self.time_weight = refill(self.time_weight, torch.cat([p.weight for p in projections]))
        self.time_bias = refill(self.time_bias, torch.cat([p.bias for p in projections]))

    def time_terms(self, time_emb: Tensor) -> tuple[Tensor, ...]:
        """Each ResNet block's ``mlp(time_emb)`` ``[B, dim_out]``, in forward's order, from one
        product: every ``mlp`` is Mish then a linear map of the same embedding."""
        sizes = [resnet.mlp[1].out_features for resnet in self.resnets]
        return F.linear(F.mish(time_emb), self.time_weight, self.time_bias).split(sizes, dim=1)

    def fold_input_attention(self) -> None:
        """Fold every attention layer's projections for views that keep layer inputs
        (``SelfAttention.fold_input_attention``)."""
        for layer in self.attention_layers:
            layer.fold_input_attention()

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool = False,
        view: CachedFrames | None = None,
    ) -> Tensor:
        """x, mu, cond: ``[B, 80, T]``; mask: ``[B, 1, T]`` (1 = real frame); t: ``[B]``; spks: ``[B, 80]``.

        With ``view``, the T frames are new frames at per-row offsets ``view.start`` and
        attend to (and extend) the cached earlier frames (:class:`CachedFrames`); streaming
        mode only.
        """
        time_terms = iter(self.time_terms(self.time_mlp(sinusoidal_embedding(t, self.config.in_channels).to(t.dtype))))
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
        if attn_mask is not None:
            attn_mask = attention_bias(attn_mask, x.dtype)

        def transform(h: Tensor, blocks: nn.ModuleList) -> Tensor:
            # Frames as contiguous rows, so each norm reads a frame's channels in one run (a
            # no-op on a ResNet block's frames-major output).
            h, pending = h.transpose(1, 2).contiguous(), None
            for block in blocks:
                h, pending = block(h, pending, attn_mask, view)
            return (h if pending is None else h + pending).transpose(1, 2)

        resnet, blocks, conv = self.down_blocks[0]
        skip = transform(resnet(h, mask, next(time_terms), view), blocks)
        h = conv(skip * mask, view)
        for resnet, blocks in self.mid_blocks:
            h = transform(resnet(h, mask, next(time_terms), view), blocks)
        resnet, blocks, conv = self.up_blocks[0]
        h = transform(resnet(torch.cat([h, skip], dim=1), mask, next(time_terms), view), blocks)
        h = conv(h * mask, view)
        h = self.final_block(h, mask, view)
        return self.final_proj(h * mask) * mask
