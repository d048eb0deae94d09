"""Run the gateway with a sampling profiler of its Python threads (bench/gpu_check.py uses it).

    python bench/stack_sampler.py OUT.json serve --config gateway.toml

Every 10 ms a background thread records where each named thread of the gateway is: the
innermost Python function (its *self* time) and every function on its stack (*inclusive*
time). Creating OUT.request writes the counts gathered since the last dump to OUT.json and
starts afresh, so a load test can take one profile per concurrency level.

With the summary come the token2wav calls and chunk deliveries of that span, in order
(``CallTrace``): which thread ran each call, when, of how many chunks, and each chunk's wait
and whether its listener had run out of audio by then. A level's aggregate totals cannot
say why a burst of new turns stalls; its timeline can.

Creating OUT.kernels.request starts torch's profiler on the GPU's kernels, and creating it
again stops it and writes the kernels by GPU time to OUT.kernels.json (``KernelProfiler``):
what the token2wav stage's GPU time goes to, in a window of a level.

Why request files, not signals: a Python signal handler runs on the main thread, between two
of its bytecodes. In some gateway processes on the GPU machine no profile ever came back
after ``kill -USR1`` (why is not known); the sampler's own thread, which wakes every 10 ms
anyway, answers a request file whatever the main thread does.

Why a sampler: the gateway's event loop, the token2wav worker thread and vLLM's output
handling share one interpreter lock. A stage that looks slow may be waiting for the lock
rather than working; where each thread sits, sampled, tells those apart.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERVAL_S = 0.01
TOP = 30
# Threads a report holds at most, most sampled first. Every thread alive through a span has
# the same count, so the cut falls among them arbitrarily: it must hold all the gateway's (a
# dozen or so) and those a test process has left running.
THREADS = 64
# Calls and chunks a trace keeps between two dumps (the most recent): a level of 256
# sessions delivers a few thousand chunks.
TRACE_LIMIT = 20000


@functools.lru_cache(maxsize=65536)
def _where(code) -> str:
    """``function (file:line)`` of a code object (cached: a sample must cost the sampled threads little)."""
    path = Path(code.co_filename)
    try:
        path = path.relative_to(ROOT)
    except ValueError:
        path = Path(*path.parts[-2:])
    return f"{code.co_name} ({path}:{code.co_firstlineno})"


class CallTrace:
    """The token2wav scheduler's calls and chunk deliveries, as its latency book sees them.

    It wraps the book's ``call`` and ``delivered`` (the scheduler calls both under its lock)
    and records, in seconds from the span's start: per call its thread (``lane``), when its
    share of the thread began (``busy_from``: its launch, or the last delivery if later) and
    how long it took, its kind, the requests of its chunks, its share of the flow's work totals
    (``work``: flow calls, row-frames needed by kind and computed, graph and eager calls;
    ``Token2WavRunner.work_totals`` without ``flow_``) and, on a GPU, its time on its stream by
    phase (``gpu_ms``; phase_clock.py); per chunk its request, whether
    it was the turn's first, when it was ready, when its call was launched and done, and when
    its listener runs out of audio (None for a first chunk: its listener has none yet); a first
    chunk also when its text came (``text``) and its first speech token (``first_token``). With
    the vLLM stage, also each engine step as the gateway's stat logger hears of it
    (``llm_steps``): when, the requests running, the tokens it made, and vLLM's gaps between
    consecutive tokens of a request that ended in it (their count and sum, seconds). A span
    keeps its last TRACE_LIMIT entries of each; ``dropped`` counts the rest.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()  # records come from the token2wav threads, takes from the sampler's
        self._start()

    def _start(self) -> None:
        self.started = time.monotonic()
        self.calls: collections.deque = collections.deque(maxlen=TRACE_LIMIT)
        self.chunks: collections.deque = collections.deque(maxlen=TRACE_LIMIT)
        self.llm_steps: collections.deque = collections.deque(maxlen=TRACE_LIMIT)
        self.dropped = 0

    def install(self) -> None:
        from tts_gateway.engine.cosyvoice2.serving.latency import LatencyBook

        if getattr(LatencyBook, "traced", False):
            raise RuntimeError("the latency book is traced already")
        book_call, book_delivered = LatencyBook.call, LatencyBook.delivered
        trace = self

        def call(book, kind, jobs, started, now, on_lane, launched=None):
            phases = (launched.gpu_phase_seconds if launched is not None else None) or {}
            trace.record(trace.calls, lambda since: {
                "lane": on_lane, "busy_from": since(started), "s": round(now - started, 4), "kind": kind,
                "requests": [job.request.request_id for job in jobs],
                "work": launched.work if launched is not None else {},
                "gpu_ms": {phase: round(1000 * seconds, 2) for phase, seconds in phases.items()},
            })
            return book_call(book, kind, jobs, started, now, on_lane, launched)

        def delivered(book, request, started, now):
            clock = request.clock
            first = clock.first_audio_at is None
            ready = request.ready_at if request.ready_at is not None else started
            # A first chunk's path from its text: when the text came and when the first speech token did.
            opening = (request.text_at, request.first_token_at) if first else (None, None)
            trace.record(trace.chunks, lambda since: {
                "request": request.request_id, "first": first, "ready": since(ready),
                "launched": since(started), "done": since(now),
                "runs_out": None if first else since(clock.deadline(now)),
                **{name: since(moment) for name, moment in zip(("text", "first_token"), opening) if moment is not None},
            })
            return book_delivered(book, request, started, now)

        LatencyBook.call, LatencyBook.delivered, LatencyBook.traced = call, delivered, True
        self._install_llm_steps()

    def _install_llm_steps(self) -> None:
        """Wraps the vLLM stage's stat logger (made when its engine starts) to record each step."""
        from tts_gateway.engine.cosyvoice2.serving.lm import vllm_stage

        make_logger = vllm_stage._stat_logger
        trace = self

        def traced_logger(counters):
            class TracedLogger(make_logger(counters)):
                def record(self, scheduler_stats, iteration_stats, *args, **kwargs):
                    if iteration_stats is not None:
                        gaps = vllm_stage.token_gaps(iteration_stats)
                        now = time.monotonic()
                        trace.record(trace.llm_steps, lambda since: {
                            "at": since(now),
                            "running": getattr(scheduler_stats, "num_running_reqs", None),
                            "tokens": iteration_stats.num_generation_tokens,
                            "gaps": len(gaps), "gap_s": round(sum(gaps), 6),
                        })
                    return super().record(scheduler_stats, iteration_stats, *args, **kwargs)

            return TracedLogger

        vllm_stage._stat_logger = traced_logger

    def record(self, records: collections.deque, entry: Callable[[Callable[[float], float]], dict]) -> None:
        """Appends ``entry(since)``, ``since`` turning a moment into seconds from this span's start."""
        with self.lock:
            self.dropped += len(records) == records.maxlen
            records.append(entry(lambda moment: round(moment - self.started, 4)))

    def take(self) -> dict:
        """The calls, chunks and LLM steps since the last take, and a fresh start."""
        with self.lock:
            report = {"calls": list(self.calls), "chunks": list(self.chunks), "llm_steps": list(self.llm_steps),
                      "dropped": self.dropped}
            self._start()
        return report


def request_path(out: Path) -> Path:
    """The file whose creation asks for ``out`` (a profile, or a kernel profile's start or end)."""
    return out.with_suffix(".request")


def take_request(path: Path) -> bool:
    """Whether ``path`` was there (it is removed: one request, one answer)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


class Sampler:
    def __init__(self, out: Path, trace: CallTrace | None = None, kernels: KernelProfiler | None = None) -> None:
        self.out = out
        self.trace = trace
        self.kernels = kernels
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._reset()

    def _reset(self) -> None:
        self.started = time.monotonic()
        self.samples: collections.Counter[str] = collections.Counter()
        self.self_time: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def stop(self) -> None:
        """Ends ``run`` after its current sample (the gateway's sampler runs until the process ends)."""
        self._stop.set()

    def run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(INTERVAL_S):
            if take_request(request_path(self.out)):
                self.dump()
            if self.kernels is not None and take_request(request_path(self.kernels.out)):
                self.kernels.toggle()
            names = {t.ident: t.name for t in threading.enumerate()}
            with self.lock:
                for ident, frame in sys._current_frames().items():
                    if ident == me:
                        continue
                    name = names.get(ident, str(ident))
                    self.samples[name] += 1
                    self.self_time[name][_where(frame.f_code)] += 1
                    seen = set()
                    while frame is not None:
                        seen.add(_where(frame.f_code))
                        frame = frame.f_back
                    self.inclusive[name].update(seen)

    def dump(self) -> None:
        with self.lock:
            report = {
                "seconds": round(time.monotonic() - self.started, 1),
                "interval_s": INTERVAL_S,
                "threads": {
                    name: {
                        "samples": count,
                        "self": [[where, n] for where, n in self.self_time[name].most_common(TOP)],
                        "inclusive": [[where, n] for where, n in self.inclusive[name].most_common(TOP)],
                    }
                    for name, count in self.samples.most_common(THREADS)
                },
            }
            if self.trace is not None:
                report["token2wav_trace"] = self.trace.take()
            self._reset()
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, self.out)


def kernel_summary(averages, seconds: float, time_attr: str = "self_device_time_total", top: int = TOP) -> dict:
    """torch profiler averages (``key_averages()``) as the kernels that took the GPU's time:
    name, launches and milliseconds, most first; ``kernel_seconds`` is their sum (more than
    ``seconds`` when kernels of several streams or processes overlapped)."""
    rows = [(row.key, row.count, getattr(row, time_attr)) for row in averages if getattr(row, time_attr) > 0]
    rows.sort(key=lambda row: row[2], reverse=True)
    return {
        "seconds": round(seconds, 2),
        "kernel_seconds": round(sum(us for _, _, us in rows) / 1e6, 3),
        "kernels": [[name, count, round(us / 1000, 1)] for name, count, us in rows[:top]],
    }


class KernelProfiler:
    """Toggled by its request file (``toggle``): the first starts torch's profiler, the next
    stops it and writes ``kernel_summary`` to ``out``. CUDA kernel records (CUPTI) cover every
    thread of the process, so the profiler runs on a thread of its own, not the sampler's
    (stopping it and summing its records takes seconds). On a CPU (tests) it profiles its own thread's ops."""

    def __init__(self, out: Path, cuda: bool = True) -> None:
        self.out = out
        self.cuda = cuda
        self.requests: queue.SimpleQueue = queue.SimpleQueue()

    def toggle(self) -> None:
        self.requests.put(True)

    def run(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activity, time_attr = (ProfilerActivity.CUDA, "self_device_time_total") if self.cuda else (
            ProfilerActivity.CPU, "self_cpu_time_total")
        while True:
            self.requests.get()
            profiler = profile(activities=[activity])
            started = time.monotonic()
            profiler.start()
            self.requests.get()
            window = time.monotonic() - started
            profiler.stop()
            report = kernel_summary(profiler.key_averages(), window, time_attr)
            report["processing_s"] = round(time.monotonic() - started - window, 2)
            tmp = self.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            os.replace(tmp, self.out)


def main() -> int:
    out = Path(sys.argv[1])
    sys.path.insert(0, str(ROOT))
    trace = CallTrace()
    trace.install()
    kernels = KernelProfiler(out.with_suffix(".kernels.json"))
    for left in (out, kernels.out):  # requests a run before this one left unanswered
        request_path(left).unlink(missing_ok=True)
    threading.Thread(target=kernels.run, name="kernel-profiler", daemon=True).start()
    sampler = Sampler(out, trace, kernels)
    threading.Thread(target=sampler.run, name="stack-sampler", daemon=True).start()
    from tts_gateway.gateway.cli import main as gateway_main

    return gateway_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
