"""Solves after a voice prefix: attention buffers built in place, against concatenation.

In a solve after a voice prefix (``CFM.solve_after``), each of the decoder's 56 attention layers
attends, in each of the 10 Euler steps, over the prefix's stored keys/values and the new
frames' ones. ``PrefixView.keys_values`` builds each in one buffer: the bank's rows gathered
into its front, the new frames' projection written behind them (``in_place``).
``in_place_copied`` makes the projection apart and copies it there. ``concatenated`` is the way
before: the projection, the bank's rows gathered, and both concatenated (head-major), which
copies the prefix twice and the new frames once more. The kernel profile of the gateway
at 128 sessions had 21% of token2wav's GPU time in copies (docs/benchmarks.md).

For each shape (rows × frames after the prefix; rows of two voices, prefixes of 150 frames as
the H200 runs' prompt leaves) it times one solve of each arm (CUDA graph replay on a GPU,
eager elsewhere; median of ``--repeats``) and the largest difference between their mels.

    python bench/prefix_attention.py --json out.json
    python bench/prefix_attention.py --size tiny --device cpu --shapes 2x60 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.flow_profile import decoder_inputs, graph_of, timed_ms  # noqa: E402
from engine.cosyvoice2.flow import CFM, CFMConfig, PrefixBank, PrefixView, SelfAttention  # noqa: E402

PREFIX_FRAMES = 150
VOICES = 2


def concatenated_forward(self: SelfAttention, x: Tensor, mask: Tensor, view) -> Tensor:
    """``SelfAttention.forward`` with the keys/values of a prefix view concatenated."""
    batch, frames, _ = x.shape

    def heads(h: Tensor) -> Tensor:
        return h.view(batch, h.shape[1], self.heads, self.head_dim).transpose(1, 2)

    query, key, value = heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x))
    if isinstance(view, PrefixView):
        bank, slot = view.bank, self.cache_slot
        key = torch.cat([heads(bank.keys[slot].index_select(0, view.bank_rows)), key], dim=2)
        value = torch.cat([heads(bank.values[slot].index_select(0, view.bank_rows)), value], dim=2)
    elif view is not None:
        key, value = view.keys_values(self.cache_slot, key, value)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    return self.to_out[0](out.transpose(1, 2).reshape(batch, frames, self.heads * self.head_dim))


def copied_keys_values(self: PrefixView, slot: int, x: Tensor, to_k, to_v) -> tuple[Tensor, Tensor]:
    """``PrefixView.keys_values`` with the projection made apart and copied behind the prefix."""
    prefix = self.bank.frames
    built = []
    for stored, project in ((self.bank.keys[slot], to_k), (self.bank.values[slot], to_v)):
        buffer = x.new_empty(x.shape[0], prefix + x.shape[1], project.out_features)
        torch.index_select(stored, 0, self.bank_rows, out=buffer[:, :prefix])
        buffer[:, prefix:] = project(x)
        built.append(buffer)
    return built[0], built[1]


ARMS = {  # arm -> (class, method, replacement); in_place is the product's code
    "in_place": None,
    "in_place_copied": (PrefixView, "keys_values", copied_keys_values),
    "concatenated": (SelfAttention, "forward", concatenated_forward),
}


@contextmanager
def arm(name: str):
    """The decoder's attention as the arm ``name`` builds it."""
    if ARMS[name] is None:
        yield
        return
    owner, method, replacement = ARMS[name]
    original = getattr(owner, method)
    setattr(owner, method, replacement)
    try:
        yield
    finally:
        setattr(owner, method, original)


def filled_bank(cfm: CFM, like: Tensor) -> PrefixBank:
    """A bank of ``VOICES`` prefixes of random state (the work does not depend on it)."""
    bank = PrefixBank(cfm, VOICES, PREFIX_FRAMES, like)
    generator = torch.Generator().manual_seed(7)
    for tensor in (*bank.keys, *bank.values, *bank.conv_context):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    bank.start.fill_(PREFIX_FRAMES)
    return bank


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--shapes", default="2x300,8x300,16x300,32x400", help="rows x frames after the prefix")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    config = CFMConfig.full() if args.size == "full" else CFMConfig.tiny()
    cfm = CFM(config).to(device, dtype).eval()
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "size": args.size, "dtype": args.dtype, "prefix_frames": PREFIX_FRAMES,
              "timing": "CUDA graph replay" if device.type == "cuda" else "eager", "cases": []}
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            rows, frames = (int(n) for n in shape.split("x"))
            _, mask, mu, spks, cond = decoder_inputs(cfm, rows, frames)
            bank = filled_bank(cfm, mu)
            slots = torch.arange(rows, device=device) % VOICES
            case = {"rows": rows, "frames": frames}
            mels = {}
            for name in ARMS:
                with arm(name):
                    def solve() -> Tensor:
                        return cfm.solve_after_eager(bank, slots, mu, mask, spks, cond)

                    if device.type == "cuda":
                        graph, mels[name] = graph_of(solve)
                        case[f"{name}_ms"] = timed_ms(graph.replay, args.repeats)
                    else:
                        mels[name] = solve()
                        case[f"{name}_ms"] = timed_ms(solve, args.repeats)
            reference = mels["concatenated"].float()
            case["max_abs"] = float(reference.abs().max())
            for name in ("in_place", "in_place_copied"):
                case[f"{name}_speedup"] = round(case["concatenated_ms"] / case[f"{name}_ms"], 3)
                case[f"{name}_max_abs_diff"] = float((mels[name].float() - reference).abs().max())
            report["cases"].append(case)
            print(json.dumps(case), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
