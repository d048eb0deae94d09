"""Where a flow solve's GPU time goes, by kernel family, and what the attention mask costs.

Builds the full-size flow decoder (random weights, as ``bench/flow_graphs.py``) and, for
each ``rows x frames`` shape, times one streaming solve (10 Euler steps, CFG) replayed from
a CUDA graph, in these variants:

- ``bool``: the boolean mask handed to SDPA, which turns it into a bias in each of its 56
  attention calls (the decoder before ``flow.attention_bias``);
- ``bias``: the decoder as it is, with its fused norm kernels off (``flow_fused_kernels = false``):
  the mask turned into an additive bias once per estimator call, every norm plain torch ops;
- ``fused``: the decoder as it ships: ``bias`` with the fused Triton norm kernels on
  (``model/fused_norms.py``);
- ``bias_efficient`` / ``bias_cudnn``: ``bias`` with SDPA held to one kernel;
- ``flex``: FlexAttention over a chunk-causal block mask (skips masked blocks);
- ``compile`` / ``flex_compile``: ``torch.compile`` of the estimator (inductor fuses the
  elementwise work), with SDPA and a bias / with FlexAttention;
- ``compile_dynamic``: ``compile`` with dynamic shapes, one compile for every shape.

Every variant but ``fused`` runs with the fused norms off. For each variant not compiled it
also records a profile of one eager solve, summed by kernel family (gemm, attention, conv,
norm, fused norms, elementwise, copy), and its kernel count. The JSON says how far each
variant's mel is from ``bool``'s and from ``bias``'s (the float32 mel of a bfloat16 solve;
its scale is ``mel_abs_max``). On a CPU (``--device cpu --size tiny``) it only times the
eager solves: a smoke test of the script (``fused`` runs the plain ops there).

    python bench/flow_profile.py --shapes 1x320,8x1600,32x400 --json out.json
    python bench/flow_profile.py --shapes 4x300,8x300,16x600 --variants bias,fused --json fused.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tts_gateway.engine.cosyvoice2.model import estimator as estimator_module  # noqa: E402
from tts_gateway.engine.cosyvoice2.model import fused_kernels  # noqa: E402
from tts_gateway.testkit.checkpoint import checkpoint_configs  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.cfm import CFM  # noqa: E402

FAMILIES = (
    ("attention", ("fmha", "flash", "attention", "efficient", "cudnn_sdpa", "sdpa")),
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul")),
    ("conv", ("conv", "implicit", "winograd")),
    ("fused norms", ("fused_norm_mish_mask", "fused_add_norm")),  # before "norm": their names hold it
    ("norm", ("layer_norm", "layernorm", "norm")),
    ("triton (fused)", ("triton",)),
    ("copy", ("copy", "cat", "index", "gather", "fill")),
)


# Variants that also pin SDPA to one kernel (with the bias mask).
BACKENDS = {"bias_efficient": SDPBackend.EFFICIENT_ATTENTION, "bias_cudnn": SDPBackend.CUDNN_ATTENTION}


def family(name: str) -> str:
    lowered = name.lower()
    for label, needles in FAMILIES:
        if any(n in lowered for n in needles):
            return label
    return "elementwise/other"


def kernel_profile(solve, rows: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        solve()
        torch.cuda.synchronize()
    by_family: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    kernels = 0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        kernels += 1
        by_family[family(event.name)] += us
        top[event.name[:90]] += us
    total = sum(by_family.values())
    return {
        "gpu_ms": round(total / 1000, 2),
        "kernels": kernels,  # GPU events of one solve (kernels and memory copies/sets)
        "share": {k: round(v / total, 3) for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k: round(v / 1000, 2) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]},
    }


def use_bool_mask(enabled: bool) -> None:
    """The ``bool`` variant: hand SDPA the boolean mask, as the decoder did before it turned
    the mask into a bias once per estimator call (``estimator.attention_bias``)."""
    if not hasattr(estimator_module, "_attention_bias"):
        estimator_module._attention_bias = estimator_module.attention_bias
    estimator_module.attention_bias = (lambda allowed, dtype: allowed) if enabled else estimator_module._attention_bias


def use_flex(block_mask) -> None:
    """Swap the decoder's attention for FlexAttention over a block mask (None: back to SDPA).

    The mask is chunk-causal with each row's padding, so the kernel skips whole blocks
    of keys that no query of a block may see (about half of them), instead of reading a
    dense mask."""
    if not hasattr(estimator_module, "_sdpa_forward"):
        estimator_module._sdpa_forward = estimator_module.SelfAttention.forward
    if block_mask is None:
        estimator_module.SelfAttention.forward = estimator_module._sdpa_forward
        return
    from torch.nn.attention.flex_attention import flex_attention

    if not hasattr(use_flex, "kernel"):
        use_flex.kernel = torch.compile(flex_attention, dynamic=False)

    def forward(self, x, mask, view):
        batch, frames, _ = x.shape

        def heads(h):
            return h.view(batch, frames, self.heads, self.head_dim).transpose(1, 2)

        out = use_flex.kernel(heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x)), block_mask=block_mask)
        return self.to_out[0](out.transpose(1, 2).reshape(batch, frames, self.heads * self.head_dim))

    estimator_module.SelfAttention.forward = forward


def flex_block_mask(mask: Tensor, chunk: int):
    from torch.nn.attention.flex_attention import create_block_mask

    lengths = mask[:, 0].sum(dim=-1).long()
    lengths = torch.cat([lengths, lengths])  # the CFG rows
    frames = mask.shape[2]

    def mask_mod(b, h, q, kv):
        return (kv < (q // chunk + 1) * chunk) & (kv < lengths[b])

    return create_block_mask(mask_mod, B=len(lengths), H=None, Q_LEN=frames, KV_LEN=frames, device=mask.device)


def decoder_inputs(cfm: CFM, rows: int, frames: int, padded: bool = True) -> tuple[Tensor, ...]:
    """Seeded inputs of one streaming solve, on the decoder's device and dtype: x, mask, mu,
    spks, cond. ``padded``: the last row is 1/7 shorter, as a row in a batch is."""
    device, dtype = cfm.noise.device, next(cfm.parameters()).dtype
    generator = torch.Generator().manual_seed(rows * 10000 + frames)
    mu = torch.randn(rows, 80, frames, generator=generator).to(device, dtype)
    cond = torch.randn(rows, 80, frames, generator=generator).to(device, dtype)
    spks = torch.randn(rows, 80, generator=generator).to(device, dtype)
    mask = torch.ones(rows, 1, frames, device=device, dtype=dtype)
    if padded:
        mask[-1, :, frames - frames // 7 :] = 0
    x = cfm.noise[:, :, :frames].to(dtype).expand(rows, -1, -1)
    return x, mask, mu, spks, cond


def graph_of(fn):
    fn()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 2)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1x320,4x800,8x1600,2x3200,32x400")
    parser.add_argument("--variants", default="bool,bias,bias_efficient,bias_cudnn,flex,compile,flex_compile")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    shipped_fused = fused_kernels.enabled
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    torch.manual_seed(0)
    cfm = CFM(checkpoint_configs(args.size)[1].decoder).to(device=device, dtype=dtype).eval()
    plain_estimator = cfm.estimator
    dynamic_estimator = None
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "shapes": []}
    for shape in args.shapes.split(","):
        rows, frames = (int(v) for v in shape.split("x"))
        x, mask, mu, spks, cond = decoder_inputs(cfm, rows, frames)  # one shorter row: padding as in a batch
        entry = {"rows": rows, "frames": frames, "row_frames": rows * frames, "variants": {}}
        report["shapes"].append(entry)
        reference = baseline = None
        for variant in args.variants.split(","):
            use_bool_mask(variant == "bool")
            fused_kernels.enabled = variant == "fused"
            use_flex(flex_block_mask(mask, 50) if variant.startswith("flex") else None)
            cfm.estimator = plain_estimator
            started = time.perf_counter()
            if "compile" in variant:
                # One compile per shape, or (compile_dynamic) one for all shapes: kept across
                # shapes, so its ready_s is the compile only where it first ran.
                if variant != "compile_dynamic":
                    torch._dynamo.reset()  # compile this variant's attention, not the last one's
                    cfm.estimator = torch.compile(plain_estimator, dynamic=False)
                else:
                    if dynamic_estimator is None:
                        torch._dynamo.reset()
                        dynamic_estimator = torch.compile(plain_estimator, dynamic=True)
                    cfm.estimator = dynamic_estimator

            backend = BACKENDS.get(variant)

            def solve() -> Tensor:
                if backend is None:
                    return cfm.solve(x, mask, mu, spks, cond, True)
                with sdpa_kernel(backend):
                    return cfm.solve(x, mask, mu, spks, cond, True)

            with torch.inference_mode():
                try:
                    graph, out = graph_of(solve) if cuda else (None, solve())
                except Exception as exc:  # recorded: a variant that cannot run is a result too
                    entry["variants"][variant] = {"error": repr(exc)[:400]}
                    print(shape, variant, "failed", repr(exc)[:400], flush=True)
                    continue
                ready_s = time.perf_counter() - started
                ms = timed_ms(graph.replay if cuda else solve, args.repeats)
                eager_ms = timed_ms(solve, 3)
                mel = out.clone()
                result = {"graph_ms": ms, "eager_ms": eager_ms, "ready_s": round(ready_s, 1),
                          "us_per_row_frame": round(ms * 1000 / (rows * frames), 3)}
                result["mel_abs_max"] = float(mel.abs().max())
                if variant == "bool":
                    reference = mel
                elif reference is not None:
                    result["max_abs_vs_bool"] = float((mel - reference).abs().max())
                if variant == "bias":
                    baseline = mel
                elif baseline is not None:
                    result["max_abs_vs_bias"] = float((mel - baseline).abs().max())
                if "compile" not in variant and cuda:
                    result["profile"] = kernel_profile(solve, rows)
                entry["variants"][variant] = result
                print(shape, variant, json.dumps(result)[:1500], flush=True)
            del graph
            if args.json:  # after every variant: a run cut short keeps what it measured
                args.json.write_text(json.dumps(report, indent=2))
    use_bool_mask(False)
    use_flex(None)
    fused_kernels.enabled = shipped_fused
    return report


if __name__ == "__main__":
    main()
