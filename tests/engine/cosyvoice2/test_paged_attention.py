"""Attention over pages in place (serving/paged_attention.py) against the same attention over
the keys gathered into one tensor, as the flow's chunk-causal mask defines it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from tts_gateway.engine.cosyvoice2.serving.paged_attention import PagedKeys, paged_attention, paged_block_mask

HEADS, DIM, PAGE, CHUNK, Q_BLOCK = 2, 16, 16, 10, 16


def layout(prefix_frames: list[int], stored_frames: list[int], new_frames: list[int], total_pages: int, seed: int):
    """Per row: a voice prefix (its last page partial when it does not fill it), stored frames,
    then the new frames, each part on pages of its own drawn at random from the pool."""
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(total_pages, generator=generator).tolist()
    tables = []
    for prefix, stored, new in zip(prefix_frames, stored_frames, new_frames):
        entries, position = [], 0
        for frames in (prefix, stored, new):
            while frames > 0:
                take = min(PAGE, frames)
                entries.append((free.pop(), position, take))
                position += take
                frames -= take
        tables.append(entries)
    width = max(len(t) for t in tables)
    padded = [t + [(0, 0, 0)] * (width - len(t)) for t in tables]
    keys = PagedKeys(*(torch.tensor([[entry[i] for entry in t] for t in padded]) for i in range(3)))
    query_start = torch.tensor([p + s for p, s in zip(prefix_frames, stored_frames)])
    return keys, query_start


def gathered_attention(query, key_pool, value_pool, keys: PagedKeys, query_start, new_frames):
    """The reference: each row's keys copied out in order, a dense chunk-causal mask, SDPA."""
    out = torch.zeros_like(query)
    for row in range(keys.rows):
        parts = [(p, b, c) for p, b, c in zip(*(t[row].tolist() for t in (keys.pages, keys.base, keys.count))) if c]
        k = torch.cat([key_pool[:, p, :c] for p, _, c in parts], dim=1)
        v = torch.cat([value_pool[:, p, :c] for p, _, c in parts], dim=1)
        key_position = torch.cat([torch.arange(b, b + c) for _, b, c in parts])
        query_position = query_start[row] + torch.arange(new_frames[row])
        mask = key_position[None, :] // CHUNK <= query_position[:, None] // CHUNK
        out[row, :, : new_frames[row]] = F.scaled_dot_product_attention(
            query[row : row + 1, :, : new_frames[row]], k[None], v[None], attn_mask=mask)[0]
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_over_pages_in_place_is_attention_over_the_gathered_keys(seed):
    # Rows of a call: different prefixes (one ends mid-page, one mid-chunk), stored lengths
    # and new-frame counts, including a row with nothing stored and one new frame.
    prefix, stored, new = [30, 32, 7, 19], [40, 0, 55, 10], [20, 1, 32, 25]
    total_pages = 40
    keys, query_start = layout(prefix, stored, new, total_pages, seed)
    queries = 32  # the widest row's new frames, a whole number of query blocks
    generator = torch.Generator().manual_seed(100 + seed)
    query = torch.randn(len(prefix), HEADS, queries, DIM, generator=generator)
    key_pool = torch.randn(HEADS, total_pages, PAGE, DIM, generator=generator)
    value_pool = torch.randn(HEADS, total_pages, PAGE, DIM, generator=generator)

    mask = paged_block_mask(keys, query_start, queries, Q_BLOCK, PAGE, CHUNK, total_pages)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # FlexAttention's eager form warns it is unfused
        got = paged_attention(query, key_pool, value_pool, mask)
    want = gathered_attention(query, key_pool, value_pool, keys, query_start, new)
    for row, frames in enumerate(new):
        torch.testing.assert_close(got[row, :, :frames], want[row, :, :frames], rtol=1e-5, atol=1e-5)


def test_pages_before_the_first_new_chunk_are_listed_whole_and_the_rest_masked():
    # One row: a 20-frame prefix (a full page, then 4 frames), 12 stored frames, 8 new frames
    # starting at position 32 (chunk 3 of 10 frames).
    keys, query_start = layout([20], [12], [8], total_pages=8, seed=0)
    mask = paged_block_mask(keys, query_start, Q_BLOCK, Q_BLOCK, PAGE, CHUNK, total_pages=8)
    pages = keys.pages[0].tolist()
    whole = mask.full_kv_indices[0, 0, 0, : int(mask.full_kv_num_blocks[0, 0, 0])].tolist()
    partial = mask.kv_indices[0, 0, 0, : int(mask.kv_num_blocks[0, 0, 0])].tolist()
    # Only the prefix's first page (frames 0-15) is filled and wholly before chunk 3; the
    # prefix's partial page (16-19), the stored page (20-31, 12 of 16 frames, reaching chunk 3)
    # and the new frames' page are masked frame by frame.
    assert whole == [pages[0]]
    assert partial == pages[1:]


def test_queries_per_row_must_fill_whole_query_blocks():
    keys, query_start = layout([16], [0], [5], total_pages=4, seed=0)
    with pytest.raises(ValueError, match="query blocks"):
        paged_block_mask(keys, query_start, 20, Q_BLOCK, PAGE, CHUNK, total_pages=4)


def test_the_gpu_benchmark_of_the_lever_runs_its_variants_on_cpu_too():
    """bench/paged_attention.py runs on a GPU only when a device is lent; a crash there would
    cost the run, so its variants run here at a small shape (eager FlexAttention)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    import paged_attention as bench
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        row = bench.measure(sessions=1, stored=40, new=20, page=16, q_block=16, steps=2, repeats=1, flex=flex_attention,
                            device=torch.device("cpu"), dtype=torch.float32)
    assert {"gathered_ms", "in_place_ms", "contiguous_ms", "block_mask_build_ms"} <= row.keys()
