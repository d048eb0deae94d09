"""Fused layer-norm kernels of the flow decoder's velocity network, with their torch references.

On the GPU the estimator is bound by memory passes and kernel launches, not arithmetic: each
layer norm of a causal block is a transpose copy, the norm, a copy back, Mish and a mask
multiply, and each residual add of a transformer block is a kernel of its own before the next
norm. Two Triton kernels do that work in one pass each:

- :func:`norm_mish_mask`: ``mish(layer_norm over channels(h)) * mask (+ addend)`` on ``h``
  ``[B, C, T]``, the tail of a causal block; the addend (the time embedding's ``[B, C, 1]``,
  or a ResNet block's skip ``[B, C, T]``) folds the add that follows the block into it.
- :func:`add_norm`: ``s = x + delta; n = layer_norm(s)``, returning both, on ``[..., C]``
  rows: a transformer block's residual add and the layer norm after it (the norm alone without
  ``delta``). Given a store, it also writes ``n`` into it, row by row: an attention layer's input
  into the paged turn pool, where the layer then reads it (serving/turn_pool.py).

Each op computes its statistics in float32 and reads and writes the tensors' dtype. Which path
runs is decided per call by the fused kernels' switch (fused_kernels.py). The kernels launch on
grids computed from tensor shapes only and never read device data on the host, so CUDA graphs
capture them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model import fused_kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch comes without Triton: the references serve
    triton = None

# Frames per program of norm_mish_mask: 32 bf16 frames are a 64-byte run of each channel, and a
# program's [C=256, 32] tile stays in registers; smaller batches still fill the GPU's SMs.
FRAMES_PER_PROGRAM = 32
# Rows per program of add_norm (4096 values at C=256).
ROWS_PER_PROGRAM = 16


# ----------------------------------------------------------------------------- references


def norm_mish_mask_reference(h: Tensor, norm: nn.LayerNorm, mask: Tensor, addend: Tensor | None = None) -> Tensor:
    """``mish(norm(h over channels)) * mask (+ addend)``; h ``[B, C, T]``, mask ``[B, 1, T]``,
    addend broadcastable to ``[B, C, T]``."""
    out = F.mish(norm(h.transpose(1, 2)).transpose(1, 2)) * mask
    return out if addend is None else out + addend


# Where add_norm also writes its normed rows, as (target, index): a [N, C] tensor, and for each
# of the rows (the tensor's [..., C] rows in order) the row of target it goes to.
RowStore = tuple[Tensor, Tensor]


def write_rows(store: RowStore, rows: Tensor) -> None:
    """``rows``' ``[..., C]`` rows, in order, into their rows of the store's target."""
    target, index = store
    target.index_copy_(0, index, rows.reshape(-1, rows.shape[-1]))


def add_norm_reference(
    x: Tensor, delta: Tensor | None, norm: nn.LayerNorm, store: RowStore | None = None
) -> tuple[Tensor, Tensor]:
    """``(x + delta, norm(x + delta))`` over the last dim (``x`` itself without ``delta``); with
    ``store`` ``(target, index)``, the normed rows also go to ``target[index]``."""
    total = x if delta is None else x + delta
    normed = norm(total)
    if store is not None:
        write_rows(store, normed)
    return total, normed


# ----------------------------------------------------------------------------- dispatch


def norm_mish_mask(
    h: Tensor, norm: nn.LayerNorm, mask: Tensor, addend: Tensor | None = None, frames_major: bool = False
) -> Tensor:
    """``mish(norm(h over channels)) * mask (+ addend)`` (:func:`norm_mish_mask_reference`).

    ``frames_major``: the fused kernel writes its ``[B, C, T]`` result into ``[B, T, C]``
    memory (a transposed view), for a consumer that works on frames as rows; values are the
    same either way."""
    if fused_kernels.applies(h):
        return _norm_mish_mask_triton(h, norm.weight, norm.bias, norm.eps, mask, addend, frames_major)
    return norm_mish_mask_reference(h, norm, mask, addend)


def add_norm(
    x: Tensor, delta: Tensor | None, norm: nn.LayerNorm, store: RowStore | None = None
) -> tuple[Tensor, Tensor]:
    """``(x + delta, norm(x + delta))`` (:func:`add_norm_reference`), the sum contiguous; with
    ``store``, the normed rows written there too, in the same kernel."""
    if fused_kernels.applies(x):
        return _add_norm_triton(x, delta, norm.weight, norm.bias, norm.eps, store)
    return add_norm_reference(x, delta, norm, store)


# ----------------------------------------------------------------------------- Triton

if triton is not None:

    @triton.jit
    def _mish(y):
        # tanh(softplus(y)) = ((1 + e^y)^2 - 1) / ((1 + e^y)^2 + 1) = n / (n + 2) with
        # n = e^y (e^y + 2): no log or tanh, and exact for very negative y, where log1p
        # would round 1 + e^y to 1. Above torch's softplus threshold (20) softplus(y) = y,
        # and the ratio is 1 in float32.
        e = tl.exp(tl.minimum(y, 20.0))
        n = e * (e + 2.0)
        return tl.where(y > 20.0, y, y * (n / (n + 2.0)))

    @triton.jit(do_not_specialize=["frames"])
    def fused_norm_mish_mask_kernel(
        h_ptr, weight_ptr, bias_ptr, mask_ptr, addend_ptr, out_ptr,
        channels, frames, eps,
        h_stride_b, h_stride_c, h_stride_t,
        mask_stride_b, mask_stride_t,
        addend_stride_b, addend_stride_c, addend_stride_t,
        out_stride_b, out_stride_c, out_stride_t,
        HAS_ADDEND: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        # One program: BLOCK_T frames of one batch row, all channels. The norm reduces over
        # channels, which are strided by T in [B, C, T]: the tile is read along frames
        # (coalesced) and reduced over its channel axis in registers.
        row = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.arange(0, BLOCK_C)
        t_in = t < frames
        c_in = c < channels
        inside = c_in[:, None] & t_in[None, :]
        h = tl.load(
            h_ptr + row * h_stride_b + c[:, None] * h_stride_c + t[None, :] * h_stride_t, mask=inside, other=0.0
        ).to(tl.float32)
        mean = tl.sum(h, axis=0) / channels
        centred = tl.where(inside, h - mean[None, :], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / channels + eps)
        weight = tl.load(weight_ptr + c, mask=c_in, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + c, mask=c_in, other=0.0).to(tl.float32)
        normed = centred * rstd[None, :] * weight[:, None] + bias[:, None]
        keep = tl.load(mask_ptr + row * mask_stride_b + t * mask_stride_t, mask=t_in, other=0.0).to(tl.float32)
        out = _mish(normed) * keep[None, :]
        if HAS_ADDEND:
            addend = tl.load(
                addend_ptr + row * addend_stride_b + c[:, None] * addend_stride_c + t[None, :] * addend_stride_t,
                mask=inside, other=0.0,
            )
            out += addend.to(tl.float32)
        tl.store(
            out_ptr + row * out_stride_b + c[:, None] * out_stride_c + t[None, :] * out_stride_t,
            out.to(out_ptr.dtype.element_ty), mask=inside,
        )

    @triton.jit(do_not_specialize=["rows"])
    def fused_add_norm_kernel(
        x_ptr, delta_ptr, weight_ptr, bias_ptr, total_ptr, normed_ptr, store_ptr, index_ptr,
        rows, channels, eps,
        HAS_DELTA: tl.constexpr, HAS_STORE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_C)
        c_in = c < channels
        r_in = r < rows
        inside = r_in[:, None] & c_in[None, :]
        offsets = r[:, None] * channels + c[None, :]
        total = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        if HAS_DELTA:
            total += tl.load(delta_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            # The norm reads the sum as stored, as the unfused add then norm does.
            summed = total.to(total_ptr.dtype.element_ty)
            tl.store(total_ptr + offsets, summed, mask=inside)
            total = summed.to(tl.float32)
        mean = tl.sum(total, axis=1) / channels
        centred = tl.where(inside, total - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / channels + eps)
        weight = tl.load(weight_ptr + c, mask=c_in, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + c, mask=c_in, other=0.0).to(tl.float32)
        normed = (centred * rstd[:, None] * weight[None, :] + bias[None, :]).to(normed_ptr.dtype.element_ty)
        tl.store(normed_ptr + offsets, normed, mask=inside)
        if HAS_STORE:
            target = tl.load(index_ptr + r, mask=r_in, other=0).to(tl.int64)
            tl.store(store_ptr + target[:, None] * channels + c[None, :], normed, mask=inside)


def _norm_mish_mask_triton(
    h: Tensor, weight: Tensor, bias: Tensor, eps: float, mask: Tensor, addend: Tensor | None, frames_major: bool
) -> Tensor:
    batch, channels, frames = h.shape
    if frames_major:
        out = torch.empty(batch, frames, channels, dtype=h.dtype, device=h.device).transpose(1, 2)
    else:
        out = torch.empty(batch, channels, frames, dtype=h.dtype, device=h.device)
    mask = mask.expand(batch, 1, frames)
    # Broadcast by stride 0: the time embedding [B, C, 1] is read once per channel.
    addend_view = out if addend is None else addend.expand(batch, channels, frames)
    grid = (triton.cdiv(frames, FRAMES_PER_PROGRAM), batch)
    fused_norm_mish_mask_kernel[grid](
        h, weight, bias, mask, addend_view, out,
        channels, frames, eps,
        *h.stride(),
        mask.stride(0), mask.stride(2),
        *addend_view.stride(),
        *out.stride(),
        HAS_ADDEND=addend is not None, BLOCK_C=triton.next_power_of_2(channels), BLOCK_T=FRAMES_PER_PROGRAM,
        num_warps=4,
    )
    return out


def _add_norm_triton(
    x: Tensor, delta: Tensor | None, weight: Tensor, bias: Tensor, eps: float, store: RowStore | None
) -> tuple[Tensor, Tensor]:
    channels = x.shape[-1]
    x = x.contiguous()  # a no-op for the estimator's rows, as for delta
    total = x if delta is None else torch.empty_like(x)
    normed = torch.empty_like(x)
    rows = x.numel() // channels
    target, index = store if store is not None else (normed, normed)  # unread without a store
    if store is not None and (
        target.dim() != 2 or target.shape[1] != channels or not target.is_contiguous() or target.dtype != x.dtype
        or target.device != x.device or index.shape != (rows,) or index.dtype not in (torch.int32, torch.int64)
        or index.device != x.device
    ):  # what index_copy_ would refuse, checked on the host before the kernel reads past either
        raise ValueError(
            f"add_norm's store: [N, {channels}] contiguous {x.dtype} and an integer index of {rows} rows, "
            f"on {x.device}; got {tuple(target.shape)} {target.dtype} and {tuple(index.shape)} {index.dtype}"
        )
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM),)
    fused_add_norm_kernel[grid](
        x, x if delta is None else delta.contiguous(), weight, bias, total, normed, target, index,
        rows, channels, eps,
        HAS_DELTA=delta is not None, HAS_STORE=store is not None,
        BLOCK_R=ROWS_PER_PROGRAM, BLOCK_C=triton.next_power_of_2(channels),
        num_warps=4,
    )
    return total, normed
