"""The turn pool on a GPU: vLLM's paged kernel against the reference, and paged calls against
the recompute path, at full size in bf16 (random weights: compute does not depend on them).

1. ``kernel``: one varlen call over pages as the pool makes it (one key head of the layer
   input's width that every query head shares; rows of different voice prefixes, stored
   frames and new frames, pieces cut at chunk boundaries) against ``attend_reference``.
2. ``turns``: turns streamed call by call through the pool (eager solves, the paged kernel),
   each call's new frames against the same frames solved after the voice prefix by recompute
   (SDPA over contiguous keys), with each call's time. The two paths round differently in
   bf16, so the error is bf16 noise compounded over 10 Euler steps, not zero.

Run on the device after the vLLM bundle's staging calls:
    python3 -m pip install -q --no-deps --no-build-isolation -e . \\
        && python3 bench/paged_pool_check.py --out $OUT [--sessions 4,32 --pool-gb 24]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tts_gateway.engine.cosyvoice2.model.cfm import CFM
from tts_gateway.engine.cosyvoice2.modeldir.configs import CFMConfig
from tts_gateway.engine.cosyvoice2.serving.paged_varlen import attend_reference, chunk_sequences, flash_attend
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import PrefixBank, decoder_prefix, solve_after_prefix
from tts_gateway.engine.cosyvoice2.serving.turn_pool import PagedAttention, TurnStatePool, solve_paged, turn_rows

HEADS, HEAD_DIM, DIM, CHUNK = 8, 64, 256, 50  # the estimator's heads, and its layers' input width


def kernel_check(device: torch.device) -> dict:
    generator = torch.Generator(device).manual_seed(0)
    pages, page_frames, width = 512, 16, 64
    inputs = torch.randn(pages, page_frames, 1, DIM, device=device, generator=generator).bfloat16()
    # Rows: (first new position, new frames): on and off chunk boundaries, one row with no frame.
    rows = [(100, 150), (250, 37), (0, 120), (350, 0), (150, 200)]
    queries = 200
    table = torch.randperm(pages, device=device, generator=generator)[: len(rows) * width].view(len(rows), width)
    start = torch.tensor([r[0] for r in rows], device=device)
    new = torch.tensor([r[1] for r in rows], device=device)
    plan = chunk_sequences(table, start, new, queries, CHUNK, page_frames)
    query = torch.randn(len(rows) * queries, HEADS, DIM, device=device, generator=generator).bfloat16()
    flash = flash_attend(DIM)(query, inputs, inputs, plan, HEAD_DIM**-0.5)
    reference = attend_reference(query.float(), inputs.float(), inputs.float(), plan, HEAD_DIM**-0.5)
    real = torch.cat([torch.arange(n, device=device) + r * queries for r, (_, n) in enumerate(rows)])
    return {
        "max_abs_error": float((flash.float()[real] - reference[real]).abs().max()),
        "reference_max_abs": float(reference[real].abs().max()),
        "finite": bool(torch.isfinite(flash).all()),
    }


def timed(fn, device: torch.device) -> tuple[torch.Tensor, float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    sync(device)
    started = time.perf_counter()
    out = fn()
    sync(device)
    return out, (time.perf_counter() - started) * 1000


@torch.inference_mode()
def turns_check(
    device: torch.device, sessions: int, calls: int, config: CFMConfig, attend: PagedAttention, pool_gb: float,
) -> dict:
    torch.manual_seed(0)
    cfm = CFM(config).to(device)
    for parameter in cfm.parameters():  # a spread like trained weights', not the init's
        parameter.normal_(0, 0.05)
    cfm.estimator.fuse_projections()  # the stacked copies of the weights changed in place
    cfm = cfm.to(torch.bfloat16)
    prefix, hop = 150, 50 * 2  # a 3 s voice prefix; each call adds a 2 s hop (two chunks)
    total = prefix + hop * calls + 37
    mu = torch.randn(sessions, 80, total, device=device, dtype=torch.bfloat16)
    cond = torch.zeros_like(mu)
    cond[:, :, :prefix] = torch.randn(sessions, 80, prefix, device=device, dtype=torch.bfloat16)
    spks = torch.randn(sessions, 80, device=device, dtype=torch.bfloat16)
    bank = PrefixBank(cfm, sessions, prefix, mu, keep_inputs=True)
    for slot in range(sessions):
        voice = mu[slot : slot + 1], spks[slot : slot + 1], cond[slot : slot + 1]
        bank.put(slot, decoder_prefix(cfm, *voice, prefix, keep_inputs=True))
    pool = TurnStatePool.within(cfm, int(pool_gb * 2**30), mu, attend=attend)
    slots = list(range(sessions))
    index = torch.tensor(slots, device=device)
    turns = [None] * sessions
    report = []
    for call in range(calls + 1):
        last = call == calls
        stored = [t.frames if t is not None else 0 for t in turns]
        end = min(prefix + hop * (call + 1), total) if not last else total
        ends = [end] * sessions
        commit = [0 if last else (end - prefix) // CHUNK * CHUNK - s for s in stored]
        rows, turns, served = turn_rows(bank, pool, slots, turns, ends, commit)
        if not all(served):
            raise RuntimeError(f"the pool served {served}")
        begin = prefix + stored[0]
        mask = torch.ones(sessions, 1, end - begin, device=device, dtype=torch.bfloat16)
        paged, paged_ms = timed(lambda: solve_paged(
            cfm, bank, pool, rows, mu[:, :, begin:end], mask, spks, cond[:, :, begin:end]), device)
        for b, count in enumerate(commit):
            turns[b].frames += count
        whole_mask = torch.ones(sessions, 1, end - prefix, device=device, dtype=torch.bfloat16)
        recomputed, recompute_ms = timed(lambda: solve_after_prefix(
            cfm, bank, index, mu[:, :, prefix:end], whole_mask, spks, cond[:, :, prefix:end]), device)
        tail = recomputed[:, :, begin - prefix :]
        report.append({
            "call": call, "stored_frames": stored[0], "new_frames": end - begin,
            "max_abs_error": float((paged - tail).abs().max()), "mel_max_abs": float(tail.abs().max()),
            "paged_eager_ms": round(paged_ms, 1), "recompute_eager_ms": round(recompute_ms, 1),
        })
    for turn in turns:
        pool.release(turn)
    return {"sessions": sessions, "pool_pages": pool.pages, "pages_in_use_after": pool.pages_in_use, "calls": report}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sessions", default="4", help="turns streamed together, one run per comma-separated count")
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--pool-gb", type=float, default=8.0)
    args = parser.parse_args()
    device = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "kernel": kernel_check(device)}
    print(json.dumps(result), flush=True)
    result["turns"] = [
        turns_check(device, int(n), args.calls, CFMConfig.full(), flash_attend(DIM), args.pool_gb)
        for n in args.sessions.split(",")
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paged_pool_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
