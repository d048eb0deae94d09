"""Chunk-causal attention over paged keys as a varlen call: one query sequence per chunk.

The flow in streaming mode is chunk-causal: a frame sees every key up to the end of its own
attention chunk, and nothing after. Split a row's new frames at chunk boundaries and each
piece is a plain (non-causal) attention of its queries over the row's keys ``[0, end)``,
where ``end`` is the end of that chunk (or of the row's frames, if the chunk is not whole
yet). So a whole paged call is one varlen attention: sequences = (row, chunk) pieces, each
with its length of keys (``seqused_k``) and the row's page table. That is the interface of
the paged FlashAttention kernel vLLM ships (``vllm.vllm_flash_attn.flash_attn_varlen_func``
with ``block_table``; pages of a multiple of 16 frames, ``[pages, page_frames, heads,
head_dim]``), so the stored keys are read where they lie, with no mask and no gather.

Layout. Row ``r``'s keys are its frames in order (voice prefix, stored chunks, new frames),
key position ``p`` on page ``block_table[r, p // page_frames]`` at ``p % page_frames``. Its
queries are positions ``query_start[r]`` to ``query_start[r] + new_frames[r]``, packed at
``r * queries`` in the call's ``[rows * queries, heads, head_dim]`` queries (``queries`` a
fixed width, so the shapes depend on the call's bucket only). Every sequence count and table
is fixed by ``rows`` and ``queries``: pieces a row does not need are empty, and a row's
padding queries form its last piece (their output is never read).

``attend_reference`` computes the same thing with gathers and SDPA; CPU tests hold the
kernel's semantics and this plan to it, and the plan to the flow's chunk-causal mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class ChunkSequences:
    """One paged call's query pieces, as the varlen kernel takes them (S = rows x per_row)."""

    cu_seqlens_q: Tensor  # int32 [S + 1]: piece s is queries cu[s] .. cu[s + 1]
    seqused_k: Tensor  # int32 [S]: how many of its row's keys piece s sees
    block_table: Tensor  # int32 [S, pages]: its row's page table
    max_seqlen_q: int
    max_seqlen_k: int


def pieces_per_row(queries: int, chunk: int) -> int:
    """The most pieces ``queries`` consecutive frames fall into, plus the padding piece."""
    return (queries + chunk - 1) // chunk + 2


def chunk_sequences(block_table: Tensor, query_start: Tensor, new_frames: Tensor, queries: int, chunk: int,
                    page_frames: int) -> ChunkSequences:
    """The pieces of a call whose row ``r`` has ``new_frames[r]`` new frames from position
    ``query_start[r]`` (its keys: positions up to ``query_start[r] + new_frames[r]``, on the pages
    ``block_table[r]``), queries packed ``queries`` per row. No host sync."""
    rows, pages = block_table.shape
    per_row = pieces_per_row(queries, chunk)
    device = block_table.device
    query_start, new_frames = query_start.long(), new_frames.long()
    # Piece k of a row starts at query index bounds[k]: 0, then each chunk boundary after the
    # row's first position, capped at its new frames; the last piece holds the padding.
    first = (chunk - query_start % chunk)[:, None]
    step = torch.arange(per_row + 1, device=device) - 1
    bounds = torch.minimum(first + step * chunk, new_frames[:, None])
    bounds[:, 0] = 0
    bounds[:, -1] = queries
    starts = bounds[:, :-1] + torch.arange(rows, device=device)[:, None] * queries
    cu_seqlens_q = torch.cat([starts.reshape(-1), torch.full((1,), rows * queries, device=device)])
    ends = query_start + new_frames
    first_position = query_start[:, None] + bounds[:, :-1]
    # At least one key: only a padding piece of a row with no key at all would have none, and
    # the kernel's output there (never read) must not be NaN, which later layers would carry.
    seqused_k = torch.minimum((first_position // chunk + 1) * chunk, ends[:, None]).clamp(min=1)
    return ChunkSequences(
        cu_seqlens_q.to(torch.int32), seqused_k.reshape(-1).to(torch.int32),
        block_table.to(torch.int32).repeat_interleave(per_row, dim=0), queries, pages * page_frames,
    )


def attend_reference(query: Tensor, key_pages: Tensor, value_pages: Tensor, plan: ChunkSequences,
                     scale: float | None = None) -> Tensor:
    """What the varlen kernel computes (``query`` ``[total_q, heads, dim]``, pages ``[pages,
    page_frames, heads or 1, dim]``: one key head serves every query head), piece by piece with
    gathers: for checking, not for serving."""
    out = torch.zeros_like(query)
    cu = plan.cu_seqlens_q.tolist()
    used = plan.seqused_k.tolist()
    page_frames = key_pages.shape[1]
    for piece, (begin, end) in enumerate(zip(cu[:-1], cu[1:])):
        if end == begin:
            continue
        pages = plan.block_table[piece, : -(-used[piece] // page_frames)].long()
        heads = query.shape[1]
        keys = key_pages[pages].flatten(0, 1)[: used[piece]].expand(-1, heads, -1)  # [keys, heads, dim]
        values = value_pages[pages].flatten(0, 1)[: used[piece]].expand(-1, heads, -1)
        out[begin:end] = F.scaled_dot_product_attention(
            query[begin:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), scale=scale,
        ).transpose(0, 1)
    return out


# Pieces' keys unsplit: the pool's keys are one head that every query head shares, and the
# kernel's own choice by shape split them and combined the parts in a kernel of its own. On an
# H100 a paged call's decoder took 32.4 us a row-frame unsplit against 39.8 split, at the same
# cost a call, and the mels moved by bfloat16 rounding only, as any change of summation order
# moves them (bench/paged_call_costs.sh, 2026-12-07, twice: docs/benchmarks.md).
UNSPLIT = 1


def flash_attend(
    head_dim: int, num_splits: int = UNSPLIT,
) -> Callable[[Tensor, Tensor, Tensor, ChunkSequences, float | None], Tensor]:
    """The paged varlen FlashAttention kernel of the vLLM the GPU engine runs on (fewer key
    heads than query heads are shared, as in grouped-query attention). ``num_splits``: how
    many parts each piece's keys are split into, run in parallel and combined by a kernel of
    their own (0: the kernel's choice by shape; 1, the default: no split, no combining kernel)."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    splits = {"num_splits": num_splits} if num_splits else {}  # the kernel's own choice unless asked
    version = get_flash_attn_version(head_size=head_dim)  # FA3 on Hopper (vLLM 0.26's wheel has no FA2 kernel)

    def attend(query: Tensor, key_pages: Tensor, value_pages: Tensor, plan: ChunkSequences,
               scale: float | None = None) -> Tensor:
        return flash_attn_varlen_func(
            q=query, k=key_pages, v=value_pages, cu_seqlens_q=plan.cu_seqlens_q, max_seqlen_q=plan.max_seqlen_q,
            seqused_k=plan.seqused_k, max_seqlen_k=plan.max_seqlen_k, block_table=plan.block_table, causal=False,
            softmax_scale=scale, fa_version=version, **splits,
        )

    return attend
