"""Chunk-causal attention over paged keys as one varlen call (serving/paged_varlen.py): its
plan of query pieces, run through the kernel's semantics, equals attention under the flow's own
chunk-causal mask over the same keys laid out contiguously."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tts_gateway.engine.cosyvoice2.model.estimator import chunk_attention_mask
from tts_gateway.engine.cosyvoice2.serving.paged_varlen import (
    attend_reference,
    chunk_sequences,
    pieces_per_row,
)

HEADS, DIM, PAGE, CHUNK = 2, 8, 16, 10


def paged_rows(query_start: list[int], new_frames: list[int], queries: int, seed: int):
    """Random keys and values for each row's frames on pages scattered over a pool, and
    ``queries`` queries per row (the first ``new_frames[r]`` real)."""
    generator = torch.Generator().manual_seed(seed)
    totals = [s + n for s, n in zip(query_start, new_frames)]
    widths = [-(-t // PAGE) for t in totals]
    pool_pages = sum(widths) + 3
    order = torch.randperm(pool_pages, generator=generator).tolist()
    table = torch.zeros(len(totals), max(widths), dtype=torch.long)
    for row, width in enumerate(widths):
        table[row, :width] = torch.tensor([order.pop() for _ in range(width)])
    key_pages = torch.randn(pool_pages, PAGE, HEADS, DIM, generator=generator, dtype=torch.float64)
    value_pages = torch.randn(pool_pages, PAGE, HEADS, DIM, generator=generator, dtype=torch.float64)
    query = torch.randn(len(totals) * queries, HEADS, DIM, generator=generator, dtype=torch.float64)
    return table, key_pages, value_pages, query


def masked_attention(query, key_pages, value_pages, table, query_start, new_frames, queries):
    """Row by row: its keys read out contiguously, the flow's chunk-causal mask, SDPA."""
    out = []
    for row, (start, new) in enumerate(zip(query_start, new_frames)):
        total = start + new
        keys = key_pages[table[row]].flatten(0, 1)[:total].transpose(0, 1)
        values = value_pages[table[row]].flatten(0, 1)[:total].transpose(0, 1)
        q = query[row * queries : row * queries + new].transpose(0, 1)
        mask = chunk_attention_mask(torch.ones(1, total, dtype=torch.bool), torch.arange(start, total)[None], CHUNK)
        out.append(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[0]).transpose(0, 1))
    return out


@pytest.mark.parametrize(
    ("query_start", "new_frames", "queries"),
    [
        ([30, 60, 0], [10, 10, 10], 16),  # one whole chunk each, from chunk boundaries
        ([33, 47, 5, 120], [25, 3, 30, 1], 32),  # pieces cut mid-chunk, a last chunk not whole
        ([300, 17, 88], [48, 48, 0], 48),  # several chunks per row; a row with no new frame
    ],
)
def test_pieces_equal_the_flow_chunk_causal_mask(query_start, new_frames, queries):
    table, key_pages, value_pages, query = paged_rows(query_start, new_frames, queries, seed=len(query_start))
    plan = chunk_sequences(table, torch.tensor(query_start), torch.tensor(new_frames), queries, CHUNK, PAGE)
    rows = len(query_start)
    assert plan.cu_seqlens_q.shape == (rows * pieces_per_row(queries, CHUNK) + 1,)
    assert plan.cu_seqlens_q[-1] == rows * queries and bool((plan.cu_seqlens_q.diff() >= 0).all())
    got = attend_reference(query, key_pages, value_pages, plan)
    expected = masked_attention(query, key_pages, value_pages, table, query_start, new_frames, queries)
    for row, (want, new) in enumerate(zip(expected, new_frames)):
        torch.testing.assert_close(got[row * queries : row * queries + new], want, rtol=0, atol=1e-12)


def test_each_piece_stays_inside_one_chunk_and_sees_up_to_its_end():
    query_start, new_frames, queries = torch.tensor([7, 40]), torch.tensor([26, 10]), 32
    table = torch.arange(2 * 4).view(2, 4)
    plan = chunk_sequences(table, query_start, new_frames, queries, CHUNK, PAGE)
    per_row = pieces_per_row(queries, CHUNK)
    cu, used = plan.cu_seqlens_q.tolist(), plan.seqused_k.tolist()
    pieces = [(cu[k], cu[k + 1], used[k]) for k in range(2 * per_row) if cu[k + 1] > cu[k]]
    # Row 0: positions 7..32 -> chunks [7,10) [10,20) [20,30) [30,33), then its padding queries.
    # Row 1: positions 40..49 -> one piece, then padding.
    assert pieces == [(0, 3, 10), (3, 13, 20), (13, 23, 30), (23, 26, 33), (26, 32, 33), (32, 42, 50), (42, 64, 50)]
    assert plan.block_table.shape == (2 * per_row, 4)
    assert plan.block_table[per_row].tolist() == table[1].tolist()
