"""How many streams one token2wav batch serves: chunks of B utterances run together.

Each of B utterances (same 6 s prompt, different random tokens) is advanced to chunk
``--chunk``; then that chunk of all B runs as one ``Token2Wav.run`` call (recompute mode:
one batched flow call + one batched HiFT call). A chunk is 1 s of audio, so B / time is
how many real-time streams this stage alone could keep up with.

    python bench/token2wav_batch.py --size full --device cuda --batches 1,8,32,64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.token2wav_chunk_cost import voiced_prompt  # noqa: E402
from engine.cosyvoice2.checkpoint import make_checkpoint  # noqa: E402
from engine.cosyvoice2.model import DTYPES, load_models, missing_files  # noqa: E402
from engine.cosyvoice2.token2wav import Token2Wav, VoicePrompt  # noqa: E402



def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--chunk", type=int, default=4, help="which chunk index to time (1 = the first)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    model_dir = args.model_dir
    if model_dir is None or missing_files(model_dir):
        model_dir = model_dir or Path(tempfile.mkdtemp()) / f"cv2-{args.size}"
        make_checkpoint(model_dir, args.size, seed=0)
    models = load_models(model_dir, device=device, flow_dtype=DTYPES[args.dtype], load_llm=False)
    voice = models.frontend.prepare(voiced_prompt(6.0), 24000, "A six second prompt recording.")
    dtype = DTYPES[args.dtype]
    prompt = VoicePrompt(
        voice.speech_tokens.to(device), voice.speech_feat.to(device, dtype), voice.embedding.to(device, dtype)
    )
    token2wav = Token2Wav(models.flow, models.hift, incremental=False)
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        times = []
        for repeat in range(args.repeats + 1):  # the first pass warms this shape up
            states = []
            for row in range(batch):
                state = token2wav.new_stream(prompt)
                generator = torch.Generator().manual_seed(row)
                state.tokens = torch.randint(0, 6561, (25 * (args.chunk + 3),), generator=generator).tolist()
                states.append(state)
            for _ in range(args.chunk - 1):  # advance every stream to the timed chunk
                token2wav.run([token2wav.next_job(s) for s in states])
            jobs = [token2wav.next_job(s) for s in states]
            sync(device)
            started = time.perf_counter()
            token2wav.run(jobs)
            sync(device)
            if repeat:
                times.append(time.perf_counter() - started)
        best = sorted(times)[len(times) // 2]
        row = {"batch": batch, "chunk_ms": round(best * 1000, 1), "realtime_streams": round(batch / best, 1)}
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "size": args.size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "prompt_tokens": prompt.tokens,
        "chunk_index": args.chunk,
        "mode": "recompute, batched flow + batched HiFT, eager",
        "results": results,
    }
    if device.type == "cuda":
        report["peak_memory_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
