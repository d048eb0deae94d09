"""What one flow attention layer costs over a turn's stored pages: gathered vs read in place.

The paged flow's first H200 run (docs/benchmarks.md, "turn state in a paged pool") found each
new frame ~2.5x dearer than a recomputed one, and blamed the per-layer gather + concatenation
of the stored pages and the dense mask. Before building the pool around in-place attention,
this measures the lever on its own, at the shapes a call has (rows = 2 x sessions for CFG,
8 heads of 64, a 300-frame voice prefix, ``--stored`` frames stored, one chunk of new frames):

- ``gathered``: the pages gathered by index, concatenated behind the prefix, a dense
  chunk-causal mask, SDPA (what the pool's first design did in every layer);
- ``in_place``: compiled FlexAttention walking the page table (serving/paged_attention.py);
- ``varlen``: vLLM's paged FlashAttention kernel, one query piece per chunk, pages of 16 frames
  (serving/paged_varlen.py; needs vLLM 0.26 importable, else the
  result says why it did not run);
- ``contiguous``: SDPA over keys already contiguous, no mask (a floor: the keys read once).

GPU only. Device call, after the vLLM bundle's staging calls (without them every arm but
``varlen`` still runs):
    python3 -m pip install -q --no-deps --no-build-isolation -e . \
        && python3 bench/paged_attention.py --out $OUT
Writes $OUT/paged_attention.json: milliseconds per layer call, and per chunk (x 56 layers x
``--steps`` Euler steps), for each shape.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_gateway.engine.cosyvoice2.serving.paged_attention import PagedKeys, paged_attention, paged_block_mask  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.paged_varlen import chunk_sequences, flash_attend  # noqa: E402

HEADS, DIM, LAYERS, CHUNK, PREFIX = 8, 64, 56, 50, 300
VARLEN_PAGE = 16  # the kernel's page size must be a multiple of 16 frames


def pages_of(rows: int, frames: int, page: int, pool_pages: int, device) -> tuple[PagedKeys, torch.Tensor]:
    """Each row's prefix, stored and new frames on pages scattered over the pool."""
    per_row = -(-frames // page)
    order = torch.randperm(pool_pages, device=device)[: rows * per_row].view(rows, per_row)
    base = torch.arange(per_row, device=device).expand(rows, -1) * page
    count = (frames - base).clamp(0, page)
    return PagedKeys(order, base, count), order


def varlen_call(rows: int, frames: int, new: int, device, dtype):
    """The varlen arm: every row's frames on 16-frame pages scattered over a pool, its new frames'
    queries one chunk-aligned piece each. Returns (the call, the plan's build), or why it cannot run.
    The kernel runs as the engine's (keys unsplit since 2026-12-07; the kernel's own split before,
    in the runs of docs/benchmarks.md until then)."""
    try:
        attend = flash_attend(DIM)
    except Exception as error:  # noqa: BLE001 - reported in the result; the other arms still run
        return f"{type(error).__name__}: {error}"[:300], None
    per_row = -(-frames // VARLEN_PAGE)
    pool_pages = rows * per_row + 64
    key_pages = torch.randn(pool_pages, VARLEN_PAGE, HEADS, DIM, device=device, dtype=dtype)
    value_pages = torch.randn_like(key_pages)
    table = torch.randperm(pool_pages, device=device)[: rows * per_row].view(rows, per_row)
    query = torch.randn(rows * new, HEADS, DIM, device=device, dtype=dtype)
    starts = torch.full((rows,), frames - new, device=device)
    news = torch.full((rows,), new, device=device)

    def build_plan():
        return chunk_sequences(table, starts, news, new, CHUNK, VARLEN_PAGE)

    plan = build_plan()
    return (lambda: attend(query, key_pages, value_pages, plan)), build_plan


def timed(fn, repeats: int, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - started) / repeats * 1000.0


def measure(sessions: int, stored: int, new: int, page: int, q_block: int, steps: int, repeats: int, flex,
            device: torch.device, dtype: torch.dtype, stages: int = 1) -> dict:
    rows = 2 * sessions
    frames = PREFIX + stored + new
    per_row = -(-frames // page)
    pool_pages = rows * per_row + 64
    key_pool = torch.randn(HEADS, pool_pages, page, DIM, device=device, dtype=dtype)
    value_pool = torch.randn_like(key_pool)
    keys, order = pages_of(rows, frames, page, pool_pages, device)
    queries = -(-new // q_block) * q_block
    query = torch.randn(rows, HEADS, queries, DIM, device=device, dtype=dtype)
    query_start = torch.full((rows,), PREFIX + stored, device=device)

    def gathered():
        k = key_pool[:, order].permute(1, 0, 2, 3, 4).reshape(rows, HEADS, per_row * page, DIM)
        v = value_pool[:, order].permute(1, 0, 2, 3, 4).reshape(rows, HEADS, per_row * page, DIM)
        k = torch.cat([k, query], dim=2)  # the new frames' keys concatenated, as the view does
        v = torch.cat([v, query], dim=2)
        key_position = torch.arange(k.shape[2], device=device)
        query_position = query_start[:, None] + torch.arange(queries, device=device)
        mask = (key_position[None, None, :] // CHUNK) <= (query_position[:, :, None] // CHUNK)
        return F.scaled_dot_product_attention(query, k, v, attn_mask=mask[:, None])

    def build_mask():
        return paged_block_mask(keys, query_start, queries, q_block, page, CHUNK, pool_pages)

    block_mask = build_mask()

    # The kernel's tiles must divide the mask's blocks (its default tiles on Hopper are larger
    # than a 64-frame page), and its pipeline must fit shared memory (on the H100, 64x64 tiles
    # asked 256000 bytes of the 232448 there). The first of these tile/stage choices that compiles
    # is measured, and named in the result.
    tilings = [(q_block, page, stages)] + [(tile, tile, 1) for tile in (32, 16) if tile < min(q_block, page)]
    failures = []
    for block_m, block_n, num_stages in tilings:
        kernel_options = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_stages": num_stages}
        attend = functools.partial(flex, kernel_options=kernel_options)

        def in_place(attend=attend):
            return paged_attention(query, key_pool, value_pool, block_mask, attend=attend)

        try:
            in_place()
            break
        except Exception as error:  # noqa: BLE001 - the next tiling is tried; each failure is reported
            failures.append({**kernel_options, "error": f"{type(error).__name__}: {error}"[:300]})
    else:
        in_place = None  # no tiling compiled: the failures say why, and the other arms still run

    contiguous_k = torch.randn(rows, HEADS, frames, DIM, device=device, dtype=dtype)
    varlen, build_plan = varlen_call(rows, frames, new, device, dtype)

    def contiguous():
        return F.scaled_dot_product_attention(query, contiguous_k, contiguous_k)

    result = {"sessions": sessions, "stored": stored, "new": new, "page": page, "q_block": q_block,
              "kernel_options": kernel_options, "tilings_failed": failures}
    arms = [("gathered", gathered), ("contiguous", contiguous), ("block_mask_build", build_mask)]
    if in_place is not None:
        arms.append(("in_place", in_place))
    if isinstance(varlen, str):
        result["varlen_error"] = varlen
    else:
        arms += [("varlen", varlen), ("varlen_plan_build", build_plan)]
    for name, fn in arms:
        ms = timed(fn, repeats, device)
        result[f"{name}_ms"] = round(ms, 4)
        if not name.endswith("_build"):
            result[f"{name}_ms_per_chunk"] = round(ms * LAYERS * steps, 1)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sessions", default="8,32,64")
    parser.add_argument("--stored", default="500,1000,2000", help="frames stored after the prefix")
    parser.add_argument("--new", type=int, default=50, help="new frames per row (one chunk)")
    parser.add_argument("--page", type=int, default=64, help="frames per page (the key block size)")
    parser.add_argument("--q-block", type=int, default=64)
    parser.add_argument("--stages", type=int, default=1, help="the in-place kernel's pipeline stages")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import flex_attention

    # One compile per shape and tiling: more than dynamo's default limit of 8 in one run, past
    # which it would silently fall back to the eager kernel and time that instead.
    torch._dynamo.config.recompile_limit = 64
    flex = torch.compile(flex_attention, dynamic=False)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": []}
    for sessions in (int(n) for n in args.sessions.split(",")):
        for stored in (int(n) for n in args.stored.split(",")):
            try:
                row = measure(sessions, stored, args.new, args.page, args.q_block, args.steps, args.repeats, flex,
                              torch.device("cuda"), torch.bfloat16, args.stages)
            except Exception as error:  # noqa: BLE001 - recorded, and the next shape still runs
                row = {"sessions": sessions, "stored": stored, "error": f"{type(error).__name__}: {error}"[:2000]}
            report["results"].append(row)
            print(json.dumps(row), flush=True)
            (args.out / "paged_attention.json").write_text(json.dumps(report, indent=1))
    return 0 if all("error" not in row for row in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
