"""Per-chunk cost of CosyVoice2 streaming token2wav, by chunk index, for both exact flow modes.

One utterance is streamed chunk by chunk (official chunking: 25-token hops, 3 look-ahead
tokens, first hop padded to a 25-token boundary) from a fixed token list, in each mode:

- ``recompute``: the official way, every chunk re-runs the flow over prompt + all tokens
  so far (chunk k costs O(k));
- ``incremental``: ``serving.incremental.inference_chunk`` keeps per-session flow state and computes only
  the new chunk (flat cost, paid for with the cache memory reported here).

The flow and the HiFT part of every chunk are timed separately; each stream is repeated
and the median per chunk index is reported. The final chunk (one full non-streaming flow
pass over prompt + all tokens, in both modes) is reported on its own, next to an offline
pass (one non-streaming flow + one HiFT over everything: a non-streaming request).
As a side effect the two modes' audio is compared (they must agree within 1e-3 in fp32).

    python bench/token2wav_chunk_cost.py --size tiny --device cpu --chunks 8 --repeats 2 --json /tmp/t2w.json
    python bench/token2wav_chunk_cost.py --size full --device cuda --dtype bfloat16 --cache-dir /tmp/cv2 --json out.json

Weights are random (``make_checkpoint``), which is fine for timing: the work per chunk
does not depend on what the weights are.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tts_gateway.testkit.checkpoint import make_checkpoint  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.loading import DTYPES, load_models  # noqa: E402
from tts_gateway.engine.cosyvoice2.modeldir.layout import missing_files  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.chunking import ChunkJob  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.request import Request, RequestStatus, VoicePrompt  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.runner import Token2WavRunner  # noqa: E402

SAMPLE_RATE = 24000
SPEECH_TOKEN_VOCAB = 6561
MODES = ("recompute", "incremental")
FP32_TOLERANCE = 1e-3
EDGE_CHUNKS = 4  # cost(last 4 chunks) / cost(chunks 1-4)


# ----------------------------------------------------------------------------- inputs


def voiced_prompt(seconds: float, rate: int = SAMPLE_RATE) -> np.ndarray:
    """A prompt recording stand-in: a vowel-like harmonic tone with a slow pitch glide, 0.3 peak."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = 130 + 20 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    audio = sum(np.sin(k * phase) / k for k in range(1, 8))
    return (0.3 * audio / np.max(np.abs(audio))).astype(np.float32)


def stream_tokens(t2w: Token2WavRunner, prompt_tokens: int, chunks: int, seed: int) -> list[int]:
    """Enough tokens for exactly ``chunks`` streaming chunks, then a shorter final one."""
    schedule = t2w.schedule
    first_hop_pad = math.ceil(prompt_tokens / schedule.chunk_tokens) * schedule.chunk_tokens - prompt_tokens
    tail = schedule.hop_len // 2  # < one hop, so it is spoken by the final chunk
    count = first_hop_pad + chunks * schedule.hop_len + schedule.lookahead + tail
    return np.random.default_rng(seed).integers(0, SPEECH_TOKEN_VOCAB, count).tolist()


def model_dir_for(args, scratch: str | None) -> Path:
    if args.model_dir:
        return Path(args.model_dir)
    out = Path(args.cache_dir or scratch) / f"cosyvoice2-{args.size}-seed{args.seed}"
    # make_checkpoint writes README.md last: its presence means an earlier run completed.
    if (out / "README.md").is_file() and not missing_files(out):
        print(f"reusing checkpoint {out}", file=sys.stderr)
        return out
    started = time.perf_counter()
    make_checkpoint(out, args.size, args.seed, log=lambda m: print(f"  {m}", file=sys.stderr))
    print(f"wrote {args.size} checkpoint to {out} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return out


# ----------------------------------------------------------------------------- measuring


class Clock:
    """Wall time in ms; on CUDA it waits for queued kernels first, so a span covers their work."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() * 1000.0


def tensor_bytes(root) -> int:
    """Bytes of tensor storage reachable from ``root`` (lists, dicts, object attributes), each storage once."""
    storages: set[tuple[str, int]] = set()
    visited: set[int] = set()
    total = 0

    def walk(x) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            key = (str(x.device), storage.data_ptr())
            if key not in storages:
                storages.add(key)
                total += storage.nbytes()
        elif id(x) in visited:
            return
        elif isinstance(x, (list, tuple, set)):
            visited.add(id(x))
            for item in x:
                walk(item)
        elif isinstance(x, dict):
            visited.add(id(x))
            for item in x.values():
                walk(item)
        elif hasattr(x, "__dict__"):
            visited.add(id(x))
            for item in vars(x).values():
                walk(item)

    walk(root)
    return total


def vocode(t2w: Token2WavRunner, job: ChunkJob, mel: torch.Tensor) -> np.ndarray:
    """HiFT and its caches for one chunk: the second half of ``Token2WavRunner.run`` for a single job."""
    mel, cache_source = t2w.vocoder.hift_input(job, mel)
    speech, source = t2w.hift(mel, cache_source)
    return t2w._emit(job, mel, speech, source).cpu().numpy()  # the runner's finish copies it to the host too


def run_stream(t2w: Token2WavRunner, prompt: VoicePrompt, tokens: list[int], clock: Clock) -> tuple[list[dict], np.ndarray]:
    """Stream one utterance chunk by chunk; per chunk: flow/HiFT ms, tokens, audio, flow cache bytes."""
    torch.manual_seed(0)  # HiFT's excitation draws from the global RNG: same draws in both modes
    state = Request(prompt, t2w.new_stream(), None, status=RequestStatus.TOKENS_DONE, tokens=list(tokens))
    chunks, audio = [], []
    while (job := t2w.schedule.next_job(state)) is not None:
        start = clock.now()
        mel = t2w._flow(job)
        flow_done = clock.now()
        wav = vocode(t2w, job, mel)
        hift_done = clock.now()
        chunks.append({
            "final": job.finalize,
            "tokens": job.advance,
            "flow_tokens": job.end,
            "audio_s": wav.size / SAMPLE_RATE,
            "flow_ms": flow_done - start,
            "hift_ms": hift_done - flow_done,
            # the final chunk frees the cache; what a live session holds is the last non-final value
            "flow_cache_bytes": tensor_bytes(state.stream.flow_cache),
            "flow_cache_decoder_bytes": tensor_bytes(getattr(state.stream.flow_cache, "decoder", None)),
        })
        audio.append(wav)
    return chunks, np.concatenate(audio)


def run_offline(t2w: Token2WavRunner, prompt: VoicePrompt, tokens: list[int], clock: Clock) -> dict:
    """A non-streaming request: one full-attention flow pass over all tokens, then one HiFT pass."""
    state = Request(prompt, t2w.new_stream(), None, status=RequestStatus.TOKENS_DONE, tokens=list(tokens))
    job = ChunkJob(state, end=len(tokens), finalize=True, advance=len(tokens))
    start = clock.now()
    mel = t2w._flow(job)
    flow_done = clock.now()
    wav = vocode(t2w, job, mel)
    hift_done = clock.now()
    return {"flow_ms": flow_done - start, "hift_ms": hift_done - flow_done,
            "total_ms": hift_done - start, "audio_s": wav.size / SAMPLE_RATE}


def median_chunks(runs: list[list[dict]]) -> list[dict]:
    """Per chunk index: the median over repeats of each timing (the other fields are identical)."""
    rows = []
    for same_index in zip(*runs):
        row = dict(same_index[0])
        for key in ("flow_ms", "hift_ms"):
            row[key] = statistics.median(chunk[key] for chunk in same_index)
        row["total_ms"] = statistics.median(chunk["flow_ms"] + chunk["hift_ms"] for chunk in same_index)
        rows.append(row)
    return rows


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux; whole process, never resets


def measure_mode(mode: str, t2w: Token2WavRunner, prompt: VoicePrompt, tokens: list[int], clock: Clock,
                 repeats: int, device: torch.device) -> tuple[dict, np.ndarray]:
    run_stream(t2w, prompt, tokens, clock)  # warm-up: kernels, allocator, caches
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs, audio = [], None
    for _ in range(repeats):
        chunks, audio = run_stream(t2w, prompt, tokens, clock)
        runs.append(chunks)
    rows = median_chunks(runs)
    streaming, final = rows[:-1], rows[-1]
    early = sum(r["total_ms"] for r in streaming[:EDGE_CHUNKS])
    # chunk 1 also encodes the prompt (and, incremental, fills its cache): chunks 2-5 are the steady start
    steady = sum(r["total_ms"] for r in streaming[1 : EDGE_CHUNKS + 1])
    late = sum(r["total_ms"] for r in streaming[-EDGE_CHUNKS:])
    cache_bytes = max(r["flow_cache_bytes"] for r in rows)
    decoder_bytes = max(r["flow_cache_decoder_bytes"] for r in rows)
    frames = (prompt.tokens + sum(r["tokens"] for r in streaming)) * t2w.schedule.mel_ratio
    result = {
        "chunks": streaming,
        "final": final,
        "stream_total_ms": sum(r["total_ms"] for r in rows),
        "audio_s": float(audio.size / SAMPLE_RATE),
        f"late{EDGE_CHUNKS}_over_first{EDGE_CHUNKS}": late / early if early else None,
        f"late{EDGE_CHUNKS}_over_chunks2to{EDGE_CHUNKS + 1}": late / steady if steady else None,
        "peak_memory_mb": peak_memory_mb(device),
        "flow_cache_mb_per_session": cache_bytes / 2**20 if mode == "incremental" else None,
        "flow_cache_decoder_mb": decoder_bytes / 2**20 if mode == "incremental" else None,
        "flow_cache_kb_per_mel_frame": cache_bytes / 1024 / frames if mode == "incremental" else None,
    }
    return result, audio


# ----------------------------------------------------------------------------- report


def markdown(report: dict) -> str:
    rec, inc = report["modes"]["recompute"], report["modes"]["incremental"]
    cfg = report["config"]
    lines = [
        f"token2wav per-chunk cost: {cfg['size']} on {cfg['device_name']}, flow {cfg['dtype']}, "
        f"prompt {cfg['prompt_tokens']} tokens, {cfg['repeats']} repeats (median ms)",
        "",
        "| k | tok | audio s | rec flow | rec hift | rec total | inc flow | inc hift | inc total | rec/inc |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    rows = [(str(k + 1), r, i) for k, (r, i) in enumerate(zip(rec["chunks"], inc["chunks"]))]
    rows.append(("final", rec["final"], inc["final"]))
    for label, r, i in rows:
        lines.append(
            f"| {label} | {r['tokens']} | {r['audio_s']:.2f} | {r['flow_ms']:.1f} | {r['hift_ms']:.1f} | "
            f"{r['total_ms']:.1f} | {i['flow_ms']:.1f} | {i['hift_ms']:.1f} | {i['total_ms']:.1f} | "
            f"{r['total_ms'] / i['total_ms']:.2f} |"
        )
    off = report["offline"]
    ratio = f"late{EDGE_CHUNKS}_over_first{EDGE_CHUNKS}"
    steady = f"late{EDGE_CHUNKS}_over_chunks2to{EDGE_CHUNKS + 1}"
    steady_text = (f"; over chunks 2-{EDGE_CHUNKS + 1}: recompute {rec[steady]:.2f}, incremental {inc[steady]:.2f}"
                   if rec[steady] else "")
    lines += [
        "",
        f"- offline (one non-streaming flow + HiFT, {off['audio_s']:.2f} s audio): flow {off['flow_ms']:.1f} + "
        f"hift {off['hift_ms']:.1f} = {off['total_ms']:.1f} ms",
        f"- whole stream: recompute {rec['stream_total_ms']:.1f} ms, incremental {inc['stream_total_ms']:.1f} ms "
        f"for {rec['audio_s']:.2f} s audio",
        f"- cost(last {EDGE_CHUNKS}) / cost(first {EDGE_CHUNKS}): recompute {rec[ratio]:.2f}, "
        f"incremental {inc[ratio]:.2f}{steady_text}",
        f"- peak memory ({report['memory_kind']}): recompute {rec['peak_memory_mb']:.0f} MB, "
        f"incremental {inc['peak_memory_mb']:.0f} MB",
        f"- incremental flow cache per session: {inc['flow_cache_mb_per_session']:.1f} MB "
        f"(decoder {inc['flow_cache_decoder_mb']:.1f} MB; {inc['flow_cache_kb_per_mel_frame']:.1f} KB per mel frame, "
        "prompt included)",
        f"- audio agreement recompute vs incremental: max abs diff {report['check']['max_abs_diff']:.2e}"
        + (f" (limit {FP32_TOLERANCE:g})" if report["check"]["enforced"] else " (recorded only)"),
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="flow dtype (HiFT stays float32)")
    parser.add_argument("--prompt-seconds", type=float, default=6.0)
    parser.add_argument("--chunks", type=int, default=16, help="streaming chunks before the final one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="checkpoint and token seed")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on CPU)")
    parser.add_argument("--model-dir", help="existing model directory to use")
    parser.add_argument("--cache-dir", help="where to generate (and later reuse) the checkpoint; default a temp dir")
    parser.add_argument("--json", required=True, help="write the full report here")
    args = parser.parse_args(argv)
    if args.chunks < 1 or args.repeats < 1:
        parser.error("--chunks and --repeats must be >= 1")

    if args.model_dir or args.cache_dir:
        return run(args, None)
    with tempfile.TemporaryDirectory(prefix="t2w-bench-") as scratch:  # a generated full checkpoint is ~2.5 GB
        return run(args, scratch)


def run(args, scratch: str | None) -> int:
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)  # one thread: stable timings on a shared machine
    model_dir = model_dir_for(args, scratch)
    models = load_models(model_dir, device=device, flow_dtype=DTYPES[args.dtype], load_llm=False)
    voice = models.frontend.prepare(voiced_prompt(args.prompt_seconds), SAMPLE_RATE, "A synthetic prompt.")
    flow_dtype = DTYPES[args.dtype]  # the engine keeps prompt mel and x-vector in the flow's dtype too
    prompt = VoicePrompt(voice.speech_tokens.to(device), voice.speech_feat.to(device, flow_dtype),
                         voice.embedding.to(device, flow_dtype))
    clock = Clock(device)

    engines = {mode: Token2WavRunner.build(models.flow, models.hift, incremental=mode == "incremental") for mode in MODES}
    tokens = stream_tokens(engines["recompute"], prompt.tokens, args.chunks, args.seed)
    modes, audio = {}, {}
    with torch.inference_mode():
        for mode in MODES:
            print(f"measuring {mode} ...", file=sys.stderr)
            modes[mode], audio[mode] = measure_mode(mode, engines[mode], prompt, tokens, clock, args.repeats, device)
        run_offline(engines["recompute"], prompt, tokens, clock)  # warm-up for the longer shape
        offline_runs = [run_offline(engines["recompute"], prompt, tokens, clock) for _ in range(args.repeats)]
    offline = {key: statistics.median(run[key] for run in offline_runs) for key in offline_runs[0]}

    a, b = audio["recompute"], audio["incremental"]
    if a.shape != b.shape:
        raise AssertionError(f"modes produced different audio lengths: {a.shape} vs {b.shape}")
    max_abs_diff = float(np.max(np.abs(a - b)))
    enforced = args.dtype == "float32"
    report = {
        "config": {
            "size": args.size, "device": str(device), "dtype": args.dtype, "hift_dtype": "float32",
            "device_name": device_name(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "model_dir": str(model_dir),
            "prompt_seconds": args.prompt_seconds, "prompt_tokens": prompt.tokens,
            "prompt_mel_frames": int(prompt.speech_feat.shape[1]), "tokens": len(tokens),
            "chunks": args.chunks, "repeats": args.repeats, "hop": engines["recompute"].schedule.hop_len,
            "lookahead": engines["recompute"].schedule.lookahead, "seed": args.seed,
        },
        "modes": modes,
        "offline": offline,
        "memory_kind": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "ru_maxrss, whole process",
        "check": {"max_abs_diff": max_abs_diff, "tolerance": FP32_TOLERANCE, "enforced": enforced,
                  "passed": max_abs_diff <= FP32_TOLERANCE},
    }
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    if enforced and max_abs_diff > FP32_TOLERANCE:
        raise AssertionError(f"recompute and incremental audio differ by {max_abs_diff:.2e} > {FP32_TOLERANCE:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
