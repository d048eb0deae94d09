"""Token encoder: eager against CUDA graph replay, for the first-chunk lane's whole encodes
(serving/encoder_graphs.py) and the paged calls' incremental steps (serving/incremental_encoder_graphs.py,
``paged_encoder_graphs``).

Builds the flow's token encoder of the full (or tiny) CosyVoice2 config with seeded random
weights (the work does not depend on them) and:

- **lane**: for each of ``--batches``, rows of a ``--prompt``-token voice prompt and a first chunk
  (``--first`` tokens and the look-ahead; the rows' chunks differ by a token or two), encoded by
  ``encode_tokens`` and by ``EncoderGraphs.run`` (graphs at the widths start-up gives the lane);
- **paged**: ``--turns`` turns stepped together through ``--feeds`` (a turn's first paged call
  carries its prompt; then the schedule's growing hops), once by the eager incremental
  encoder and once with ``IncrementalEncoderGraphs`` (the engine's default buckets).

Each reports the milliseconds a call took (synchronised; the lane's the median of
``--repeats``), the largest |graph - eager| of mu, and capture time and memory. On a machine
without CUDA the same programs run eagerly on their padded static buffers instead of being
captured (a note says so): the CPU smoke test (tests/bench/test_benches.py).

    python bench/encoder_graphs.py --size full --device cuda --dtype bfloat16 --json out.json
    python bench/encoder_graphs.py --size tiny --device cpu --dtype float32 --batches 1,3 --turns 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tts_gateway.testkit.checkpoint import checkpoint_configs  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.flow_encoder import TokenEncoder, encode_tokens  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.loading import DTYPES  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.encoder_graphs import EncoderGraphs  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.incremental_encoder import (  # noqa: E402
    EncoderStreamState, IncrementalEncoder,
)
from tts_gateway.engine.cosyvoice2.serving.incremental_encoder_graphs import IncrementalEncoderGraphs  # noqa: E402

NO_CUDA_NOTE = "no CUDA device: the graphs' programs ran eagerly on their static buffers, nothing was captured"
LANE_BATCHES = (1, 2, 4, 8)  # scheduler.FIRST_LANE_MAX_BATCH's buckets
CHUNK = 25  # tokens of an encoder chunk (static_chunk_size)
LOOKAHEAD = 3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(call: Callable[[], object], device: torch.device) -> tuple[float, object]:
    sync(device)
    started = time.perf_counter()
    result = call()
    sync(device)
    return (time.perf_counter() - started) * 1000, result


def reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def lane(encoder: TokenEncoder, args, device: torch.device, dtype: torch.dtype) -> dict:
    """The lane's whole encodes: eager ``encode_tokens`` against the graphs, batch by batch."""
    widths = sorted({math.ceil((args.prompt + hop) / CHUNK) * CHUNK for hop in (args.first, args.official_first)})
    before = reserved(device)
    started = time.perf_counter()
    graphs = EncoderGraphs(encoder, LANE_BATCHES, widths, graphs=device.type == "cuda")
    if graphs.use_graphs:
        graphs.capture()
    report = {"widths": widths, "graphs": len(graphs.programs), "capture_s": round(time.perf_counter() - started, 2),
              "memory_mb": round((reserved(device) - before) / 2**20, 1), "batches": []}
    generator = torch.Generator().manual_seed(args.seed)
    for batch in args.batches:
        firsts = [args.first + LOOKAHEAD - (row % 2) for row in range(batch)]
        token = torch.randint(0, 6561, (batch, max(firsts)), generator=generator).to(device)
        token_len = torch.tensor(firsts, device=device)
        prompt = torch.randint(0, 6561, (batch, args.prompt), generator=generator).to(device)
        prompt_len = torch.full((batch,), args.prompt, device=device)
        embedding = torch.randn(batch, 192, generator=generator).to(device, dtype)
        totals = [args.prompt + n for n in firsts]
        with torch.inference_mode():
            def eager() -> tuple[Tensor, ...]:
                return encode_tokens(encoder, token, token_len, prompt, prompt_len, embedding, True, False)

            def replay() -> tuple[Tensor, ...]:
                return graphs.run(token, token_len, prompt, prompt_len, embedding, totals, False)

            times: dict[str, list[float]] = {"eager": [], "graph": []}
            for _ in range(args.repeats + 1):  # the first round warms up
                for name, call in (("eager", eager), ("graph", replay)):
                    times[name].append(timed_ms(call, device)[0])
            expected, got = eager(), replay()
        report["batches"].append({
            "batch": batch,
            "eager_ms": round(statistics.median(times["eager"][1:]), 2),
            "graph_ms": round(statistics.median(times["graph"][1:]), 2),
            "graph_vs_eager_max_abs": float((got[0].float() - expected[0].float()).abs().max()),
            "mu_max_abs": float(expected[0].float().abs().max()),
        })
        print(json.dumps({"lane": report["batches"][-1]}), flush=True)
    return report


def paged(encoder: TokenEncoder, args, device: torch.device) -> dict:
    """The paged calls' incremental steps of ``--turns`` turns: eager, then by the graphs."""
    before = reserved(device)
    started = time.perf_counter()
    graphs = IncrementalEncoderGraphs(encoder, args.max_batch, graphs=device.type == "cuda")
    if graphs.use_graphs:
        graphs.capture()
    report = {"graphs": len(graphs.programs), "capture_s": round(time.perf_counter() - started, 2),
              "memory_mb": round((reserved(device) - before) / 2**20, 1), "steps": []}
    generator = torch.Generator().manual_seed(args.seed + 1)
    feeds = [[torch.randint(0, 6561, (n + turn % 3,), generator=generator).to(device) for turn in range(args.turns)]
             for n in args.feeds]
    eager, by_graphs = IncrementalEncoder(encoder), IncrementalEncoder(encoder)
    by_graphs.graphs = graphs
    eager_states = [EncoderStreamState() for _ in range(args.turns)]
    graph_states = [EncoderStreamState() for _ in range(args.turns)]
    with torch.inference_mode():
        eager.step([EncoderStreamState()], [feeds[0][0]])  # warm-up (the first call sets up the libraries)
        for tokens in feeds:
            cached = max(s.committed for s in eager_states)
            eager_ms, expected = timed_ms(lambda: eager.step(eager_states, tokens), device)
            graph_ms, got = timed_ms(lambda: by_graphs.step(graph_states, tokens), device)
            step = {
                "new_tokens": max(len(t) for t in tokens),
                "cached_tokens": cached,
                "eager_ms": round(eager_ms, 2),
                "graph_ms": round(graph_ms, 2),
                "by_graph": got.by_graph,
                "graph_vs_eager_max_abs": float((got.mu.float() - expected.mu.float()).abs().max()),
                "mu_max_abs": float(expected.mu.float().abs().max()),
            }
            report["steps"].append(step)
            print(json.dumps({"paged": step}), flush=True)
    return report


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--prompt", type=int, default=90, help="voice prompt tokens (the benchmark voice's)")
    parser.add_argument("--first", type=int, default=10, help="a short first chunk's tokens")
    parser.add_argument("--official-first", type=int, default=35, help="the official first chunk's tokens")
    parser.add_argument("--batches", default="1,8", help="lane calls' rows")
    parser.add_argument("--turns", type=int, default=16, help="rows of the paged steps")
    parser.add_argument("--feeds", default="103,25,50,100,200",
                        help="tokens each paged step gives a turn (the first: its prompt and first chunk)")
    parser.add_argument("--max-batch", type=int, default=64, help="max_batch of the paged graphs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.feeds = [int(n) for n in args.feeds.split(",")]
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type != "cuda":
        print(NO_CUDA_NOTE, flush=True)
    flow_config = checkpoint_configs(args.size)[1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        encoder = TokenEncoder(flow_config.encoder, flow_config.vocab_size, flow_config.output_size,
                               flow_config.spk_embed_dim)
    encoder = encoder.to(device=device, dtype=dtype).eval().requires_grad_(False)
    report = {
        "size": args.size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "lane": lane(encoder, args, device, dtype),
        "paged": paged(encoder, args, device),
    }
    if device.type != "cuda":
        report["note"] = NO_CUDA_NOTE
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
