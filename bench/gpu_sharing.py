"""Do two GPU workers run side by side, or take turns? Two processes against two streams.

The gateway runs vLLM's engine core in one process and token2wav in another. Kernels of two
processes on one GPU (without CUDA MPS) do not run at the same time: the GPU switches between
them. Kernels of two streams of one process can. This measures what that costs, with the
full-size flow decoder (random weights) replaying one streaming solve (10 Euler steps, CFG)
from a CUDA graph, each solve waited for, as the token2wav worker does:

- ``alone``: one worker;
- ``two_processes``: two worker processes, each with its own decoder and graph;
- ``two_streams``: two threads of one process, each replaying its own graph on its own stream.

For each mode and ``rows x frames`` shape it reports solves per second of each worker and in
all, and the median solve time. If two processes share the GPU by taking turns, each gets
about half of ``alone``; two streams get more in all while one worker alone leaves the GPU room
(small, launch-bound shapes). On a CPU (``--device cpu --size tiny``) the solves run eagerly: a
smoke test of the script.

    python bench/gpu_sharing.py --shapes 1x320,8x800 --seconds 8 --json out.json
    bash bench/with_mps.sh python bench/gpu_sharing.py ...   # the same with CUDA MPS on
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.flow_profile import decoder_inputs  # noqa: E402
from tts_gateway.testkit.checkpoint import checkpoint_configs  # noqa: E402
from tts_gateway.engine.cosyvoice2.model.cfm import CFM  # noqa: E402

MODES = ("alone", "two_processes", "two_streams")


def make_solve(size: str, device: torch.device, rows: int, frames: int, stream: torch.cuda.Stream | None):
    """One worker's solve: a graph replay on ``stream`` (CUDA) or an eager solve (CPU)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    cfm = CFM(checkpoint_configs(size)[1].decoder).to(device=device, dtype=dtype).eval()
    x, mask, mu, spks, cond = decoder_inputs(cfm, rows, frames, padded=False)

    @torch.inference_mode()
    def eager():
        return cfm.solve(x, mask, mu, spks, cond, True)

    if device.type != "cuda":
        return eager
    with torch.cuda.stream(stream):
        eager()
        eager()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, stream=stream):
            eager()

    def replay():
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()

    return replay


def run_for(solve, start_at: float, seconds: float) -> dict:
    """Solve back to back from ``start_at`` (time.time) for about ``seconds``; solves/s (over
    the time they took, the last one's overrun included) and median ms."""
    time.sleep(max(0.0, start_at - time.time()))
    times = []
    while sum(times) < seconds:
        started = time.perf_counter()
        solve()
        times.append(time.perf_counter() - started)
    return {"solves_per_s": round(len(times) / sum(times), 2), "median_ms": round(statistics.median(times) * 1000, 2)}


def _process_worker(size, device, rows, frames, seconds, ready, go, start_at, results) -> None:
    device = torch.device(device)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    solve = make_solve(size, device, rows, frames, stream)
    solve()
    ready.put(True)
    go.wait()
    results.put(run_for(solve, start_at.value, seconds))


def _get(results, procs: list, timeout: float):
    """The next result from the worker processes; raises if one of them died instead."""
    deadline = time.time() + timeout
    while True:
        try:
            return results.get(timeout=1)
        except queue.Empty:
            if failed := [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]:
                raise RuntimeError(f"a worker process failed (exit {failed[0]})") from None
            if time.time() > deadline:
                raise TimeoutError("the worker processes did not answer") from None


def measure(mode: str, size: str, device: torch.device, rows: int, frames: int, seconds: float) -> dict:
    cuda = device.type == "cuda"
    if mode == "two_processes":
        context = multiprocessing.get_context("spawn")
        ready, results, go = context.Queue(), context.Queue(), context.Event()
        start_at = context.Value("d", 0.0)
        procs = [context.Process(target=_process_worker,
                                 args=(size, str(device), rows, frames, seconds, ready, go, start_at, results))
                 for _ in range(2)]
        for proc in procs:
            proc.start()
        # Each process builds its model and graph first; both start solving at the same moment.
        try:
            for _ in procs:
                _get(ready, procs, 300)
            start_at.value = time.time() + 0.5
            go.set()
            workers = [_get(results, procs, seconds + 60) for _ in procs]
        finally:
            for proc in procs:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
    else:
        count = 1 if mode == "alone" else 2
        solves = [make_solve(size, device, rows, frames, torch.cuda.Stream(device) if cuda else None)
                  for _ in range(count)]
        for solve in solves:
            solve()
        workers: list[dict] = [{} for _ in solves]
        start_at = time.time() + 1

        def work(i: int) -> None:
            workers[i] = run_for(solves[i], start_at, seconds)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return {"workers": workers, "solves_per_s": round(sum(w["solves_per_s"] for w in workers), 2)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1x320,8x800")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "seconds": args.seconds,
              "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),  # run under bench/with_mps.sh
              "shapes": []}
    for shape in args.shapes.split(","):
        rows, frames = (int(v) for v in shape.split("x"))
        entry = {"rows": rows, "frames": frames, "modes": {}}
        report["shapes"].append(entry)
        for mode in modes:
            entry["modes"][mode] = measure(mode, args.size, device, rows, frames, args.seconds)
            print(shape, mode, json.dumps(entry["modes"][mode]), flush=True)
            if args.json:  # after every mode: a run cut short keeps what it measured
                args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
