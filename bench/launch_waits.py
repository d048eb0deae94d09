"""Does launching a paged token2wav call wait for the GPU?

``launch_ahead`` needs the engine thread to launch its next call while the last one runs: the
launch must enqueue its work and return, never wait for the device (a wait there serialized
the two calls on an H100, docs/benchmarks.md). This builds a paged runner as the engine does
(a voice-prefix bank, a turn pool, CUDA graphs of the paged calls' shapes), streams several
turns through it call by call, and runs each call's ``Token2WavRunner.launch`` under torch's
sync debug mode ``error``: any host-device synchronization in it raises, and the report names
the lines. ``finish`` (the wait for the call's audio) is the only wait a call may have.

    python bench/launch_waits.py --device cuda --size full --rows 8 --json waits.json

A first pass of streams warms every shape up unchecked (library set-up, pinned host memory),
as the engine's start-up does; a second is checked. With a pool too small for every turn
(``--pool-gb 0.5``), turns fall back to recompute after their voice prefix, whose calls read
the device by design: the report then names those lines. On a CPU (``--device cpu --size
tiny``) there is nothing to wait for: a smoke test of the script.

Each checked call is also timed, phase by phase on the GPU's timeline (phase_clock.py):
alone on the GPU, with the engine's graphs, a paged call's cost by the row-frames its decoder
computes, without a gateway's run-to-run spread. ``--fused-kernels`` turns the decoder's fused Triton
kernels on (``flow_fused_kernels``), ``--attention-splits 1`` holds FlashAttention to one
part of each piece's keys (no combining kernel); ``--rows 1,8,32`` streams each count in turn on one
runner, so one run gives the decoder's cost a call and a row-frame (``decoder_cost``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.token2wav_chunk_cost import voiced_prompt  # noqa: E402
from tts_gateway.engine.cosyvoice2.model import fused_kernels  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.loading import DTYPES, load_models  # noqa: E402
from tts_gateway.engine.cosyvoice2.modeldir.layout import missing_files  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.buckets import FlowBuckets  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.call_plan import MAX_CALL_ROW_FRAMES  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.flow_graphs import FlowGraphs  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.paged_varlen import flash_attend  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.request import Request, RequestStatus, VoicePrompt  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.runner import Token2WavRunner  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.startup import capture_hift_graphs  # noqa: E402
from tts_gateway.testkit.checkpoint import make_checkpoint  # noqa: E402

TOKENS = 400  # each turn's speech tokens: chunks of 25, 50, 100 and 200 tokens, then its last


@contextlib.contextmanager
def waits_raise(device: torch.device) -> Iterator[None]:
    """Any host-device synchronization on ``device`` raises inside (nothing on a CPU)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def where(error: BaseException) -> list[str]:
    """The product's lines on the way to ``error``, innermost last."""
    frames = traceback.extract_tb(error.__traceback__)
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames if f.filename.startswith(str(ROOT))]


def work_done(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the runner did between two of its work totals: milliseconds per phase on the GPU's
    timeline (the phases that ran), and the decoder's row-frames, as computed (``row_frames``:
    each row's own frames, from its last stored chunk on) and with its graph's padding."""
    def change(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prefix = "flow_phase_gpu_seconds_"
    return {
        "gpu_ms": {
            name[len(prefix):]: round(1000 * change(name), 2)
            for name in after if name.startswith(prefix) and change(name) > 0
        },
        "row_frames": int(sum(change(f"flow_row_frames_{kind}") for kind in ("first", "later", "final"))),
        "padded_row_frames": int(change("flow_padded_row_frames")),
    }


def stream(
    runner: Token2WavRunner, prompt: VoicePrompt, rows: int, checked: bool, mels: list[np.ndarray] | None = None
) -> list[dict]:
    """Turns of ``rows`` streams run to their ends, one call per chunk; each call's launch
    checked for waits when ``checked``, and its work measured (``work_done``). ``mels``: each
    turn's mel (the flow's output, all its chunks') is appended to it, unless a launch was
    broken off."""
    device = prompt.speech_feat.device
    generator = torch.Generator().manual_seed(rows)
    streams = [
        Request(prompt, runner.new_stream(), None, status=RequestStatus.TOKENS_DONE,
                tokens=torch.randint(0, 6561, (TOKENS + 7 * row,), generator=generator).tolist())
        for row in range(rows)
    ]
    calls = []
    made: dict[int, list[torch.Tensor]] = {id(request): [] for request in streams}
    broken = False
    while jobs := [job for job in map(runner.schedule.next_job, streams) if job is not None]:
        call = {"rows": len(jobs), "frames": max(runner.call_frames(job) for job in jobs), "waits": None}
        before = runner.work_totals()
        try:
            with (
                waits_raise(device) if checked else contextlib.nullcontext(),
                kept_mels(runner, made) if mels is not None else contextlib.nullcontext(),
            ):
                launched = runner.launch(jobs)
        except RuntimeError as error:  # the launch is broken off: report where, and stop
            call["waits"] = {"error": str(error).splitlines()[0], "at": where(error)}
            calls.append(call)
            broken = True
            break
        runner.finish(launched)
        call.update(work_done(before, runner.work_totals()))
        calls.append(call)
    for request in streams:  # their pages back to the pool, as the engine does when a turn ends
        runner.release(request.stream)
    if mels is not None and not broken:
        mels += [torch.cat(made[id(request)], dim=2)[0].float().cpu().numpy() for request in streams]
    return calls


@contextlib.contextmanager
def kept_mels(runner: Token2WavRunner, made: dict[int, list[torch.Tensor]]) -> Iterator[None]:
    """Each chunk's mel, as the flow hands it to the vocoder, appended to ``made[id(request)]``
    (a copy on the device: taking it does not wait for the GPU)."""
    hift_input = runner.vocoder.hift_input

    def keep(job, mel):
        made[id(job.request)].append(mel.detach().clone())
        return hift_input(job, mel)

    runner.vocoder.hift_input = keep
    try:
        yield
    finally:
        del runner.vocoder.hift_input  # the class's method again


def decoder_cost(calls: list[dict]) -> dict | None:
    """The decoder's GPU time of the calls that ran it as a line in the row-frames it computed
    (its graph's padding included: what a replay costs): milliseconds a call, microseconds a
    row-frame (least squares; None without two sizes)."""
    timed = [(call["padded_row_frames"], call["gpu_ms"]["decoder"]) for call in calls
             if "decoder" in call.get("gpu_ms", {})]
    if len({size for size, _ in timed}) < 2:
        return None
    slope, intercept = np.polyfit([size for size, _ in timed], [ms for _, ms in timed], 1)
    ms, us = round(float(intercept), 2), round(float(1000 * slope), 2)
    return {"calls": len(timed), "ms_per_call": ms, "us_per_row_frame": us}


def capture_graphs(runner: Token2WavRunner, prompt: VoicePrompt, rows: int, attention_splits: int) -> None:
    """The paged calls' graphs up to ``rows`` and the vocoder's, as the engine captures them."""
    decoder = runner.flow.decoder
    runner.turn_pool.attend = flash_attend(decoder.estimator.attention_layers[0].dim, attention_splits)
    buckets = FlowBuckets.up_to(rows, 2 * 200 + 100, 50)
    graphs = FlowGraphs(decoder, buckets, bank=runner.prefixes.bank, pool=runner.turn_pool)
    graphs.capture(buckets.batches, buckets.frame_buckets(), [True], max_row_frames=MAX_CALL_ROW_FRAMES, paged=True)
    runner.flow_graphs = graphs
    capture_hift_graphs(runner, rows, [prompt.tokens])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bfloat16 on cuda")
    parser.add_argument("--rows", default="4", help="turns streamed together; a list (1,8,32) streams each in turn")
    parser.add_argument("--fused-kernels", action="store_true", help="the decoder's fused Triton kernels on")
    parser.add_argument("--attention-splits", type=int, default=0,
                        help="FlashAttention's key splits in the paged attention (0: the kernel's choice, as "
                        "the engine's before 2026-12-07; 1: unsplit, the engine's since)")
    parser.add_argument("--pool-gb", type=float, default=4.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--mels", type=Path,
                        help="the checked turns' mels to this .npz (compare kernel options with compare_mels)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.rows.split(",")]
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    model_dir = args.model_dir
    if model_dir is None or missing_files(model_dir):
        model_dir = model_dir or Path(tempfile.mkdtemp()) / f"cv2-{args.size}"
        make_checkpoint(model_dir, args.size, seed=0)
    models = load_models(model_dir, device=device, flow_dtype=dtype, load_llm=False)
    voice = models.frontend.prepare(voiced_prompt(4.0), 24000, "A four second prompt recording.")
    prompt = VoicePrompt(
        voice.speech_tokens.to(device), voice.speech_feat.to(device, dtype), voice.embedding.to(device, dtype)
    )
    runner = Token2WavRunner.build(
        models.flow, models.hift, scale=2, max_hop_len=200, incremental=False, prefix_voices=1,
        turn_state_bytes=int(args.pool_gb * 2**30), final_attention="chunk",
    )
    # As the engine sets it, before the voice's prefix and the graphs (a graph replays the
    # kernels that ran at its capture).
    shipped, fused_kernels.enabled = fused_kernels.enabled, args.fused_kernels
    try:
        runner.prepare_voices([prompt], prompt.tokens)
        if device.type == "cuda":
            capture_graphs(runner, prompt, max(counts), args.attention_splits)
        with torch.inference_mode():
            calls, mels = [], []
            for rows in counts:
                stream(runner, prompt, rows, checked=False)
                calls += stream(runner, prompt, rows, checked=True, mels=mels)
    finally:
        fused_kernels.enabled = shipped
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "size": args.size,
        "rows": counts,
        "fused_kernels": args.fused_kernels,
        "attention_splits": args.attention_splits,
        "decoder_cost": decoder_cost(calls),
        "calls": calls,
        "launches_that_waited": sum(call["waits"] is not None for call in calls),
    }
    print(json.dumps(report), flush=True)
    if args.mels:
        np.savez(args.mels, *mels)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


def compare_mels(reference: Path, other: Path) -> dict:
    """How far the turns' mels of two runs (``--mels``) lie apart: the largest of the turns'
    relative errors (the difference's RMS over the reference's) and of their largest
    differences. The flow's noise is fixed, so runs of the same dtype and options give the same
    mels, and this is what a kernel option changes. (Not the audio: the vocoder draws its
    source's noise anew each run.)"""
    with np.load(reference) as a, np.load(other) as b:
        if sorted(a.files) != sorted(b.files):
            raise ValueError(f"{reference} and {other} hold different turns")
        pairs = [(a[name].astype(np.float64), b[name].astype(np.float64)) for name in a.files]
    if any(x.shape != y.shape for x, y in pairs):
        raise ValueError(f"{reference} and {other} hold turns of different lengths")
    return {
        "turns": len(pairs),
        "relative_rms": max(float(np.sqrt(np.mean((x - y) ** 2) / np.mean(x**2))) for x, y in pairs),
        "max_abs": max(float(np.abs(x - y).max()) for x, y in pairs),
    }


if __name__ == "__main__":
    main()
