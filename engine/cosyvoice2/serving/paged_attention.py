"""Attention that reads a turn's stored keys and values where they lie, in a pool of pages.

The paged flow (turn_pool.py) first gathered every stored page of a row by index and
concatenated it behind the voice prefix and the new frames, in every attention layer at every
Euler step, and then gave SDPA a dense mask. On the H200 that copy and the masked kernel made
each new frame ~2.5x dearer than a recomputed one (docs/benchmarks.md, "turn state in a paged
pool"). Here the keys stay in the pool: a FlexAttention block mask lists, per block of a row's
queries, the pages that row reads, so the kernel walks the page table itself.

Layout. One layer's keys (or values) at one Euler step are a pool ``[heads, pages,
page_frames, head_dim]``; seen as one sequence ``[1, heads, pages * page_frames, head_dim]``,
page ``p`` is key block ``p`` when the block size is ``page_frames``. Every CFG row of every
turn is a row here; each row's keys are a list of page entries in key order (its voice
prefix, shared with every turn of that voice, then its stored chunks, then the pages its new
frames were just written to). An entry says which page, the position of its first frame (the
prefix may end mid-page, so positions are not page-aligned), and how many of its frames hold
keys. The queries of all rows are one sequence too, each row's padded to ``queries`` (a whole
number of query blocks), so no query block spans two rows.

Mask. A key is visible to a query if it is in one of the row's entries, within the entry's
count, and its attention chunk is not after the query's: the flow's chunk-causal rule. Entries
before the new frames' first chunk are visible whole to every query of the row ("full"
blocks: the kernel skips the mask there); the others are "partial" and the mask decides frame
by frame.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask


@dataclass(frozen=True)
class PagedKeys:
    """Where each row's keys lie: ``[rows, entries]`` tables, entries in key order.

    Padding entries (rows with fewer entries than the widest) have ``count`` 0."""

    pages: Tensor  # long: the page of each entry
    base: Tensor  # long: the position (in the row's frames) of the entry's first frame
    count: Tensor  # long: how many of the entry's frames hold keys

    @property
    def rows(self) -> int:
        return self.pages.shape[0]


def paged_block_mask(keys: PagedKeys, query_start: Tensor, queries: int, q_block: int, page_frames: int,
                     chunk: int, total_pages: int) -> BlockMask:
    """The block mask of one call: row ``r``'s ``queries`` queries (positions ``query_start[r]``
    on) against the keys ``keys`` lists in a pool of ``total_pages`` pages of ``page_frames``.

    Built from the page tables directly, never by evaluating the mask over the whole pool."""
    if queries % q_block:
        raise ValueError(f"{queries} queries per row is not a whole number of {q_block}-query blocks")
    rows, width = keys.pages.shape
    device = keys.pages.device
    # An entry is visible whole to every query of its row when it ends before the chunk of
    # the row's first query, and it is filled to the page's end (else the count masks it).
    ends = keys.base + keys.count
    whole = (keys.count == page_frames) & ((ends - 1) // chunk < query_start[:, None] // chunk)
    used = keys.count > 0
    partial = used & ~whole

    def listed(selected: Tensor) -> tuple[Tensor, Tensor]:
        # Selected entries first, in key order (a stable sort on "not selected").
        order = torch.sort((~selected).to(torch.int8), dim=1, stable=True).indices
        indices = keys.pages.gather(1, order).to(torch.int32)
        blocks_per_row = queries // q_block
        count = selected.sum(dim=1, dtype=torch.int32)
        expand = (rows, blocks_per_row)
        return (count[:, None].expand(expand).reshape(1, 1, -1),
                indices[:, None, :].expand(rows, blocks_per_row, width).reshape(1, 1, rows * blocks_per_row, width))

    num_partial, partial_indices = listed(partial)
    num_whole, whole_indices = listed(whole)
    # Page -> the row's entry holding it (-1: none). Padding entries write to one column past
    # the pool, dropped after, so that no host sync sorts them out.
    entry_of_page = torch.full((rows, total_pages + 1), -1, dtype=torch.long, device=device)
    entry_of_page.scatter_(1, keys.pages.where(used, total_pages), torch.arange(width, device=device).expand(rows, -1))
    entry_of_page = entry_of_page[:, :total_pages]
    mask_mod = chunk_causal_pages(entry_of_page, keys, query_start, queries, page_frames, chunk)
    return BlockMask.from_kv_blocks(num_partial, partial_indices, num_whole, whole_indices,
                                    BLOCK_SIZE=(q_block, page_frames), mask_mod=mask_mod,
                                    seq_lengths=(rows * queries, total_pages * page_frames),
                                    compute_q_blocks=False)  # forward only: no transposed (backward) tables


def chunk_causal_pages(entry_of_page: Tensor, keys: PagedKeys, query_start: Tensor, queries: int,
                       page_frames: int, chunk: int) -> Callable:
    """FlexAttention's mask function for :func:`paged_block_mask` (indices are flat: query
    ``q`` of the call is row ``q // queries``; key ``k`` is frame ``k % page_frames`` of page
    ``k // page_frames``)."""

    def mask(batch, head, q_index, kv_index):
        row = q_index // queries
        query_position = query_start[row] + q_index % queries
        entry = entry_of_page[row, kv_index // page_frames]
        listed = entry >= 0
        entry = entry.clamp(min=0)
        offset = kv_index % page_frames
        key_position = keys.base[row, entry] + offset
        return listed & (offset < keys.count[row, entry]) & (key_position // chunk <= query_position // chunk)

    return mask


def paged_attention(query: Tensor, key_pool: Tensor, value_pool: Tensor, block_mask: BlockMask,
                    attend: Callable | None = None) -> Tensor:
    """Attention of ``query`` ``[rows, heads, queries, head_dim]`` over the pools
    ``[heads, pages, page_frames, head_dim]`` as ``block_mask`` (:func:`paged_block_mask`) lists.

    ``attend`` is FlexAttention, compiled on a GPU (``torch.compile(flex_attention)``); its
    eager form (the default) materialises the scores and is only fit for checking."""
    if attend is None:
        from torch.nn.attention.flex_attention import flex_attention as attend
    rows, heads, queries, dim = query.shape
    flat_query = query.transpose(0, 1).reshape(1, heads, rows * queries, dim)
    flat_keys = key_pool.reshape(1, heads, -1, dim)
    flat_values = value_pool.reshape(1, heads, -1, dim)
    out = attend(flat_query, flat_keys, flat_values, block_mask=block_mask)
    return out.reshape(heads, rows, queries, dim).transpose(0, 1)
