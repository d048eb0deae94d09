"""How many streams one token2wav batch serves: chunks of B utterances run together.

Each of B utterances (same 6 s prompt, different random tokens) is advanced to chunk
``--chunk``; then that chunk of all B runs as one ``Token2WavRunner.run`` call (recompute mode:
one batched flow call + one batched HiFT call). A chunk is 1 s of audio, so B / time is
how many real-time streams this stage alone could keep up with.

    python bench/token2wav_batch.py --size full --device cuda --batches 1,8,32,64 --json out.json

``--graphs`` captures the flow's CUDA graphs as the engine does (batches up to
``--graph-max-batch``); ``--final`` times the final chunk (full attention) instead;
each row splits the time into the flow solve, the rest of the flow (token encoder,
masks), HiFT and what remains (host work between them), each with a device sync around
it, so the parts add up to slightly more than an unprofiled run.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.flow_graphs import sync  # noqa: E402
from bench.token2wav_chunk_cost import voiced_prompt  # noqa: E402
from tts_gateway.testkit.checkpoint import make_checkpoint  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.loading import DTYPES, load_models  # noqa: E402
from tts_gateway.engine.cosyvoice2.modeldir.layout import missing_files  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.request import Request, RequestStatus, VoicePrompt  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.runner import Token2WavRunner  # noqa: E402



class StageTimer:
    """Wall time per stage: wraps a method so that each call is timed between device syncs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, owner, method: str, stage: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            sync(self.device)
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            sync(self.device)
            self.seconds[stage] += time.perf_counter() - started
            return result

        setattr(owner, method, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--chunk", type=int, default=4, help="which chunk index to time (1 = the first)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--graphs", action="store_true", help="capture the flow's CUDA graphs first (GPU)")
    parser.add_argument("--graph-max-batch", type=int, default=16)
    parser.add_argument("--final", action="store_true", help="time the final chunk instead")
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
    token2wav = Token2WavRunner.build(models.flow, models.hift, incremental=False)
    batches = [int(b) for b in args.batches.split(",")]
    capture_s = None
    if args.graphs:
        from tts_gateway.engine.cosyvoice2.serving.buckets import FlowBuckets
        from tts_gateway.engine.cosyvoice2.serving.flow_graphs import FlowGraphs

        context = 2 * (prompt.tokens + 25 * (args.chunk + 4))  # frames of the largest timed call
        buckets = FlowBuckets.up_to(min(args.graph_max_batch, max(batches)), context, 100)
        graphs = FlowGraphs(models.flow.decoder, buckets)
        graphs.capture(buckets.batches, buckets.frame_buckets(), [args.final is False])
        token2wav.flow_graphs = graphs
        capture_s = round(graphs.capture_seconds, 1)
    timer = StageTimer(device)
    timer.wrap(token2wav, "_flow_call", "flow")
    timer.wrap(token2wav, "_decode", "flow_solve")
    timer.wrap(models.hift, "forward", "hift")
    results = []
    for batch in batches:
        times, parts = [], []
        for repeat in range(args.repeats + 1):  # the first pass warms this shape up
            states = []
            for row in range(batch):
                generator = torch.Generator().manual_seed(row)
                tokens = torch.randint(0, 6561, (25 * (args.chunk + 3),), generator=generator).tolist()
                status = RequestStatus.TOKENS_DONE if args.final else RequestStatus.INPUT_ENDED
                states.append(Request(prompt, token2wav.new_stream(), None, status=status, tokens=tokens))
            next_job = token2wav.schedule.next_job
            for _ in range(args.chunk - 1):  # advance every stream to the timed chunk
                token2wav.run([next_job(s) for s in states])
            if args.final:  # every stream's next job is its last
                while not next_job(states[0]).finalize:
                    token2wav.run([next_job(s) for s in states])
            jobs = [next_job(s) for s in states]
            sync(device)
            timer.seconds.clear()
            started = time.perf_counter()
            token2wav.run(jobs)
            sync(device)
            if repeat:
                times.append(time.perf_counter() - started)
                parts.append(dict(timer.seconds))
        middle = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
        best, part = times[middle], parts[middle]
        row = {
            "batch": batch,
            "chunk_ms": round(best * 1000, 1),
            "realtime_streams": round(batch / best, 1),
            "flow_solve_ms": round(part.get("flow_solve", 0) * 1000, 1),
            "flow_other_ms": round((part.get("flow", 0) - part.get("flow_solve", 0)) * 1000, 1),
            "hift_ms": round(part.get("hift", 0) * 1000, 1),
            "host_ms": round((best - part.get("flow", 0) - part.get("hift", 0)) * 1000, 1),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "size": args.size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "prompt_tokens": prompt.tokens,
        "chunk_index": args.chunk,
        "mode": "recompute, batched flow + batched HiFT, " + ("flow CUDA graphs" if args.graphs else "eager"),
        "timed": "final chunk (full attention)" if args.final else f"chunk {args.chunk}",
        "graph_capture_s": capture_s,
        "results": results,
    }
    if device.type == "cuda":
        report["peak_memory_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
