"""How many torch ops one flow-estimator forward (one Euler step) runs, by shape.

A paged token2wav call's decoder costs a fixed part per call on top of its row-frames
(``gpu_check``'s ``call_costs``, docs/benchmarks.md): at few rows a step takes about as long
whatever its frames. This counts what a step launches: torch's profiler over one forward of the
estimator, in streaming mode, at each ``ROWSxFRAMES`` shape; the ops that only re-view a
tensor (``VIEW_OPS``) are left out, the rest counted by name. Plain torch ops by default; with
``--fused``, as the GPU runs it with the flow's fused kernels (``flow_fused_kernels``): each
fused kernel counts once, as ``kernel::<name>``, its torch reference standing in for it on a CPU.
CUDA graphs replay the same kernels.

``--paged`` counts instead one Euler step of a paged call (serving/turn_pool.py) as its CUDA
graph captures it (``flow_graphs.step_program``): ROWS new turns of one voice (a 50-frame voice
prefix) with FRAMES new frames each, ROWS being the call's rows (the step doubles them for CFG).
The pool's attention counts once, as ``kernel::paged_attention`` (vLLM's FlashAttention on a GPU).

``--inductor`` counts instead the kernels of ``torch.compile``'s code for the plain forward: each
fused kernel Inductor generated and each library call (GEMMs, attention, convolutions) in the
order its generated code launches them, by name (``fused`` for Inductor's own): what compiling
the step whole would leave. It also reports the compile time and the largest difference from
eager.

    python bench/estimator_ops.py --size full --shapes 2x50,16x50,2x400 [--fused] [--paged] --json ops.json
    python bench/estimator_ops.py --size full --shapes 2x50 --inductor
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tts_gateway.engine.cosyvoice2.model import fused_kernels, fused_norms  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.cfm import CFM  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.estimator import Estimator  # noqa: E402
from tts_gateway.engine.cosyvoice2.modeldir.configs import CFMConfig  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving import fused_context  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.buckets import FlowBuckets, pad_inputs  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.flow_graphs import step_program  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import PrefixBank, decoder_prefix  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.turn_pool import (  # noqa: E402
    PAGE_FRAMES, TurnStatePool, attend_reference, pad_turn_rows, turn_rows,
)

# Ops that make no kernel of their own: views, reshapes and allocations.
VIEW_OPS = frozenset({
    "aten::view", "aten::reshape", "aten::transpose", "aten::permute", "aten::expand", "aten::slice",
    "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::as_strided", "aten::_unsafe_view",
    "aten::alias", "aten::detach", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind",
    "aten::narrow", "aten::empty", "aten::empty_like", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg",
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


KERNEL = "kernel::"  # the profiler range of a stand-in for what is one kernel on a GPU


@contextlib.contextmanager
def fused_kernels_counted() -> Iterator[None]:
    """The estimator takes its fused-kernel paths on any device; each fused kernel runs its torch
    reference inside a ``kernel::<name>`` range, counted as the one kernel it is on a GPU."""

    def norm_mish_mask(h, weight, bias, eps, mask, addend, frames_major):
        with record_function(KERNEL + "norm_mish_mask"):
            out = F.mish(F.layer_norm(h.transpose(1, 2), weight.shape, weight, bias, eps).transpose(1, 2)) * mask
            return out if addend is None else out + addend

    def add_norm(x, delta, weight, bias, eps, store=None):  # store: absent before it existed
        with record_function(KERNEL + "add_norm"):
            norm = torch.nn.LayerNorm(weight.shape, eps=eps, device=weight.device, dtype=weight.dtype)
            norm.weight, norm.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)
            return fused_norms.add_norm_reference(x, delta, norm, *([] if store is None else [store]))

    def conv_input(x, turns, bank, step, rows):
        with record_function(KERNEL + "conv_input"):
            return fused_context.conv_input_reference(x, turns, bank, step, rows)

    saved = (fused_kernels.applies, fused_norms._norm_mish_mask_triton, fused_norms._add_norm_triton,
             fused_context._conv_input_triton)
    fused_kernels.applies = lambda _tensor: True
    fused_norms._norm_mish_mask_triton, fused_norms._add_norm_triton = norm_mish_mask, add_norm
    fused_context._conv_input_triton = conv_input
    try:
        yield
    finally:
        (fused_kernels.applies, fused_norms._norm_mish_mask_triton, fused_norms._add_norm_triton,
         fused_context._conv_input_triton) = saved


def forward_step(estimator: Estimator, rows: int, frames: int, device: torch.device) -> Callable[[], object]:
    """One streaming forward of the estimator at this shape."""
    x, mu, cond = (torch.randn(rows, 80, frames, device=device) for _ in range(3))
    mask = torch.ones(rows, 1, frames, device=device)
    t, spks = torch.rand(rows, device=device), torch.randn(rows, 80, device=device)
    return lambda: estimator(x, mask, mu, t, spks, cond, streaming=True)


def paged_attention(*args) -> torch.Tensor:
    with record_function(KERNEL + "paged_attention"):
        return attend_reference(*args)


def paged_step(cfm: CFM, rows: int, frames: int, device: torch.device) -> Callable[[], object]:
    """One Euler step of a paged call as its CUDA graph captures it (see the module docstring)."""
    steps, prefix = 2, 50  # a step's ops do not depend on the step count
    like = torch.zeros(1, device=device)
    voice_mu, voice_cond = (torch.randn(1, 80, prefix, device=device) for _ in range(2))
    bank = PrefixBank(cfm, 1, prefix, like, steps, keep_inputs=True)
    bank.put(0, decoder_prefix(cfm, voice_mu, torch.randn(1, 80, device=device), voice_cond, prefix, steps,
                               keep_inputs=True))
    pool = TurnStatePool(cfm, rows * (2 + (prefix + frames) // PAGE_FRAMES), like, steps, attend=paged_attention)
    turns, _, served = turn_rows(bank, pool, [0] * rows, [None] * rows, [prefix + frames] * rows, [frames] * rows)
    assert turns is not None and all(served)
    key = FlowBuckets.up_to(max_batch=rows, max_frames=frames).key(rows, frames, True, paged=True)
    mu, cond = (torch.randn(rows, 80, frames, device=device) for _ in range(2))
    inputs = pad_inputs(mu, torch.ones(rows, 1, frames, device=device), torch.randn(rows, 80, device=device), cond,
                        key.batch, key.frames)
    static = inputs + pad_turn_rows(turns, pool, key.batch).as_tuple()
    x, counter = mu.new_zeros(key.batch, 80, key.frames), torch.zeros(1, dtype=torch.long, device=device)
    start, euler_step = step_program(cfm, key, static, x, counter, cfm.step_times(steps, device, mu.dtype), bank, pool)
    start()
    return euler_step


@torch.inference_mode()
def count_ops(step: Callable[[], object]) -> collections.Counter[str]:
    """The top-level torch ops (not views) of one call of ``step``, by name."""
    step()  # warm-up: first-call set-up is not a step's work
    with profile(activities=[ProfilerActivity.CPU]) as trace:  # the ops as torch dispatches them
        step()

    def top_level(event) -> bool:  # not called from inside another torch op or a stood-in kernel
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(("aten::", KERNEL)):
                return False
            parent = parent.cpu_parent
        return True

    return collections.Counter(
        event.name for event in trace.events()
        if event.name.startswith(("aten::", KERNEL)) and top_level(event) and event.name not in VIEW_OPS
    )


# A kernel launch in Inductor's generated ``call``: one of its own fused kernels (C++ on a CPU,
# Triton on a GPU), or a library call it leaves to torch.
INDUCTOR_FUSED = re.compile(r"^\s+(?:cpp_fused_\w+|triton_\w+)(?:\.run)?\(", re.M)
INDUCTOR_LIBRARY = re.compile(r"(?:extern_kernels\.(\w+)|torch\.ops\.\w+\.(\w+)(?:\.\w+)?)\(")


def inductor_kernels(step: Callable[[], object]) -> tuple[collections.Counter[str], float, float]:
    """The kernels of ``torch.compile``'s code for ``step`` (which returns a tensor) by name, the
    compile time in seconds and the largest absolute difference of the compiled result from eager."""
    # Inductor's own helper (private, but the one way to see the code it generates); imported
    # here so that counting torch ops needs nothing of Inductor.
    from torch._inductor.utils import run_and_get_code

    started = time.perf_counter()
    compiled, sources = run_and_get_code(torch.compile(step))
    seconds = time.perf_counter() - started
    calls = "\n".join(source[source.index("def call("):] for source in sources if "def call(" in source)
    launches = "\n".join(line for line in calls.splitlines() if not line.lstrip().startswith("#"))
    kernels = collections.Counter({"fused": len(INDUCTOR_FUSED.findall(launches))})
    kernels.update(first or second for first, second in INDUCTOR_LIBRARY.findall(launches))
    return kernels, seconds, (compiled - step()).abs().max().item()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", type=shapes, default=shapes("2x50,16x50,2x400"))
    parser.add_argument("--fused", action="store_true", help="count as the GPU runs it with the fused kernels")
    parser.add_argument("--paged", action="store_true", help="count an Euler step of a paged call's graph")
    parser.add_argument("--inductor", action="store_true",
                        help="count the kernels of torch.compile's code for the plain forward instead")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.inductor and (args.fused or args.paged):
        parser.error("--inductor counts the plain forward: not with --fused or --paged")
    device = torch.device(args.device)
    config = CFMConfig.full() if args.size == "full" else CFMConfig.tiny()
    torch.manual_seed(0)  # the op count does not depend on the weights
    cfm = CFM(config).eval().to(device)
    results = []
    for rows, frames in args.shapes:
        if args.inductor:
            with torch.inference_mode():
                kernels, seconds, difference = inductor_kernels(forward_step(cfm.estimator, rows, frames, device))
            results.append({"rows": rows, "frames": frames, "kernels": sum(kernels.values()),
                            "by_name": dict(kernels.most_common()), "compile_s": round(seconds, 1),
                            "max_abs_vs_eager": difference})
            print(f"{rows} x {frames}: {sum(kernels.values())} kernels compiled ({seconds:.0f} s)", flush=True)
            continue
        with fused_kernels_counted() if args.fused else contextlib.nullcontext(), torch.inference_mode():
            step = paged_step(cfm, rows, frames, device) if args.paged else forward_step(cfm.estimator, rows, frames,
                                                                                          device)
            ops = count_ops(step)
        results.append({"rows": rows, "frames": frames, "ops": sum(ops.values()), "by_name": dict(ops.most_common())})
        print(f"{rows} x {frames}: {sum(ops.values())} ops", flush=True)
    report = {"size": args.size, "device": str(device), "fused": args.fused, "paged": args.paged,
              "inductor": args.inductor, "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
