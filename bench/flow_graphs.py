"""Flow decoder solve (10 Euler steps with CFG): eager vs CUDA graph replay, per batch.

Builds the flow's decoder (``CFM``: estimator + solver) of the full (or tiny) CosyVoice2
config with seeded default-initialised random weights, as ``make_checkpoint`` does (the
work per solve does not depend on the weights), and for every batch size:

- captures the solve's graph (``FlowGraphs``; bucket = the batch bucket >= B and
  ``--frames`` rounded up to a ``--frame-step`` multiple), reporting capture time and
  the graph memory (``FlowGraphs.reserved_bytes``: pool + static buffers, cumulative);
- times one solve eagerly and by graph replay (median of ``--repeats`` rounds, each
  running both, synchronised; the replay time includes padding the inputs into the static buffers and copying the
  result out, i.e. what ``CFM.forward`` costs the engine);
- checks the replay: max abs difference vs the eager solve in the same dtype, and vs
  the padded eager solve (same shapes as the graph, so the same kernels); and the
  precision: max abs difference of the ``--dtype`` eager and graph solves vs a float32
  eager solve (TF32 off) on the same inputs, relative to the float32 output's max abs.

Rows have different lengths (row r is ``--frames`` - (7 r mod 50) frames), so frame and
batch padding are both exercised. On a machine without CUDA the graph part is skipped
(said in the output and the JSON); the eager and padded-eager parts still run, which is
the smoke test (tests/bench/test_benches.py).

    python bench/flow_graphs.py --size full --device cuda --dtype bfloat16 --batches 1,8,32,64,128 --json out.json
    python bench/flow_graphs.py --size tiny --device cpu --batches 1,3 --frames 60 --repeats 1
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tts_gateway.testkit.checkpoint import checkpoint_configs  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.cfm import CFM  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.buckets import FlowBuckets  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.flow_graphs import FlowGraphs, solve_padded  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.loading import DTYPES  # noqa: E402

NO_CUDA_NOTE = "no CUDA device: graph capture and replay skipped; only the eager and padded eager solves ran"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(solves: dict[str, Callable[[], Tensor]], repeats: int, device: torch.device) -> dict[str, float]:
    """Median ms of each solve; one round runs each once, so slow drifts (clocks, heat) hit all alike."""
    for solve in solves.values():
        solve()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in solves}
    for _ in range(repeats):
        for name, solve in solves.items():
            sync(device)
            started = time.perf_counter()
            solve()
            sync(device)
            times[name].append(time.perf_counter() - started)
    return {name: round(statistics.median(t) * 1000, 2) for name, t in times.items()}


@contextmanager
def exact_float32() -> Iterator[None]:
    """TF32 off for matmuls and convolutions: the float32 reference is really float32."""
    matmul, conv = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, conv


def decoder_inputs(batch: int, frames: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mu, mask, spks, cond (float32, CPU), rows of different lengths; cond: a "prompt mel" in the first third."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([max(1, frames - (7 * row) % 50) for row in range(batch)])
    valid = (torch.arange(frames) < lengths[:, None])[:, None, :].float()
    mu = torch.randn(batch, 80, frames, generator=generator) * valid
    cond = torch.randn(batch, 80, frames, generator=generator) * valid
    cond[:, :, frames // 3 :] = 0
    spks = torch.randn(batch, 80, generator=generator)
    return mu, valid, spks, cond


def max_abs(a: Tensor, b: Tensor, valid: Tensor) -> float:
    """Max abs difference over the real frames (``valid`` [B, 1, T])."""
    return float(((a.float() - b.float()).abs() * valid).max())


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--frames", type=int, default=356, help="frames of the longest row (prompt + tokens so far)")
    parser.add_argument("--frame-step", type=int, default=50, help="frame bucket size")
    parser.add_argument("--attention", choices=("chunk", "full"), default="chunk",
                        help="chunk: streaming (non-final chunks); full: the final chunk's solve")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    batches = [int(b) for b in args.batches.split(",")]
    streaming = args.attention == "chunk"
    use_graphs = device.type == "cuda"
    if not use_graphs:
        print(NO_CUDA_NOTE, flush=True)

    flow_config = checkpoint_configs(args.size)[1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        reference = CFM(flow_config.decoder).float().eval()
    cfm = copy.deepcopy(reference).to(device=device, dtype=dtype)
    reference.to(device)
    buckets = FlowBuckets.up_to(max(batches), args.frames, args.frame_step)

    captures: dict[int, dict] = {}
    graphs = None
    if use_graphs:
        graphs = FlowGraphs(cfm, buckets)
        for batch in sorted(batches, reverse=True):  # largest first: the others reuse its pool blocks
            started = time.perf_counter()
            graphs.capture([batch], [args.frames], [streaming])
            captures[batch] = {
                "capture_s": round(time.perf_counter() - started, 2),
                "graph_memory_mb_after": round(graphs.reserved_bytes / 2**20, 1),
            }

    results = []
    for batch in batches:
        mu, mask, spks, cond = (t.to(device) for t in decoder_inputs(batch, args.frames, args.seed + batch))
        low = [t.to(dtype) for t in (mu, mask, spks, cond)]
        with torch.inference_mode():

            def eager() -> Tensor:
                return cfm(*low, streaming)

            def replay() -> Tensor:
                return graphs.run(*low, streaming)

            solves = {"eager": eager} if graphs is None else {"eager": eager, "graph": replay}
            timed = median_ms(solves, args.repeats, device)
            eager_mel = eager()
            padded_mel = solve_padded(cfm, buckets, *low, streaming)
            graph_mel = None if graphs is None else replay()
            if dtype == torch.float32:
                fp32_mel = eager_mel
            else:
                with exact_float32():
                    fp32_mel = reference(mu, mask, spks, cond, streaming)
        scale = float((fp32_mel.abs() * mask).max())
        key = buckets.key(batch, args.frames, streaming)
        row = {
            "batch": batch,
            "bucket": [key.batch, key.frames],
            "eager_ms": timed["eager"],
            "padded_eager_vs_eager_max_abs": max_abs(padded_mel, eager_mel, mask),
            "fp32_max_abs": round(scale, 3),
            "eager_vs_fp32_rel": max_abs(eager_mel, fp32_mel, mask) / scale,
        }
        if graph_mel is not None:
            row.update(
                graph_ms=timed["graph"],
                speedup=round(timed["eager"] / timed["graph"], 2),
                graph_vs_eager_max_abs=max_abs(graph_mel, eager_mel, mask),
                graph_vs_padded_eager_max_abs=max_abs(graph_mel, padded_mel, mask),
                graph_vs_fp32_rel=max_abs(graph_mel, fp32_mel, mask) / scale,
                **captures[batch],
            )
        results.append(row)
        print(json.dumps(row), flush=True)

    report = {
        "size": args.size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "attention": args.attention,
        "frames": args.frames,
        "frame_step": args.frame_step,
        "row_lengths": "row r: frames - (7 r mod 50)",
        "results": results,
    }
    if graphs is not None:
        report["graphs"] = len(graphs.graphs)
        report["graph_memory_mb"] = round(graphs.reserved_bytes / 2**20, 1)
        report["capture_s_total"] = round(graphs.capture_seconds, 2)
        report["peak_memory_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    else:
        report["note"] = NO_CUDA_NOTE
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
