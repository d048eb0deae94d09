"""A causal convolution's input in the paged flow decoder as one Triton kernel, with its torch reference.

In a paged call (turn_pool.py) each of the estimator's causal convolutions (31 at full size)
asks for its input at every Euler step: the new frames with the convolution's left context
(``kernel - 1`` frames) in front, taken from the turn's conv-context slot in the pool when the
turn has stored frames, else from its voice prefix's slot in the bank; and the context after
the frames the call commits goes back to the turn's slot. As torch ops that is 9 small
kernels per convolution and step (two gathers, a compare, a select, a concatenation, an
index computation, a gather and a scatter), whose launches, not their bytes, are the cost
on a GPU, CUDA graphs or not. :func:`conv_input` does it all in one kernel: each program
copies a tile of the new frames into place, and the programs of a row's first frames also
write its context in front and its new context to the pool.

Which path runs is decided per call by the fused kernels' switch (model/fused_kernels.py). The
Euler step may be a device tensor (a CUDA graph's step counter): the kernel reads it on the
device; its grid comes from tensor shapes only, and it never reads device data on the host, so
CUDA graphs capture it.

Reads and writes of the pool. A row reads its turn's slot and writes the new context to the
same slot only when it commits frames (``commit > 0``); it commits whole 50-frame chunks,
so the new context lies within the new frames and is copied from ``x``, never from the slot
it overwrites. A row that commits nothing writes the scratch slot instead. Real rows
hold distinct turn slots, so no row reads a slot another one writes, except the scratch
slot: padding rows read it (those with stored frames) while every row that commits nothing
writes it, in no set order, as the reference's scatter does too. Padding rows' outputs are
discarded and the scratch slot is never read for a real row, so what they get does not
matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tts_gateway.engine.cosyvoice2.model import fused_kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch comes without Triton: the reference serves
    triton = None

# A program's tile of the new frames: 64 bf16 frames are a 128-byte run of each channel.
FRAMES_PER_PROGRAM = 64
CHANNELS_PER_PROGRAM = 32


@dataclass(frozen=True)
class ContextRows:
    """Where each of a paged call's 2B estimator rows (CFG doubles the B rows, the conditioned
    half first) reads and writes a convolution's left context, every tensor ``[2B]``.

    stored: frames the turn has stored (0: the context is the voice prefix's, from the bank);
    commit: frames this call commits (0 or whole chunks); read_slot / write_slot: the turn's
    slot in the pool to read and to write (the scratch slot when it commits nothing);
    bank_slot: the voice prefix's slot in the bank; branch: the CFG row (0 conditioned, 1 not).
    """

    stored: Tensor
    commit: Tensor
    read_slot: Tensor
    write_slot: Tensor
    bank_slot: Tensor
    branch: Tensor


def conv_input(x: Tensor, turns: Tensor, bank: Tensor, step: int | Tensor, rows: ContextRows) -> Tensor:
    """``x`` ``[2B, C, T]`` (the new frames) with its left context in front, ``[2B, C, context +
    T]``, writing the context after the committed frames to ``turns``
    (:func:`conv_input_reference`)."""
    if fused_kernels.applies(x):
        return _conv_input_triton(x, turns, bank, step, rows)
    return conv_input_reference(x, turns, bank, step, rows)


def conv_input_reference(x: Tensor, turns: Tensor, bank: Tensor, step: int | Tensor, rows: ContextRows) -> Tensor:
    """The torch ops of :func:`conv_input`. ``turns``: the pool's conv context ``[steps, turn
    slots + 1, 2, C, context]``; ``bank``: the prefix bank's ``[steps, bank slots, 2, C,
    context]``; ``step``: the Euler step, an int or a one-element device tensor."""
    at = step if isinstance(step, int) else step.expand(len(rows.stored))
    context = torch.where(
        (rows.stored > 0)[:, None, None], turns[at, rows.read_slot, rows.branch], bank[at, rows.bank_slot, rows.branch]
    )
    extended = torch.cat([context, x], dim=2)
    # extended[:, :, e] is frame start - context + e: the context after the committed
    # frames is extended[:, :, commit : commit + context].
    take = rows.commit[:, None] + torch.arange(context.shape[2], device=x.device)
    turns[at, rows.write_slot, rows.branch] = extended.gather(2, take[:, None].expand(-1, x.shape[1], -1))
    return extended


# ----------------------------------------------------------------------------- Triton

if triton is not None:

    @triton.jit(do_not_specialize=["step_value", "frames"])
    def fused_conv_input_kernel(
        x_ptr, turns_ptr, bank_ptr, out_ptr, step_ptr, step_value,
        stored_ptr, commit_ptr, read_slot_ptr, write_slot_ptr, bank_slot_ptr, branch_ptr,
        channels, frames,
        x_stride_b, x_stride_c, x_stride_t,
        turns_stride_step, turns_stride_slot, turns_stride_branch, turns_stride_c, turns_stride_k,
        bank_stride_step, bank_stride_slot, bank_stride_branch, bank_stride_c, bank_stride_k,
        STEP_IN_MEMORY: tl.constexpr, CONTEXT: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # One program: BLOCK_T new frames x BLOCK_C channels of one row; the programs of its
        # first frames also write its context (old in front, new to the pool).
        row = tl.program_id(2).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_in = c < channels
        width = CONTEXT + frames
        out_at = out_ptr + row * channels * width + c[:, None] * width
        x_at = x_ptr + row * x_stride_b + c[:, None] * x_stride_c
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        inside = c_in[:, None] & (t < frames)[None, :]
        new = tl.load(x_at + t[None, :] * x_stride_t, mask=inside)
        tl.store(out_at + CONTEXT + t[None, :], new.to(out_ptr.dtype.element_ty), mask=inside)
        if tl.program_id(0) == 0:
            if STEP_IN_MEMORY:
                step = tl.load(step_ptr)
            else:
                step = step_value
            commit = tl.load(commit_ptr + row)
            branch = tl.load(branch_ptr + row)
            turn_at = turns_ptr + step * turns_stride_step + branch * turns_stride_branch + c[:, None] * turns_stride_c
            write_at = turn_at + tl.load(write_slot_ptr + row) * turns_stride_slot
            # The old context: the turn's when it has stored frames, else its voice prefix's.
            from_turn = tl.load(stored_ptr + row) > 0
            bank_at = (
                bank_ptr + step * bank_stride_step + tl.load(bank_slot_ptr + row) * bank_stride_slot
                + branch * bank_stride_branch + c[:, None] * bank_stride_c
            )
            old_at = tl.where(from_turn, turn_at + tl.load(read_slot_ptr + row) * turns_stride_slot, bank_at)
            old_stride_k = tl.where(from_turn, turns_stride_k, bank_stride_k)
            k = tl.arange(0, BLOCK_K)
            k_in = c_in[:, None] & (k < CONTEXT)[None, :]
            old = tl.load(old_at + k[None, :] * old_stride_k, mask=k_in)
            tl.store(out_at + k[None, :], old.to(out_ptr.dtype.element_ty), mask=k_in)
            # The context after the committed frames: frames commit + k of [old context | x],
            # each read from where it comes from (x for a row that commits: its own slot is
            # overwritten below).
            e = commit + k
            from_x = (e >= CONTEXT)[None, :]
            later_in = k_in & from_x & (e - CONTEXT < frames)[None, :]
            later = tl.load(x_at + (e - CONTEXT)[None, :] * x_stride_t, mask=later_in, other=0.0)
            earlier = tl.load(old_at + e[None, :] * old_stride_k, mask=k_in & (e < CONTEXT)[None, :], other=0.0)
            context = tl.where(from_x, later.to(out_ptr.dtype.element_ty), earlier.to(out_ptr.dtype.element_ty))
            # Every thread's read of the old context before any thread overwrites it (a committing
            # row writes the slot it read): the tile is spread over more threads than it has
            # values, so two threads load each value and only one of them stores it.
            tl.debug_barrier()
            tl.store(write_at + k[None, :] * turns_stride_k, context.to(turns_ptr.dtype.element_ty), mask=k_in)


def _conv_input_triton(x: Tensor, turns: Tensor, bank: Tensor, step: int | Tensor, rows: ContextRows) -> Tensor:
    batch, channels, frames = x.shape
    context = turns.shape[-1]
    out = torch.empty(batch, channels, context + frames, dtype=x.dtype, device=x.device)
    in_memory = isinstance(step, Tensor)
    # At least one program of frames: the context is written even for a row of no new frames.
    grid = (max(1, triton.cdiv(frames, FRAMES_PER_PROGRAM)), triton.cdiv(channels, CHANNELS_PER_PROGRAM), batch)
    fused_conv_input_kernel[grid](
        # step_ptr must be a tensor even when the step is an int (then never read): any will do.
        x, turns, bank, out, step if in_memory else rows.stored, 0 if in_memory else step,
        rows.stored, rows.commit, rows.read_slot, rows.write_slot, rows.bank_slot, rows.branch,
        channels, frames,
        *x.stride(), *turns.stride(), *bank.stride(),
        STEP_IN_MEMORY=in_memory, CONTEXT=context,
        BLOCK_C=CHANNELS_PER_PROGRAM, BLOCK_T=FRAMES_PER_PROGRAM, BLOCK_K=triton.next_power_of_2(context),
        num_warps=4,
    )
    return out
