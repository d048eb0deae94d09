"""Which attention kernel SDPA picks for the flow decoder's attention shapes, and why not cuDNN.

The gateway's kernel profile at 128 sessions (docs/benchmarks.md) showed the memory-efficient
kernel (``fmha_cutlassF``) taking 23% of token2wav's GPU time, while ``bench/flow_profile.py``
(plain solves of 320-800 frames) saw cuDNN's flash kernel: importing vLLM turns cuDNN's SDPA
off process-wide, and ``flow_cudnn_attention`` turns it back on. Before that is relied on,
this probe (which does not import vLLM) asks SDPA for its choice
on the decoder's attention inputs (8 heads of 64, an additive bias ``[B, 1, Tq, Tk]`` shared by
the heads, bf16) in the layouts the decoder makes:

- ``views``: query, key and value as head views of one stacked projection (a solve without a
  voice prefix; ``SelfAttention.qkv_weight``);
- ``prefix``: the query such a view, key and value contiguous (a voice prefix's keys
  concatenated in front of the new ones, ``Tk = prefix + Tq``);

at frame counts that are and are not multiples of 8, with the bias allocated at its width or
as a slice of one padded to a multiple of 8 keys (so that its rows start 16-byte aligned, which
the memory-efficient kernel otherwise arranges by copying the bias in every call). For each
case it records SDPA's choice, the median time of one call with that choice and with cuDNN
forced (``flow_profile.timed_ms``), and the reasons SDPA gives when cuDNN is forced and
refuses (its warnings), and how far each output lies from the math backend's in float32 on the
same inputs (``max_abs_vs_math``, ``cudnn_max_abs_vs_math``): a kernel that misread the strided
views would stand out from bf16 rounding.

    python bench/sdpa_choice.py --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.flow_profile import timed_ms  # noqa: E402

HEADS, HEAD_DIM = 8, 64
# (layout, rows of the CFG-doubled batch, query frames, prefix frames)
CASES = [
    ("views", 16, 400, 0), ("views", 16, 300, 0), ("views", 2, 320, 0), ("views", 2, 350, 0),
    ("prefix", 16, 300, 150), ("prefix", 16, 304, 152), ("prefix", 16, 400, 150), ("prefix", 16, 400, 152),
]


def inputs(layout: str, rows: int, frames: int, prefix: int, aligned_bias: bool, device: torch.device,
           dtype: torch.dtype):
    # One stacked projection's output viewed as queries, keys and values by heads, as the decoder does.
    stacked = torch.randn(rows, frames, 3, HEADS, HEAD_DIM, device=device, dtype=dtype)
    query, key, value = (part.transpose(1, 2) for part in stacked.unbind(2))
    if layout != "views":
        key = torch.cat([torch.randn(rows, HEADS, prefix, HEAD_DIM, device=device, dtype=dtype), key], dim=2)
        value = torch.cat([torch.randn(rows, HEADS, prefix, HEAD_DIM, device=device, dtype=dtype), value], dim=2)
    keys = prefix + frames
    allowed = torch.ones(rows, 1, frames, keys, dtype=torch.bool, device=device).tril(prefix)
    width = -(-keys // 8) * 8 if aligned_bias else keys
    bias = torch.zeros(rows, 1, frames, width, dtype=dtype, device=device)[..., :keys]
    return query, key, value, bias.masked_fill_(~allowed, float("-inf"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cases": []}
    for (layout, rows, frames, prefix), aligned_bias in itertools.product(CASES, (False, True)):
        query, key, value, bias = inputs(layout, rows, frames, prefix, aligned_bias, device, dtype)
        choice = SDPBackend(torch._fused_sdp_choice(query, key, value, bias)).name

        def attend() -> torch.Tensor:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=bias)

        with sdpa_kernel(SDPBackend.MATH):
            exact = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=bias.float())

        def error_of(out: torch.Tensor) -> float:
            return float((out.float() - exact).abs().max())

        case = {"layout": layout, "rows": rows, "query_frames": frames, "key_frames": prefix + frames,
                "aligned_bias": aligned_bias, "choice": choice, "choice_ms": timed_ms(attend, args.repeats),
                "max_abs_vs_math": error_of(attend())}
        if device.type == "cuda":
            with warnings.catch_warnings(record=True) as caught, sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                warnings.simplefilter("always")
                try:
                    case["cudnn_ms"] = timed_ms(attend, args.repeats)
                    case["cudnn_max_abs_vs_math"] = error_of(attend())
                except RuntimeError as error:  # refused: the reasons are the warnings
                    case["cudnn_ms"] = None
                    case["cudnn_error"] = str(error)[:300]
            case["cudnn_warnings"] = sorted({str(w.message)[:300] for w in caught})
        report["cases"].append(case)
        print(json.dumps(case), flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
