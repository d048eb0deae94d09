"""How many torch ops one flow-estimator forward (one Euler step) runs, by shape.

A paged token2wav call's decoder costs a fixed part per call on top of its row-frames
(``gpu_check``'s ``call_costs``, docs/benchmarks.md): at few rows a step takes about as long
whatever its frames. This counts what a step launches: torch's profiler over one forward of the
estimator, in streaming mode, at each ``ROWSxFRAMES`` shape; the ops that only re-view a
tensor (``VIEW_OPS``) are left out, the rest counted by name. Plain torch ops by default; with
``--fused``, as the GPU runs it with the flow's fused kernels (``flow_fused_kernels``): each
fused norm counts once, as ``fused::<kernel>``, its torch reference standing in for the kernel
on a CPU. CUDA graphs replay the same kernels.

    python bench/estimator_ops.py --size full --shapes 2x50,16x50,2x400 [--fused] --json ops.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tts_gateway.engine.cosyvoice2.model import fused_kernels, fused_norms  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.estimator import Estimator  # noqa: E402
from tts_gateway.engine.cosyvoice2.modeldir.configs import EstimatorConfig  # noqa: E402

# Ops that make no kernel of their own: views, reshapes and allocations.
VIEW_OPS = frozenset({
    "aten::view", "aten::reshape", "aten::transpose", "aten::permute", "aten::expand", "aten::slice",
    "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::as_strided", "aten::_unsafe_view",
    "aten::alias", "aten::detach", "aten::split", "aten::chunk", "aten::unbind", "aten::narrow", "aten::empty",
    "aten::empty_like", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg",
})


def shapes(text: str) -> list[tuple[int, int]]:
    """``"2x50,16x50"`` -> [(2, 50), (16, 50)]: rows (CFG rows included) x frames."""
    try:
        pairs = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes are ROWSxFRAMES, comma-separated: {text!r}") from None
    if not pairs or any(len(pair) != 2 or min(pair) < 1 for pair in pairs):
        raise argparse.ArgumentTypeError(f"shapes are ROWSxFRAMES with both at least 1: {text!r}")
    return pairs


FUSED = "fused::"  # the profiler range a fused kernel's stand-in runs in


@contextlib.contextmanager
def fused_kernels_counted() -> Iterator[None]:
    """The estimator takes its fused-kernel paths on any device; each fused norm runs its torch
    reference inside a ``fused::<kernel>`` range, counted as the one kernel it is on a GPU."""

    def norm_mish_mask(h, weight, bias, eps, mask, addend, frames_major):
        with record_function(FUSED + "norm_mish_mask"):
            out = F.mish(F.layer_norm(h.transpose(1, 2), weight.shape, weight, bias, eps).transpose(1, 2)) * mask
            return out if addend is None else out + addend

    def add_norm(x, delta, weight, bias, eps, store):
        with record_function(FUSED + "add_norm"):
            norm = torch.nn.LayerNorm(weight.shape, eps=eps, device=weight.device, dtype=weight.dtype)
            norm.weight, norm.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)
            return fused_norms.add_norm_reference(x, delta, norm, store)

    saved = fused_kernels.applies, fused_norms._norm_mish_mask_triton, fused_norms._add_norm_triton
    fused_kernels.applies = lambda _tensor: True
    fused_norms._norm_mish_mask_triton, fused_norms._add_norm_triton = norm_mish_mask, add_norm
    try:
        yield
    finally:
        fused_kernels.applies, fused_norms._norm_mish_mask_triton, fused_norms._add_norm_triton = saved


@torch.inference_mode()
def count_ops(estimator: Estimator, rows: int, frames: int, device: torch.device) -> collections.Counter[str]:
    """The top-level torch ops (not views) of one streaming forward at this shape, by name."""
    x, mu, cond = (torch.randn(rows, 80, frames, device=device) for _ in range(3))
    mask = torch.ones(rows, 1, frames, device=device)
    t, spks = torch.rand(rows, device=device), torch.randn(rows, 80, device=device)
    estimator(x, mask, mu, t, spks, cond, streaming=True)  # warm-up: first-call set-up is not a step's work
    with profile(activities=[ProfilerActivity.CPU]) as trace:  # the ops as torch dispatches them
        estimator(x, mask, mu, t, spks, cond, streaming=True)

    def top_level(event) -> bool:  # not called from inside another torch op or a fused kernel
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(("aten::", FUSED)):
                return False
            parent = parent.cpu_parent
        return True

    return collections.Counter(
        event.name for event in trace.events()
        if event.name.startswith(("aten::", FUSED)) and top_level(event) and event.name not in VIEW_OPS
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", type=shapes, default=shapes("2x50,16x50,2x400"))
    parser.add_argument("--fused", action="store_true", help="count as the GPU runs it with the fused kernels")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = EstimatorConfig.full() if args.size == "full" else EstimatorConfig.tiny()
    torch.manual_seed(0)  # the op count does not depend on the weights
    estimator = Estimator(config).eval().to(device)
    results = []
    for rows, frames in args.shapes:
        with fused_kernels_counted() if args.fused else contextlib.nullcontext():
            ops = count_ops(estimator, rows, frames, device)
        results.append({"rows": rows, "frames": frames, "ops": sum(ops.values()), "by_name": dict(ops.most_common())})
        print(f"{rows} x {frames}: {sum(ops.values())} ops", flush=True)
    report = {"size": args.size, "device": str(device), "fused": args.fused, "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
