"""The CPU-checkable parts of bench/gpu_check.py: reading the gateway's metrics and the
per-level stage report (the GPU run itself is in bench/gpu_check.sh)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

METRICS = """\
# HELP tts_llm_steps_total LLM engine steps.
tts_llm_steps_total{engine="cosyvoice2"} 100.0
tts_llm_generated_tokens_total{engine="cosyvoice2"} 400.0
tts_llm_inter_token_seconds_total{engine="cosyvoice2"} 2.0
tts_llm_inter_tokens_total{engine="cosyvoice2"} 400.0
tts_token2wav_batches_total{engine="cosyvoice2"} 10.0
tts_token2wav_chunks_total{engine="cosyvoice2"} 40.0
tts_token2wav_busy_seconds_total{engine="cosyvoice2"} 5.0
tts_token2wav_flow_row_frames_first_total{engine="cosyvoice2"} 1000.0
tts_token2wav_flow_row_frames_later_total{engine="cosyvoice2"} 5000.0
tts_token2wav_flow_padded_row_frames_total{engine="cosyvoice2"} 8000.0
tts_token2wav_calls_first_total{engine="cosyvoice2"} 4.0
tts_token2wav_call_seconds_first_total{engine="cosyvoice2"} 0.4
tts_token2wav_calls_later_total{engine="cosyvoice2"} 6.0
tts_token2wav_flow_phase_calls_total{engine="cosyvoice2"} 8.0
tts_token2wav_flow_phase_gpu_seconds_decoder_total{engine="cosyvoice2"} 0.8
tts_token2wav_flow_phase_thread_seconds_decoder_total{engine="cosyvoice2"} 0.4
tts_token2wav_flow_phase_thread_seconds_vocoder_total{engine="cosyvoice2"} 0.2
tts_token2wav_call_seconds_later_total{engine="cosyvoice2"} 4.0
tts_token2wav_call_gpu_seconds_later_total{engine="cosyvoice2"} 3.0
tts_first_audio_chunks_total{engine="cosyvoice2"} 4.0
tts_first_audio_llm_first_token_seconds_total{engine="cosyvoice2"} 0.08
tts_first_audio_token2wav_run_seconds_total{engine="cosyvoice2"} 0.4
tts_late_chunks_token2wav_bound_total{engine="cosyvoice2"} 3.0
tts_event_loop_lag_seconds_bucket{le="0.005"} 90.0
tts_event_loop_lag_seconds_bucket{le="0.02"} 99.0
tts_event_loop_lag_seconds_bucket{le="0.1"} 100.0
tts_event_loop_lag_seconds_count 100.0
tts_event_loop_lag_seconds_sum 0.3
tts_sessions_total 7.0
"""


def test_metrics_are_read_with_histogram_buckets():
    values = gpu_check.parse_metrics(METRICS)
    assert values["tts_llm_steps_total"] == 100.0
    assert values["tts_event_loop_lag_seconds_bucket@0.02"] == 99.0
    assert values["tts_event_loop_lag_seconds_count"] == 100.0
    assert "tts_sessions_total" not in values  # not a stage series


def test_stage_report_is_the_change_over_the_level():
    after = gpu_check.parse_metrics(METRICS)
    before = {name: value / 2 for name, value in after.items()}  # half of it happened before the level
    report = gpu_check.stage_report(before, after, elapsed=10.0)
    assert report["llm_steps"] == 50 and report["llm_tokens_per_step"] == 4.0
    assert report["llm_inter_token_ms"] == 5.0
    assert report["token2wav_busy_ratio"] == 0.25 and report["token2wav_mean_batch"] == 4.0
    assert report["first_audio_ms"]["llm_first_token"] == 20.0
    assert report["first_audio_ms"]["token2wav_run"] == 100.0
    assert report["first_audio_ms"]["llm_chunk"] == 0.0  # not exported in this sample: no time booked
    assert report["late_chunks_token2wav_bound"] == 1.5
    assert report["event_loop_lag_mean_ms"] == 3.0
    assert report["token2wav_flow_padded_row_frames"] == 4000.0
    assert report["token2wav_flow_padding_share"] == 0.25  # 3000 of 4000 row-frames needed
    assert report["event_loop_lag_share_over_s"] == {"0.005": 0.1, "0.02": 0.01, "0.1": 0.0}
    assert report["call_ms_by_kind"] == {"first": 100.0, "later": 666.7, "final": None}
    assert report["call_gpu_ms_by_kind"] == {"first": None, "later": 500.0, "final": None}  # first: no GPU time
    assert report["row_frames_per_call_s_by_kind"] == {"first": 2500.0, "later": 1250.0, "final": None}
    # The engine thread's calls phase by phase: ms per call (4 calls in the level); no lane's.
    engine = report["call_phase_ms"]["engine_thread"]
    assert engine["calls"] == 4.0
    assert engine["gpu"]["decoder"] == 100.0 and engine["gpu"]["vocoder"] == 0.0
    assert engine["thread"]["decoder"] == 50.0 and engine["thread"]["vocoder"] == 25.0
    assert report["call_phase_ms"]["first_chunk_lane"] == {"calls": 0.0, "gpu": None, "thread": None}


def test_a_levels_opening_burst_is_reported_apart_from_its_later_replies():
    """Replies begun in the level's first 2 s (every session's first, started at once) and the
    rest, each with its stall-free share and first audio."""
    from tts_gateway.gateway.loadgen import Record

    def reply(started_s: float, ttfa_ms: float, stalls: int = 0, outcome: str = "done") -> Record:
        return Record(sessions=3, agent=0, workload="full", chars=10, outcome=outcome, ttfa_ms=ttfa_ms,
                      stalls=stalls, started_s=started_s)

    split = gpu_check.by_start([reply(0.1, 900.0, stalls=1), reply(0.4, 700.0), reply(5.0, 200.0),
                                reply(9.0, 300.0, outcome="truncated")])
    assert split["burst"]["contexts"] == 2 and split["burst"]["stall_free_fraction"] == 0.5
    assert split["burst"]["ttfa_ms"]["p50"] == 800.0
    assert split["later"]["contexts"] == 2 and split["later"]["stall_free_fraction"] == 1.0
    assert split["later"]["ttfa_ms"]["p95"] == 295.0 and split["later"]["errors"] == 0
    assert gpu_check.by_start([reply(3.0, 100.0)])["burst"] is None


def test_peak_memory_is_the_most_read_while_a_level_runs():
    """The level's peak GPU memory (for a total budget) from readings on a thread of its own;
    a reading that fails fails the level instead of leaving a peak that was never measured."""
    import time

    readings = iter([100, 300, 200] + [150] * 1000)
    with gpu_check.PeakMemory(lambda: next(readings), interval_s=0.001) as memory:
        time.sleep(0.05)
    assert memory.peak_mib == 300

    def broken() -> int:
        raise OSError("nvidia-smi: not found")

    with pytest.raises(RuntimeError, match="GPU memory could not be read: nvidia-smi: not found"):
        with gpu_check.PeakMemory(broken, interval_s=0.001):
            time.sleep(0.01)


def test_stack_sampler_reports_where_each_thread_is(tmp_path):
    """bench/stack_sampler.py: the profile gpu_check takes per level names the busy function."""
    import json
    import threading
    import time

    import stack_sampler

    def spin_here(stop: threading.Event) -> None:
        while not stop.is_set():
            sum(range(1000))

    out = tmp_path / "profile.json"
    sampler = stack_sampler.Sampler(out)
    sampling = threading.Thread(target=sampler.run, daemon=True)
    sampling.start()
    stop = threading.Event()
    # Idle threads alive before and after the worker (as a test run leaves them): each is
    # sampled more often than it, and the report must still name it.
    release = threading.Event()
    idle = [threading.Thread(target=release.wait, name=f"idle-{i}", daemon=True) for i in range(12)]
    for thread in idle:
        thread.start()
    time.sleep(0.1)
    worker = threading.Thread(target=spin_here, args=(stop,), name="busy-worker")
    worker.start()
    time.sleep(0.5)
    stop.set()
    worker.join()
    # gpu_check asks with a request file, answered by the sampler's own thread.
    stack_sampler.request_path(out).touch()
    deadline = time.monotonic() + 5
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not stack_sampler.request_path(out).exists()  # taken: one request, one profile
    release.set()
    for thread in idle:
        thread.join()
    report = json.loads(out.read_text())
    busy = report["threads"]["busy-worker"]["samples"]
    assert all(report["threads"][thread.name]["samples"] >= busy for thread in idle)
    thread = report["threads"]["busy-worker"]
    assert thread["samples"] >= 10
    assert any(where.startswith("spin_here (tests/bench/test_gpu_check.py") for where, _ in thread["inclusive"])
    time.sleep(0.05)
    sampler.dump()  # counts start afresh after each dump (and the worker has ended)
    assert "busy-worker" not in json.loads(out.read_text())["threads"]
    # Stopped: a sampler left walking every thread's frames for the rest of the test run
    # once crashed the interpreter under a torch thread.
    sampler.stop()
    sampling.join(timeout=5)
    assert not sampling.is_alive()


def test_the_sampler_dumps_the_token2wav_calls_and_chunks_of_its_span(tmp_path, monkeypatch):
    """bench/stack_sampler.py's CallTrace: each call and chunk the scheduler books, in its span."""
    import json
    import time
    from types import SimpleNamespace

    import stack_sampler
    from tts_gateway.engine.cosyvoice2.serving.latency import LatencyBook
    from tts_gateway.engine.cosyvoice2.serving.lm import vllm_stage
    from tts_gateway.engine.cosyvoice2.serving.request import Request

    monkeypatch.setattr(LatencyBook, "call", LatencyBook.call)  # restored after the test
    monkeypatch.setattr(LatencyBook, "delivered", LatencyBook.delivered)
    monkeypatch.setattr(LatencyBook, "traced", False, raising=False)
    monkeypatch.setattr(vllm_stage, "_stat_logger", vllm_stage._stat_logger)
    trace = stack_sampler.CallTrace()
    trace.install()
    with pytest.raises(RuntimeError, match="traced already"):
        stack_sampler.CallTrace().install()  # a second trace would record every entry twice
    out = tmp_path / "profile.json"
    sampler = stack_sampler.Sampler(out, trace)
    book = LatencyBook()
    opening, playing = Request(prompt=None, stream=None, output=None), Request(prompt=None, stream=None, output=None)
    start = time.monotonic()
    playing.clock.produced(2.0, start - 1.0)  # its listener has heard a second of two
    playing.ready_at = start - 0.05
    opening.text_at, opening.first_token_at, opening.ready_at = start - 0.3, start - 0.2, start - 0.02
    jobs = [SimpleNamespace(request=opening, early=False), SimpleNamespace(request=playing, early=False)]
    book.delivered(opening, start, start + 0.1)
    book.delivered(playing, start, start + 0.1)
    book.call("later", jobs, start, start + 0.1, False)
    launched = SimpleNamespace(work={"calls": 1, "row_frames_later": 100, "padded_row_frames": 128}, gpu_seconds=0.07,
                               gpu_phase_seconds={"decoder": 0.05, "vocoder": 0.02})
    book.call("later", jobs[1:], start + 0.1, start + 0.2, False, launched)
    assert book.totals()["token2wav_batches"] == 2  # the book still counts
    assert book.totals()["token2wav_call_gpu_seconds_later"] == pytest.approx(0.07)
    sampler.dump()
    report = json.loads(out.read_text())["token2wav_trace"]
    call, timed = report["calls"]
    assert call["kind"] == "later" and not call["lane"] and call["s"] == 0.1
    assert call["requests"] == [opening.request_id, playing.request_id]
    assert call["gpu_ms"] == {} and call["work"] == {}  # not launched
    assert timed["requests"] == [playing.request_id]
    assert timed["work"] == {"calls": 1, "row_frames_later": 100, "padded_row_frames": 128}
    assert timed["gpu_ms"] == {"decoder": 50.0, "vocoder": 20.0}
    first, later = report["chunks"]
    assert first["first"] and first["runs_out"] is None and first["done"] - first["launched"] == pytest.approx(0.1)
    assert first["launched"] - first["text"] == pytest.approx(0.3, abs=1e-3)
    assert first["first_token"] - first["text"] == pytest.approx(0.1, abs=1e-3)
    assert "text" not in later  # only a first chunk's path from its text is traced
    assert gpu_check.first_audio_paths(None) is None  # a gateway run without the sampler
    paths = gpu_check.first_audio_paths({"token2wav_trace": report})
    assert paths["n"] == 1
    assert paths["ms"]["token2wav_wait"] == {"p50": 20.0, "p95": 20.0}
    assert paths["slowest"] == [{"llm_first_token": 100.0, "llm_chunk": 180.0, "token2wav_wait": 20.0,
                                 "token2wav_run": 100.0, "total": 400.0}]
    assert not later["first"] and later["runs_out"] - later["launched"] == pytest.approx(1.0, abs=1e-3)
    assert later["launched"] - later["ready"] == pytest.approx(0.05, abs=1e-3)
    assert report["dropped"] == 0
    sampler.dump()  # a trace starts afresh after each dump
    assert json.loads(out.read_text())["token2wav_trace"] == {"calls": [], "chunks": [], "llm_steps": [], "dropped": 0}
    monkeypatch.setattr(stack_sampler, "TRACE_LIMIT", 1)
    small = stack_sampler.CallTrace()
    for n in range(3):
        small.record(small.calls, lambda since, n=n: {"n": n})
    assert small.take() == {"calls": [{"n": 2}], "chunks": [], "llm_steps": [], "dropped": 2}  # the last kept


def test_the_trace_records_each_vllm_step_its_stat_logger_hears(monkeypatch):
    """With the vLLM stage, CallTrace also records each engine step, and the stage's own stat
    logger still hears every one."""
    from types import SimpleNamespace

    import stack_sampler
    from tts_gateway.engine.cosyvoice2.serving.latency import LatencyBook
    from tts_gateway.engine.cosyvoice2.serving.lm import vllm_stage

    monkeypatch.setattr(LatencyBook, "call", LatencyBook.call)
    monkeypatch.setattr(LatencyBook, "delivered", LatencyBook.delivered)
    monkeypatch.setattr(LatencyBook, "traced", False, raising=False)
    heard = []

    class StageLogger:  # what vllm_stage._stat_logger makes, without vLLM
        def __init__(self, vllm_config, engine_index=0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            heard.append(iteration_stats)

    monkeypatch.setattr(vllm_stage, "_stat_logger", lambda counters: StageLogger)
    trace = stack_sampler.CallTrace()
    trace.install()
    logger = vllm_stage._stat_logger(None)(None)
    step = SimpleNamespace(num_generation_tokens=60, inter_token_latencies_iter=[0.01, 0.02])
    logger.record(SimpleNamespace(num_running_reqs=64), step)
    logger.record(SimpleNamespace(num_running_reqs=64), None)  # no iteration stats: no step recorded
    assert heard == [step, None]
    (recorded,) = trace.take()["llm_steps"]
    assert recorded["at"] >= 0 and {k: v for k, v in recorded.items() if k != "at"} == {
        "running": 64, "tokens": 60, "gaps": 2, "gap_s": pytest.approx(0.03)}


def test_llm_steps_split_the_opening_burst_from_later():
    def step(at, tokens, gap_s=0.0, gaps=0, running=4):
        return {"at": at, "running": running, "tokens": tokens, "gaps": gaps, "gap_s": gap_s}

    chunks = [{"request": 1, "first": True, "text": 1.0, "first_token": 1.01, "ready": 1.1, "launched": 1.1,
               "done": 1.2}]
    steps = [step(0.5, 9), step(1.0, 4, 0.02, 2), step(1.01, 8, 0.03, 3), step(3.5, 2, 0.01, 1),
             step(3.6, 2, running=None)]
    split = gpu_check.llm_steps_by_start({"token2wav_trace": {"chunks": chunks, "llm_steps": steps}})
    # The step before the level's first text is neither part's.
    assert split["burst"] == {"steps": 2, "interval_ms_p50": pytest.approx(10.0), "tokens_per_step": 6.0,
                              "running": 4.0, "token_gap_ms": pytest.approx(10.0)}
    assert split["later"]["steps"] == 2 and split["later"]["token_gap_ms"] == pytest.approx(10.0)
    assert split["later"]["running"] == 4.0  # a step without scheduler stats is left out of the mean
    assert gpu_check.llm_steps_by_start({"token2wav_trace": {"chunks": chunks, "llm_steps": []}}) is None
    assert gpu_check.llm_steps_by_start(None) is None


def test_first_audio_paths_split_the_opening_burst_from_later_turns():
    """A turn whose first text came within BURST_S of the level's first is the burst's; each
    part has its stages, and each turn's second chunk is timed from its first chunk's end."""
    def first(request, text):  # stages 10, 20, 30, 40 ms after the text
        return {"request": request, "first": True, "text": text, "first_token": text + 0.01, "ready": text + 0.03,
                "launched": text + 0.06, "done": text + 0.1}

    def second(request, ready, done):
        return {"request": request, "first": False, "ready": ready, "launched": ready, "done": done}

    chunks = [first(1, 0.5), second(1, 0.7, 0.9), first(2, 1.0), first(3, 5.0), second(3, 5.15, 5.3)]
    paths = gpu_check.first_audio_paths({"token2wav_trace": {"calls": [], "chunks": chunks}})
    assert paths["n"] == 3
    burst, later = paths["by_start"]["burst"], paths["by_start"]["later"]
    assert burst["llm_chunk"] == {"p50": 20.0, "p95": 20.0} and later["total"] == {"p50": 100.0, "p95": 100.0}
    # Turn 2 has no second chunk; turn 1's came 0.3 s after its first, turn 3's 0.2 s.
    assert paths["second_chunk_after_first_ms"] == {"burst": {"n": 1, "p50": 300.0, "p95": 300.0},
                                                    "later": {"n": 1, "p50": 200.0, "p95": 200.0}}
    only_burst = gpu_check.first_audio_paths({"token2wav_trace": {"calls": [], "chunks": chunks[:2]}})
    assert only_burst["by_start"]["later"] is None and only_burst["second_chunk_after_first_ms"]["later"] is None


def test_a_level_starts_once_the_gateway_is_idle(monkeypatch):
    busy = [{"tts_engine_running": 1.0}, {"tts_engine_utterances": 3.0}, {"tts_engine_queue_depth": 0.0}]
    scrapes = []
    monkeypatch.setattr(gpu_check, "scrape", lambda url: scrapes.append(url) or busy[min(len(scrapes), 3) - 1])
    monkeypatch.setattr(gpu_check.time, "sleep", lambda seconds: None)
    gpu_check.wait_idle("http://gateway/metrics")
    assert len(scrapes) == 3  # busy, busy, idle
    scrapes.clear()
    busy[2] = {"tts_engine_running": 1.0}
    assert gpu_check.wait_idle("http://gateway/metrics", timeout=0.2) >= 0.2  # never idle: gives up


def test_the_kernel_profile_repeats_the_largest_whole_reply_level():
    plan = [("full-barge-in", 1, True), ("full", 64, True), ("full", 16, True), ("llm", 256, True)]
    assert gpu_check.kernel_profile_level(plan) == ("full", 64, True)
    plan = [("full-barge-in", 1, True), ("full-barge-in", 1, False), ("llm", 16, True), ("llm", 128, True)]
    assert gpu_check.kernel_profile_level(plan) == ("llm", 128, True)


def test_stall_free_capacity_by_workload_and_start_spread():
    def level(workload, sessions, spread, stall_free):
        return {"workload": workload, "sessions": sessions, "start_spread_s": spread, "stall_free": stall_free}

    levels = [level("full", 1, 0.5, True), level("full", 1, 5.0, True), level("full", 16, 0.5, False),
              level("full", 16, 5.0, True), level("llm", 16, 0.5, False), level("llm", 16, 5.0, False)]
    assert gpu_check.stall_free_capacity(levels, by_spread=True) == {
        "full@0.5s": 1, "full@5s": 16, "llm@0.5s": None, "llm@5s": None}
    assert gpu_check.stall_free_capacity(levels, by_spread=False) == {"full": 16, "llm": None}
    assert gpu_check.float_list("0.5,5") == [0.5, 5.0]



def test_the_gateway_config_it_writes_carries_its_options(tmp_path):
    """The config gpu_check writes for the gateway loads, with --flow-steps as flow_steps (10,
    the official count, unless asked); the JSON's options are these parsed arguments."""
    from tts_gateway.gateway.config import load_config

    for argv, steps in (([], 10), (["--flow-steps", "4"], 4)):
        args = gpu_check.argument_parser().parse_args(argv)
        gpu_check.write_config(tmp_path / "gateway.toml", tmp_path / "model", args)
        config = load_config(tmp_path / "gateway.toml", env={})
        assert args.flow_steps == config.engine.cosyvoice2.flow_steps == steps
        assert config.engine.cosyvoice2.final_chunk_attention == args.final_chunk_attention
        assert config.engine.cosyvoice2.vllm.warmup_batch_sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    # A smaller card's settings (docs/cosyvoice2.md).
    args = gpu_check.argument_parser().parse_args(
        ["--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--graph-max-frames", "1600",
         "--token2wav-cache-gb", "6", "--token2wav-memory-gb", "14"])
    gpu_check.write_config(tmp_path / "gateway.toml", tmp_path / "model", args)
    small = load_config(tmp_path / "gateway.toml", env={}).engine.cosyvoice2
    assert (small.vllm.max_num_seqs, small.vllm.max_num_batched_tokens, small.vllm.token2wav_memory_gb) == (64, 4096, 14)
    assert small.vllm.warmup_batch_sizes == (1, 2, 4, 8, 16, 32, 64)
    assert (small.graph_max_frames, small.token2wav_cache_gb) == (1600, 6)
    args = gpu_check.argument_parser().parse_args(["--token2wav-mps-priority", "below-normal"])
    gpu_check.write_config(tmp_path / "gateway.toml", tmp_path / "model", args)
    vllm = load_config(tmp_path / "gateway.toml", env={}).engine.cosyvoice2.vllm
    assert vllm.token2wav_mps_priority == "below-normal"


def test_a_level_run_again_counts_towards_capacity_only_if_every_run_was_stall_free():
    def level(sessions, stall_free):
        return {"workload": "llm", "sessions": sessions, "start_spread_s": 0.5, "stall_free": stall_free}

    levels = [level(16, True), level(64, True), level(64, False), level(64, True)]
    assert gpu_check.stall_free_capacity(levels, by_spread=False) == {"llm": 16}
    assert gpu_check.stall_free_capacity(levels[:2], by_spread=False) == {"llm": 64}


def test_levels_run_more_than_once_report_how_far_their_runs_lie_apart():
    def level(sessions, stall_free, p50, p95, stalls, spread=0.5):
        summary = {"stall_free_fraction": stall_free, "ttfa_ms": {"p50": p50, "p95": p95}, "stalls": stalls}
        return {"workload": "llm", "sessions": sessions, "start_spread_s": spread, "summary": summary}

    levels = [level(1, 1.0, 113, 122, 0), level(64, 0.915, 562, 920, 10), level(64, 0.947, 831, 1267, 6),
              level(64, 0.7, 588, 1226, 34), level(64, 0.5, None, None, 3, spread=5.0)]
    spread = gpu_check.repeat_spread(levels)
    assert list(spread) == ["llm@64@0.5s"]  # run once: no spread (the 5 s start spread is another level)
    assert spread["llm@64@0.5s"] == {
        "runs": 3,
        "stall_free_fraction": {"min": 0.7, "median": 0.915, "max": 0.947},
        "ttfa_p50_ms": {"min": 562, "median": 588, "max": 831},
        "ttfa_p95_ms": {"min": 920, "median": 1226, "max": 1267},
        "stalls": {"min": 6, "median": 10, "max": 34},
    }
    no_audio = [level(8, 0.0, None, None, 0), level(8, 0.0, None, None, 0)]
    assert gpu_check.repeat_spread(no_audio)["llm@8@0.5s"]["ttfa_p50_ms"] is None
    # A level without word timings is another level, not a repeat (nor does it hold back capacity).
    untimed = {**level(1, 0.0, 90, 95, 2), "word_timings": False, "stall_free": False}
    assert list(gpu_check.repeat_spread([{**level(1, 1.0, 113, 122, 0)}, untimed])) == []
    assert gpu_check.stall_free_capacity([{**level(1, 1.0, 113, 122, 0), "stall_free": True}, untimed],
                                         by_spread=False) == {"llm": 1}


def test_levels_over_the_memory_budget_do_not_count_towards_capacity():
    assert gpu_check.within_budget(32 * 1024, 32) is True  # MiB against GiB
    assert gpu_check.within_budget(32 * 1024 + 1, 32) is False
    assert gpu_check.within_budget(31_000, None) is None and gpu_check.within_budget(None, 32) is None
    levels = [{"workload": "full", "start_spread_s": 0.5, "sessions": n, "stall_free": True, "within_memory_budget": within}
              for n, within in ((8, True), (16, True), (32, False))]
    assert gpu_check.stall_free_capacity(levels, by_spread=False) == {"full": 16}


FAKE_MPS_CONTROL = """#!/usr/bin/env bash
# Stands in for nvidia-cuda-mps-control: records how it was called; answers the queries
# bench/gpu_check.py makes as a daemon with one server (pid 10) and its two clients would.
request=$(if [ "$#" -eq 0 ]; then cat; fi)
echo "${*:-$request} pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "$MPS_CALLS"
case "$request" in
  get_server_list) echo 10 ;;
  "get_client_list 10") printf '21\\n22\\n' ;;
esac
"""


def test_with_mps_runs_the_command_between_the_daemon_start_and_quit(tmp_path):
    """bench/with_mps.sh starts the MPS control daemon with private folders, runs the command
    as its client (gpu_check reads the server's clients), quits the daemon even when the
    command fails, and exits with the command's status."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(FAKE_MPS_CONTROL)
    control.chmod(0o755)
    calls = tmp_path / "calls.txt"
    pipe = tmp_path / "pipe"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MPS_CALLS": str(calls), "OUT": str(tmp_path),
           "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log")}
    bench = ROOT / "bench"
    probe = tmp_path / "probe.py"  # a command that reads the server's clients, then fails
    probe.write_text(f"import sys\nsys.path.insert(0, {str(bench)!r})\nimport gpu_check\n"
                     "print(gpu_check.mps_clients())\nsys.exit(3)\n")
    result = subprocess.run(["bash", str(bench / "with_mps.sh"), sys.executable, str(probe)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert result.stdout.strip() == "{'10': ['21', '22']}"
    assert calls.read_text().splitlines() == [
        f"-d pipe={pipe}", f"get_server_list pipe={pipe}", f"get_client_list 10 pipe={pipe}", f"quit pipe={pipe}",
    ]
    assert pipe.is_dir() and "no MPS control log" in result.stderr  # the fake daemon writes no logs
    env.pop("CUDA_MPS_PIPE_DIRECTORY")
    without = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True, timeout=60)
    assert without.stdout.strip() == "None"


def test_kernel_summary_orders_kernels_by_gpu_time():
    """stack_sampler.kernel_summary: kernels by GPU time, most first; rows without any are ops."""
    from types import SimpleNamespace

    import stack_sampler

    averages = [SimpleNamespace(key="aten::mm", count=5, self_device_time_total=0.0),
                SimpleNamespace(key="gemm_kernel", count=5, self_device_time_total=3000.0),
                SimpleNamespace(key="flash_attn_kernel", count=2, self_device_time_total=7000.0)]
    assert stack_sampler.kernel_summary(averages, 2.0) == {
        "seconds": 2.0, "kernel_seconds": 0.01, "kernels": [["flash_attn_kernel", 2, 7.0], ["gemm_kernel", 5, 3.0]],
    }


def test_kernel_profiler_is_toggled_by_its_request_file(tmp_path):
    """The sampler's thread answers the kernel profile's request file: the first starts the
    profiler on its own thread, the next has it write the summary (on a CPU: that thread's own
    ops, none here)."""
    import json
    import threading
    import time

    import stack_sampler

    out = tmp_path / "profile.kernels.json"
    profiler = stack_sampler.KernelProfiler(out, cuda=False)
    threading.Thread(target=profiler.run, daemon=True).start()
    sampler = stack_sampler.Sampler(tmp_path / "profile.json", kernels=profiler)
    sampling = threading.Thread(target=sampler.run, daemon=True)
    sampling.start()
    request = stack_sampler.request_path(out)

    def ask() -> None:  # and wait until the sampler has taken it (two at once would be one)
        request.touch()
        for _ in range(500):
            if not request.exists():
                return
            time.sleep(0.01)
        raise AssertionError("the sampler did not take the request")

    try:
        ask()
        time.sleep(0.3)
        ask()
        for _ in range(100):
            if out.exists():
                break
            time.sleep(0.1)
        report = json.loads(out.read_text())
        assert report["seconds"] >= 0.2 and report["kernels"] == [] and report["kernel_seconds"] == 0
        assert not (tmp_path / "profile.json").exists()  # the thread profile was not asked for
    finally:
        sampler.stop()
        sampling.join(timeout=5)


def test_call_costs_split_the_engine_threads_calls_by_rows():
    def call(rows, frames, decoder, lane=False, flow_calls=1, **other):
        return {"lane": lane, "s": (decoder + 10) / 1000, "requests": list(range(rows)),
                "work": {"calls": flow_calls, "padded_row_frames": frames, "encoder_graph_calls": flow_calls},
                "gpu_ms": {"decoder": decoder, "vocoder": 5.0, **other}}

    calls = [call(1, 100, 30.0), call(3, 300, 40.0), call(8, 500, 50.0), call(32, 2000, 125.0),
             call(32, 3000, 400.0, unpaged=90.0),  # rows outside the pool: not on the decoder's line
             call(16, 1600, 500.0, flow_calls=2),  # two paged calls (a turn back in the pool): two fixed costs
             call(8, 800, 999.0, lane=True),  # the lane's: not the engine thread's
             {"lane": False, "s": 0.1, "requests": [1], "work": {}, "gpu_ms": {}}]
    costs = gpu_check.call_costs({"token2wav_trace": {"calls": calls, "chunks": [], "dropped": 0}})
    assert costs["by_rows"]["1-4"] == {"calls": 2, "chunks": 2.0, "padded_row_frames": 200, "wall_ms": 45.0,
                                       "gpu_ms": {"decoder": 35.0, "vocoder": 5.0},
                                       "work": {"calls": 2, "padded_row_frames": 400, "encoder_graph_calls": 2}}
    assert costs["by_rows"]["5-16"]["calls"] == 2
    assert costs["by_rows"]["17-"]["gpu_ms"] == {"decoder": 262.5, "unpaged": 45.0, "vocoder": 5.0}
    assert costs["decoder_line"] == {"fixed_ms": 25.0, "us_per_row_frame": 50.0}  # 25 ms + 0.05 ms a row-frame
    assert gpu_check.call_costs(None) is None
    one = gpu_check.call_costs({"token2wav_trace": {"calls": calls[:1], "chunks": [], "dropped": 0}})
    assert one["by_rows"]["1-4"]["calls"] == 1 and one["decoder_line"] is None  # one call draws no line
    assert gpu_check.call_costs({"token2wav_trace": {"calls": calls[-2:], "chunks": [], "dropped": 0}}) is None
