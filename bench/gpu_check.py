"""The GPU proof of the CosyVoice2 + vLLM gateway, in one run (bench/gpu_check.sh calls it).

1. makes the full-size random checkpoint and registers a voice from a real speech prompt;
2. checks greedy token equality, vLLM vs the plain-torch backend (bench/vllm_equality.py);
3. starts the real gateway (``tts-gateway serve``) with cosyvoice2 + vLLM;
4. drives 1, 16, 64, 128 concurrent sessions with whole replies, then 1, 16, 64, 128, 256
   with text streamed as deltas, through the WebSocket with the product's load generator
   (turns paced as in a conversation; ``--back-to-back`` for the throughput test);
5. reports TTFA p50/p95, stall-free sessions, GPU memory and the LLM stage's counters.

Everything lands in ``--out`` (gpu_check.json, plus logs) phase by phase, so a run cut
short still reports what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import stack_sampler  # noqa: E402  (bench/, this script's folder)
from tts_gateway.gateway import loadgen  # noqa: E402
from tts_gateway.gateway.loadgen.report import p50_p95, percentile  # noqa: E402
from tts_gateway.engine.cosyvoice2.metrics import CALL_KINDS, FIRST_AUDIO_STAGES, PHASE_THREADS, PHASES  # noqa: E402
from tts_gateway.engine.cosyvoice2.settings import VLLMSettings  # noqa: E402
from tts_gateway.gateway.wire import STREAM_PATH  # noqa: E402

PROMPT_TEXT = "This is the voice of the prompt, spoken clearly and slowly."


class Report:
    def __init__(self, out: Path) -> None:
        self.path = out / "gpu_check.json"
        self.data: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1))
        print(f"[gpu_check] {key}: {json.dumps(value)[:600]}", flush=True)


def gpu_memory() -> dict:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used,memory.total,utilization.gpu,temperature.gpu,clocks.sm",
         "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True,
    ).stdout.strip().split(", ")
    return {"used_mib": int(out[0]), "total_mib": int(out[1]), "util_pct": int(out[2]),
            "temp_c": int(out[3]), "sm_mhz": int(out[4])}


class PeakMemory:
    """The most GPU memory in use while a level runs (``read``: MiB, all processes, as
    nvidia-smi counts them), sampled every ``interval_s`` on a thread of its own: what a total
    memory budget (the 32 GB ramp) is checked against. A failed reading fails the level."""

    def __init__(self, read: Callable[[], int], interval_s: float = 0.5) -> None:
        self.read = read
        self.interval_s = interval_s
        self.peak_mib = 0
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="gpu-peak-memory", daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None and exc[0] is None:
            raise RuntimeError(f"GPU memory could not be read: {self._error}") from self._error

    def _sample(self) -> None:
        try:
            while True:
                self.peak_mib = max(self.peak_mib, self.read())
                if self._stop.wait(self.interval_s):
                    self.peak_mib = max(self.peak_mib, self.read())
                    return
        except Exception as error:  # handed to the level (__exit__)
            self._error = error


def mps_clients() -> dict | None:
    """The CUDA MPS servers this process's environment points at and their client PIDs (None
    without MPS; bench/with_mps.sh sets it up and names its control program). Under MPS the
    gateway's two GPU processes are clients of one server."""
    if not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        return None
    control = os.environ.get("TTS_MPS_CONTROL") or "nvidia-cuda-mps-control"

    def ask(command: str) -> list[str]:
        return subprocess.run([control], input=command, capture_output=True, text=True, check=True).stdout.split()

    return {server: ask(f"get_client_list {server}") for server in ask("get_server_list")}


def prepare_model(model_dir: Path, prompt_wav: Path, report: Report) -> None:
    from tts_gateway.testkit.checkpoint import make_checkpoint
    from tts_gateway.engine.cosyvoice2.frontend.prompt import CosyVoice2Frontend
    from tts_gateway.engine.cosyvoice2.frontend.voices import VoiceStore

    started = time.perf_counter()
    if not (model_dir / "README.md").is_file():  # make_checkpoint writes README.md last
        make_checkpoint(model_dir, "full", 0)
    store = VoiceStore(model_dir / "voices", CosyVoice2Frontend(model_dir))
    if not store.list():
        store.add("narrator", prompt_wav.read_bytes(), PROMPT_TEXT)
    report.put("checkpoint", {"seconds": round(time.perf_counter() - started, 1), "voices": len(store.list())})


def write_config(path: Path, model_dir: Path, args) -> None:
    path.write_text(f"""
[server]
host = "127.0.0.1"
port = {args.port}
log_level = "info"

[limits]
max_sessions = 1024
idle_timeout_s = 600
max_inactivity_timeout_s = 600

[engine]
name = "cosyvoice2"

[engine.cosyvoice2]
model_dir = "{model_dir}"
device = "cuda"
dtype = "{args.flow_dtype}"
llm_backend = "vllm"
flow_mode = "{args.flow_mode}"
token2wav_cache_gb = {args.token2wav_cache_gb}
final_chunk_attention = "{args.final_chunk_attention}"
flow_steps = {args.flow_steps}
max_batch = {args.max_batch}
graph_max_batch = {args.graph_max_batch}
graph_frame_step = {args.graph_frame_step}
graph_max_frames = {args.graph_max_frames}
token_first_hop_len = {args.first_hop}
stream_scale_factor = {args.stream_scale}
token_max_hop_len = {args.max_hop}
max_speech_per_text_token = {args.speech_per_text_token}
prefix_voices = {args.prefix_voices}
hift_graphs = {str(not args.no_hift_graphs).lower()}
hift_graphs_all_lengths = {str(args.hift_graphs_all_lengths).lower()}
first_chunk_lane = {str(not args.no_first_chunk_lane).lower()}
first_chunk_lane_after_prefix = {str(args.lane_after_prefix).lower()}
first_chunk_by_load = {str(args.first_chunk_by_load).lower()}
first_chunk_waits_round = {str(args.first_chunk_waits_round).lower()}
second_chunk_on_lane = {str(args.second_chunk_on_lane).lower()}
flow_cudnn_attention = {str(not args.no_flow_cudnn_attention).lower()}
flow_fused_kernels = {str(args.flow_fused_kernels).lower()}
launch_ahead = {str(args.launch_ahead).lower()}
paged_encoder_graphs = {str(args.paged_encoder_graphs).lower()}
min_call_rows = {args.min_call_rows}
later_chunks_with_first = {str(args.later_chunks_with_first).lower()}
playing_listeners_first = {str(args.playing_listeners_first).lower()}
urgent_chunks_between_calls = {str(args.urgent_chunks_between_calls).lower()}

[engine.cosyvoice2.vllm]
gpu_memory_utilization = {args.gpu_memory_utilization}
token2wav_memory_gb = {args.token2wav_cache_gb + 16 if args.token2wav_memory_gb is None else args.token2wav_memory_gb}
max_num_seqs = {args.max_num_seqs}
max_num_batched_tokens = {args.max_num_batched_tokens}
warmup_batch_sizes = {[n for n in VLLMSettings.warmup_batch_sizes if n < args.max_num_seqs] + [args.max_num_seqs]}
enforce_eager = {str(args.enforce_eager).lower()}
mps_priority = "{args.llm_mps_priority}"
mps_thread_percentage = {args.llm_mps_thread_percentage}
token2wav_mps_priority = "{args.token2wav_mps_priority}"
""")


def wait_ready(url: str, exited: Callable[[], int | None], timeout: float) -> float:
    """Seconds until ``url`` answers 200; fails as soon as ``exited()`` gives the gateway's exit status."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if (status := exited()) is not None:
            raise RuntimeError(f"the gateway exited with {status} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter() - started
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the gateway was not ready after {timeout:.0f} s")


def scrape(url: str) -> dict[str, float]:
    return parse_metrics(urllib.request.urlopen(url, timeout=5).read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """The gateway's series this report reads, summed over labels; histogram buckets as ``name@le``."""
    wanted = ("tts_llm_", "tts_engine_", "tts_gpu_", "tts_token2wav_", "tts_first_audio_", "tts_late_chunks_",
              "tts_event_loop_lag_")
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(tts_[a-z0-9_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match and match.group(1).startswith(wanted):
            name = match.group(1)
            bucket = re.search(r'le="([^"]+)"', match.group(2) or "")
            if bucket:
                name += f"@{bucket.group(1)}"
            values[name] = values.get(name, 0.0) + float(match.group(3))
    return values


SESSIONS_PER_CLIENT = 32  # one load-generator process per this many sessions: the client must not be the bottleneck


def load_clients(sessions: int) -> list[tuple[int, int]]:
    """(seed, sessions) of each load-generator process of a level. bench/official_baseline.py
    seeds its agents the same way, so that both speak the same replies at the same moments."""
    return [(sessions * 1000 + k, min(SESSIONS_PER_CLIENT, sessions - start))
            for k, start in enumerate(range(0, sessions, SESSIONS_PER_CLIENT))]


# Replies begun in a level's first BURST_S seconds are its opening burst: every session's first
# reply, when a level starts them all at once (--start-spread 0.5); the rest are "later".
BURST_S = 2.0


def by_start(records: list) -> dict:
    """A level's opening burst and its later replies, each as: replies, stall-free share, TTFA
    and errors (None: no such reply)."""
    def brief(part: list) -> dict | None:
        if not part:
            return None
        summary = loadgen.summarize(part)
        return {key: summary[key] for key in ("contexts", "stall_free_fraction", "ttfa_ms", "errors")}

    burst = [r for r in records if (r.started_s or 0.0) < BURST_S]
    return {"burst": brief(burst), "later": brief([r for r in records if (r.started_s or 0.0) >= BURST_S])}


def run_load(url: str, workload: str, sessions: int, start_spread: float, args, word_timings: bool = True
             ) -> tuple[dict, list[list], dict]:
    """One level, its sessions spread over load-generator processes: the merged summary; each
    reply as ``[started_s, ttfa_ms, stall_audio_ms, outcome]`` (when in the level it began, its
    first audio, where its stalls fell, and how it ended); and ``by_start``, the level's
    opening burst apart from the rest."""
    procs = []
    for k, (seed, count) in enumerate(load_clients(sessions)):
        path = Path(f"/tmp/loadgen-{sessions}-{k}.json")
        path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "tts_gateway.gateway.loadgen", "--url", url, "--sessions", str(count), "--workload", workload,
               "--duration", str(args.duration), "--tokens-per-second", str(args.tokens_per_second),
               "--seed", str(seed), "--start-spread", str(start_spread), "--json", str(path)]
        cmd += ["--back-to-back"] if args.back_to_back else ["--turn-gap", args.turn_gap]
        cmd += [] if word_timings else ["--no-word-timings"]
        procs.append((path, subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    records = []
    for path, proc in procs:
        _, err = proc.communicate(timeout=args.duration + 120)
        if not path.exists():
            raise RuntimeError(f"load generator failed: {err.decode()[-2000:]}")
        for raw in json.loads(path.read_text())["records"]:
            records.append(loadgen.Record(**raw))
    replies = [[r.started_s, r.ttfa_ms, r.stall_audio_ms, r.outcome]
               for r in sorted(records, key=lambda r: r.started_s or 0.0)]
    return loadgen.summarize(records), replies, by_start(records)


def stage_report(before: dict, after: dict, elapsed: float) -> dict:
    """Where the time went over one level, from the gateway's own counters."""
    def delta(name: str) -> float:
        return counter_delta(before, after, name)

    totals = {name: round(delta(f"tts_{name}_total"), 3) for name in (
        "llm_generated_tokens", "llm_prompt_tokens", "llm_steps", "llm_inter_token_seconds", "llm_inter_tokens",
        "token2wav_batches", "token2wav_chunks", "token2wav_busy_seconds", "token2wav_first_lane_batches",
        "token2wav_first_lane_chunks", "token2wav_first_lane_busy_seconds", "late_chunks_llm_bound",
        "late_chunks_token2wav_bound", "token2wav_early_chunks", "token2wav_first_chunks_lengthened",
        "token2wav_flow_calls", "token2wav_flow_eager_calls", "token2wav_flow_encoder_graph_calls",
        "token2wav_flow_lane_calls_after_prefix", "token2wav_flow_vocoder_eager_calls",
        "token2wav_flow_padded_row_frames",
        *(f"token2wav_{total}_{kind}" for total in ("flow_row_frames", "calls", "call_seconds", "call_gpu_seconds")
          for kind in CALL_KINDS))}
    needed = sum(totals[f"token2wav_flow_row_frames_{kind}"] for kind in CALL_KINDS)
    turns = delta("tts_token2wav_turn_state_turns_total")
    turn_state = {
        "peak_gb_since_start": round(after.get("tts_token2wav_turn_state_peak_bytes_total", 0.0) / 1e9, 2),
        "turns": turns,
        "mb_per_turn": round(delta("tts_token2wav_turn_state_stored_bytes_total") / turns / 1e6, 1) if turns else None,
        "fallbacks": delta("tts_token2wav_turn_state_fallbacks_total"),  # was "fallback_turns"
        "returned_turns": delta("tts_token2wav_turn_state_returns_total"),
    }
    firsts = delta("tts_first_audio_chunks_total")
    first_audio_ms = {stage: round(1000 * delta(f"tts_first_audio_{stage}_seconds_total") / firsts, 1) if firsts else None
                      for stage in FIRST_AUDIO_STAGES}
    # Calls phase by phase (engine/cosyvoice2/serving/phase_clock.py), the engine thread's and the
    # first-chunk lane's: ms per call, on the GPU's timeline and the thread's.
    call_phase_ms = {}
    for thread, who in PHASE_THREADS.items():
        name = who.replace(" ", "_").replace("-", "_")
        timed = delta(f"tts_token2wav_flow_{thread}phase_calls_total")
        call_phase_ms[name] = {"calls": timed} | {
            clock: {phase: round(1000 * delta(f"tts_token2wav_flow_{thread}phase_{clock}_seconds_{phase}_total")
                                 / timed, 1) for phase in PHASES} if timed else None
            for clock in ("gpu", "thread")
        }
    lag_n = delta("tts_event_loop_lag_seconds_count")
    lag_over = {le: round(1 - delta(f"tts_event_loop_lag_seconds_bucket@{le}") / lag_n, 4) if lag_n else None
                for le in ("0.005", "0.02", "0.1")}
    steps = totals["llm_steps"]
    return {
        **totals,
        "token2wav_busy_ratio": round(totals["token2wav_busy_seconds"] / elapsed, 3),
        "token2wav_mean_batch": round(totals["token2wav_chunks"] / totals["token2wav_batches"], 1)
        if totals["token2wav_batches"] else None,
        "token2wav_flow_padding_share": round(1 - needed / totals["token2wav_flow_padded_row_frames"], 3)
        if totals["token2wav_flow_padded_row_frames"] else None,
        "llm_steps_per_s": round(steps / elapsed, 1),
        "llm_tokens_per_step": round(totals["llm_generated_tokens"] / steps, 2) if steps else None,
        "llm_inter_token_ms": round(1000 * totals["llm_inter_token_seconds"] / totals["llm_inter_tokens"], 2)
        if totals["llm_inter_tokens"] else None,
        # By kind of call: its mean time (flow and vocoder), and the frames the flow needed
        # per second of it (against bench/flow_profile.py's solve alone: what else costs).
        "call_ms_by_kind": {kind: _ratio(1000 * totals[f"token2wav_call_seconds_{kind}"],
                                         totals[f"token2wav_calls_{kind}"]) for kind in CALL_KINDS},
        # ... and its mean time on its stream's timeline (idle gaps and the other process's
        # kernels beside it included; a call that failed counts with none; None off a GPU).
        "call_gpu_ms_by_kind": {
            kind: _ratio(1000 * totals[f"token2wav_call_gpu_seconds_{kind}"], totals[f"token2wav_calls_{kind}"])
            if totals[f"token2wav_call_gpu_seconds_{kind}"] else None for kind in CALL_KINDS},
        "row_frames_per_call_s_by_kind": {kind: _ratio(totals[f"token2wav_flow_row_frames_{kind}"],
                                                       totals[f"token2wav_call_seconds_{kind}"]) for kind in CALL_KINDS},
        "first_audio_ms": first_audio_ms,
        "call_phase_ms": call_phase_ms,
        "turn_state": turn_state,
        "event_loop_lag_mean_ms": round(1000 * delta("tts_event_loop_lag_seconds_sum") / lag_n, 2) if lag_n else None,
        "event_loop_lag_share_over_s": lag_over,
    }


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 1) if whole else None


def counter_delta(before: dict, after: dict, name: str) -> float:
    """How much a scraped counter grew between two scrapes."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def session_list(text: str) -> list[int]:
    """``1,16,64`` -> [1, 16, 64]; an empty string -> []."""
    return [int(x) for x in text.split(",") if x]


def float_list(text: str) -> list[float]:
    """``0.5,5`` -> [0.5, 5.0]."""
    return [float(x) for x in text.split(",") if x]


IDLE_NAMES = ("tts_engine_utterances", "tts_engine_running", "tts_engine_queue_depth")


def wait_idle(metrics_url: str, timeout: float = 10.0) -> float:
    """Waits until the gateway holds no utterance and no engine work, so that the last
    level's tail (a batch still running for its cancelled sessions) does not land in the
    next level's first audio; returns the seconds waited (``timeout`` if it never was idle)."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        metrics = scrape(metrics_url)
        if not any(metrics.get(name, 0.0) for name in IDLE_NAMES):
            break
        time.sleep(0.2)
    return round(time.perf_counter() - started, 1)


class GatewayUnderTest:
    """The gateway the levels drive: ``tts-gateway serve`` under the stack sampler, or with
    ``--through-balancer`` one replica per GPU behind HAProxy as deploy/launch-replicas.sh starts
    them in production (its own MPS daemon, ``CUDA_VISIBLE_DEVICES``), sessions through the
    balancer. Metrics are read from the replica itself."""

    def __init__(self, args, config: Path, log, profile_path: Path) -> None:
        self.args = args
        self.replicas = args.out / "replicas"
        if args.through_balancer:
            self.proc = subprocess.Popen(
                ["bash", str(ROOT / "deploy" / "launch-replicas.sh"), "--mps", "--base-port", str(args.port),
                 "--listen", f"127.0.0.1:{args.balancer_port}", "--logs", str(self.replicas), "--", "--config", str(config)],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            self.stream_url = f"ws://127.0.0.1:{args.balancer_port}{STREAM_PATH}"
        else:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "stack_sampler.py"), str(profile_path), "serve", "--config", str(config)],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            self.stream_url = f"ws://127.0.0.1:{args.port}{STREAM_PATH}"

    @property
    def pid(self) -> int:
        """The gateway process itself (under the balancer, the replica's, not the launcher's)."""
        if not self.args.through_balancer:
            return self.proc.pid
        return int((self.replicas / "gateway-0.pid").read_text())

    @property
    def sampled_pid(self) -> int | None:
        return None if self.args.through_balancer else self.proc.pid

    def wait_ready(self, timeout: float) -> dict:
        exited = functools.partial(self.exit_status, timeout=0)
        ready = {"seconds": round(wait_ready(f"http://127.0.0.1:{self.args.port}/readyz", exited, timeout), 1)}
        if self.args.through_balancer:  # ready behind the balancer too (its checks need two passes)
            url = f"http://127.0.0.1:{self.args.balancer_port}/readyz"
            ready["balancer_seconds"] = round(wait_ready(url, exited, 30), 1)
            with urllib.request.urlopen(url, timeout=2) as response:
                ready["served_by"] = response.headers.get("X-Served-By")
            ready["replica_env"] = (self.replicas / "gateway-0.cmd").read_text().split(" serve ")[0]
        return ready

    def exit_status(self, timeout: float) -> int | None:
        """The gateway's own exit status once it has exited (None if it has not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.args.through_balancer:
                status = self.replicas / "gateway-0.status"
                text = status.read_text().strip() if status.exists() else ""
                if text:
                    return int(text)
            elif self.proc.poll() is not None:
                return self.proc.returncode
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()  # the launcher drains its replicas, then stops the balancer
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def engine_core_pid(gateway_pid: int) -> tuple[int, str]:
    """vLLM's engine core: the gateway's child process that vLLM names EngineCore (else the one
    spawned child that is not multiprocessing's resource tracker)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != gateway_pid:
                continue
            pid = int(stat.parent.name)
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            name = (stat.parent / "comm").read_text().strip()
        except (OSError, IndexError, ValueError):
            continue  # it exited while being read
        children.append((pid, name, cmdline))
    named = [c for c in children if "EngineCore" in c[1] or "EngineCore" in c[2]]
    spawned = [c for c in children if "resource_tracker" not in c[2]]
    chosen = named or spawned
    if len(chosen) != 1:
        raise RuntimeError(f"cannot tell vLLM's engine core among the gateway's children: {children}")
    pid, name, cmdline = chosen[0]
    return pid, f"{name}: {cmdline[:200]}"


def kill_engine_core(args, report: Report, gateway: GatewayUnderTest) -> bool:
    """Kill vLLM's engine core while ``args.kill_engine_core`` sessions speak whole replies: each
    must get an error frame (``engine_failed``) for the reply it had open, and the gateway must
    exit non-zero. Returns whether it did."""
    sessions = args.kill_engine_core
    path = Path("/tmp/loadgen-kill.json")
    path.unlink(missing_ok=True)
    spread = loadgen.DEFAULT_START_SPREAD_S
    load = subprocess.Popen(
        [sys.executable, "-m", "tts_gateway.gateway.loadgen", "--url", gateway.stream_url, "--sessions", str(sessions),
         "--workload", "full", "--duration", "25", "--seed", "7", "--start-spread", str(spread),
         "--back-to-back", "--json", str(path)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(spread + 5.0)  # every session has started and is mid-reply
    active = scrape(f"http://127.0.0.1:{args.port}/metrics").get("tts_engine_running", None)
    pid, what = engine_core_pid(gateway.pid)
    os.kill(pid, signal.SIGKILL)
    killed = time.perf_counter()
    status = gateway.exit_status(timeout=90)
    exit_s = time.perf_counter() - killed
    _, err = load.communicate(timeout=120)
    records = [loadgen.Record(**raw) for raw in json.loads(path.read_text())["records"]] if path.exists() else []
    failed = {r.agent for r in records if r.error_code == "engine_failed"}
    any_error = {r.agent for r in records if r.outcome == "error" and r.chars > 0}  # a reply's, not a reconnect's
    result = {
        "sessions": sessions, "killed": what, "engine_running_before": active,
        "gateway_exit_status": status, "seconds_to_exit": round(exit_s, 1),
        "sessions_with_engine_failed": len(failed), "sessions_with_an_error_frame": len(any_error),
        "outcomes": loadgen.summarize(records) if records else {"load_generator": err.decode()[-2000:]},
    }
    ok = status not in (None, 0) and len(failed) == sessions
    report.put("engine_core_killed", {**result, "passed": ok})
    return ok


# A first chunk's path from its text to its audio, stage by stage (bench/stack_sampler.CallTrace,
# whose chunks carry the stages' moments by the same names), and in all.
FIRST_AUDIO_PATH = {**FIRST_AUDIO_STAGES, "total": ("text", "done")}
SLOWEST_FIRST_CHUNKS = 5


def first_audio_paths(profile: dict | None) -> dict | None:
    """What holds first audio, request by request: each stage's p50 and p95 in ms over the
    level's first chunks, and the stages of the slowest few (their ``total`` is the gateway's
    share of TTFA). None without a trace."""
    trace = (profile or {}).get("token2wav_trace")
    if trace is None:
        return None
    firsts = [chunk for chunk in trace["chunks"] if chunk["first"] and "text" in chunk and "first_token" in chunk]

    def stages(chunk: dict) -> dict[str, float]:
        return {name: round(1000 * (chunk[end] - chunk[start]), 1) for name, (start, end) in FIRST_AUDIO_PATH.items()}

    paths = [stages(chunk) for chunk in firsts]
    opening = opening_text(trace) or 0.0  # None only where no first chunk has its text: then none is placed
    burst = [in_burst(chunk["text"], opening) for chunk in firsts]
    return {
        "n": len(paths),
        "ms": path_percentiles(paths),
        "by_start": {part: path_percentiles([p for p, b in zip(paths, burst) if b == (part == "burst")])
                     for part in ("burst", "later")},
        "second_chunk_after_first_ms": second_chunk_lags(trace["chunks"], opening),
        "slowest": sorted(paths, key=lambda p: p["total"], reverse=True)[:SLOWEST_FIRST_CHUNKS],
    }


def in_burst(moment: float, opening: float) -> bool:
    """Whether a moment of a level's trace lies in its opening burst: the ``BURST_S`` from the
    level's first turn's text (``opening_text``) on."""
    return opening <= moment < opening + BURST_S


def opening_text(trace: dict) -> float | None:
    """When the level's first turn's text came, in the trace's seconds: where its opening burst
    begins (None: no first chunk traced with its text)."""
    return min((chunk["text"] for chunk in trace["chunks"] if chunk["first"] and "text" in chunk), default=None)


def llm_steps_by_start(profile: dict | None) -> dict | None:
    """The vLLM engine's steps during the opening burst (the ``BURST_S`` after the level's first
    turn's text) and after it: how many, their interval (ms, p50), the tokens each made and the
    requests running (means), and vLLM's mean gap between a request's consecutive tokens (ms).
    Says whether the burst's first chunks wait for slow steps or for something between them.
    None without traced steps (or without a traced first chunk to place the burst)."""
    trace = (profile or {}).get("token2wav_trace")
    opening = opening_text(trace) if trace else None
    if not trace or not trace.get("llm_steps") or opening is None:
        return None
    steps = trace["llm_steps"]

    def brief(part: list[dict]) -> dict | None:
        if not part:
            return None
        gaps = sum(step["gaps"] for step in part)
        running = [step["running"] for step in part if step["running"] is not None]  # None: no scheduler stats
        return {
            "steps": len(part),
            "interval_ms_p50": percentile([1000 * (b["at"] - a["at"]) for a, b in zip(part, part[1:])], 50),
            "tokens_per_step": round(statistics.fmean(step["tokens"] for step in part), 1),
            "running": round(statistics.fmean(running), 1) if running else None,
            "token_gap_ms": round(1000 * sum(step["gap_s"] for step in part) / gaps, 2) if gaps else None,
        }

    return {"burst": brief([s for s in steps if in_burst(s["at"], opening)]),
            "later": brief([s for s in steps if s["at"] >= opening + BURST_S])}


def path_percentiles(paths: list[dict[str, float]]) -> dict | None:
    """Each stage's p50 and p95 over these first-chunk paths (None: no path)."""
    if not paths:
        return None
    return {name: {"p50": percentile([p[name] for p in paths], 50), "p95": percentile([p[name] for p in paths], 95)}
            for name in FIRST_AUDIO_PATH}


def second_chunk_lags(chunks: list[dict], opening: float) -> dict:
    """How long after its turn's first chunk each second chunk was done (ms), p50 and p95, for
    the turns begun in the opening burst (first text within ``BURST_S`` of ``opening``) and the
    later ones: the audio a first chunk must give to cover it, a short first chunk's risk."""
    by_request: dict[int, list[dict]] = {}
    for chunk in chunks:
        by_request.setdefault(chunk["request"], []).append(chunk)
    lags: dict[str, list[float]] = {"burst": [], "later": []}
    for turn in by_request.values():
        turn.sort(key=lambda chunk: chunk["ready"])
        if len(turn) < 2 or not turn[0]["first"] or "text" not in turn[0]:
            continue
        part = "burst" if in_burst(turn[0]["text"], opening) else "later"
        lags[part].append(1000 * (turn[1]["done"] - turn[0]["done"]))
    return {part: p50_p95(values) for part, values in lags.items()}


# Row counts that split the engine thread's calls in call_costs: one or a few chunks, the
# default configuration's batches after the opening burst, the burst's.
CALL_ROW_BANDS = ((1, 4), (5, 16), (17, None))


def call_costs(profile: dict | None) -> dict | None:
    """What the engine thread's calls cost, by how many chunks they ran (``CALL_ROW_BANDS``):
    per band the calls, their mean chunks, decoder row-frames computed, wall time (ms; from
    the call's share of the thread, as traced) and GPU time by phase (ms on its stream), and the
    sum of their work counters (``work``: e.g. flow calls against ``encoder_graph_calls``), and
    the decoder's GPU time over the level's calls of one paged flow call (none of their rows
    outside the pool) as a line, ms = fixed + per row-frame (least squares): the decoder's cost
    inside the gateway, beside the other process's work, to hold against
    bench/paged_call_costs.sh's alone (None with too few calls). None without a traced GPU call
    of the engine thread."""
    calls = [c for c in ((profile or {}).get("token2wav_trace") or {}).get("calls", ())
             if not c["lane"] and c.get("gpu_ms")]
    if not calls:
        return None
    bands = {}
    for low, high in CALL_ROW_BANDS:
        band = [c for c in calls if low <= len(c["requests"]) and (high is None or len(c["requests"]) <= high)]
        if not band:
            continue
        phases = sorted({phase for c in band for phase in c["gpu_ms"]})
        bands[f"{low}-{high or ''}"] = {
            "calls": len(band),
            "chunks": round(statistics.fmean(len(c["requests"]) for c in band), 1),
            "padded_row_frames": round(statistics.fmean(c["work"].get("padded_row_frames", 0) for c in band)),
            "wall_ms": round(statistics.fmean(1000 * c["s"] for c in band), 1),
            "gpu_ms": {phase: round(statistics.fmean(c["gpu_ms"].get(phase, 0.0) for c in band), 1)
                       for phase in phases},
            "work": dict(sum((collections.Counter(c["work"]) for c in band), collections.Counter())),
        }
    paged = [c for c in calls
             if c["gpu_ms"].get("decoder") and not c["gpu_ms"].get("unpaged") and c["work"].get("calls") == 1]
    frames = [c["work"].get("padded_row_frames", 0) for c in paged]
    decoder = [c["gpu_ms"]["decoder"] for c in paged]
    line = None
    if len(set(frames)) > 1:
        slope, intercept = statistics.linear_regression(frames, decoder)
        line = {"fixed_ms": round(intercept, 1), "us_per_row_frame": round(1000 * slope, 1)}
    return {"by_rows": bands, "decoder_line": line}


# How long a profile may take to come once asked for: the sampler answers within its 10 ms
# interval, and a level's trace is a few MB of JSON.
PROFILE_WAIT_S = 10.0


def take_profile(pid: int | None, path: Path) -> dict | None:
    """The gateway's thread profile since the last call (bench/stack_sampler.py; None when the
    gateway runs without it)."""
    if pid is None:
        return None
    path.unlink(missing_ok=True)
    stack_sampler.request_path(path).touch()
    deadline = time.monotonic() + PROFILE_WAIT_S
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.1)
    print(f"[gpu_check] the gateway wrote no profile within {PROFILE_WAIT_S:g} s", file=sys.stderr, flush=True)
    return None


async def profile_kernels(path: Path, after_s: float, seconds: float) -> dict | None:
    """The gateway's GPU kernels over ``seconds`` from ``after_s`` into a level
    (bench/stack_sampler.py, KernelProfiler), or None if no summary came."""
    path.unlink(missing_ok=True)
    await asyncio.sleep(after_s)
    stack_sampler.request_path(path).touch()
    await asyncio.sleep(seconds)
    stack_sampler.request_path(path).touch()
    for _ in range(600):  # summing a window's kernel records can take a while
        if path.exists():
            return json.loads(path.read_text())
        await asyncio.sleep(0.1)
    return None


async def drive(args, report: Report, gateway: GatewayUnderTest, profile_path: Path) -> None:
    """First audio of the system itself (whole replies, each cut off after its first audio, so
    that a level holds many), then whole replies, then the ramp with replies streamed as deltas."""
    http = f"http://127.0.0.1:{args.port}"
    url = gateway.stream_url
    gateway_pid = gateway.sampled_pid
    levels = []
    plan = [("full-barge-in", n, word_timings) for n in args.first_audio_sessions
            for word_timings in ((True, False) if args.first_audio_without_word_timings else (True,))]
    plan += [("full", n, True) for n in args.full_sessions] + [(args.workload, n, True) for n in args.sessions]
    for (workload, sessions, word_timings), start_spread in itertools.product(plan, args.start_spread):
        idle_wait_s = wait_idle(f"{http}/metrics")
        before = scrape(f"{http}/metrics")
        take_profile(gateway_pid, profile_path)
        started = time.perf_counter()
        with PeakMemory(lambda: gpu_memory()["used_mib"]) as memory:
            summary, replies, split = await asyncio.to_thread(
                run_load, url, workload, sessions, start_spread, args, word_timings
            )
        elapsed = time.perf_counter() - started
        after = scrape(f"{http}/metrics")
        queried = counter_delta(before, after, "tts_llm_prefix_cache_queried_tokens_total")
        hits = counter_delta(before, after, "tts_llm_prefix_cache_hit_tokens_total")
        level = {
            "workload": workload,
            "sessions": sessions,
            "start_spread_s": start_spread,
            "turn_gap_s": args.turn_gap_s,
            "word_timings": word_timings,
            "summary": summary,
            "replies": replies,
            "by_start": split,
            "stall_free": loadgen.stall_free(summary, args.ttfa_p95_ms),
            "gpu": gpu_memory(),
            "gpu_peak_used_mib": memory.peak_mib,
            "within_memory_budget": within_budget(memory.peak_mib, args.memory_budget_gb),
            "prefix_cache_hit_ratio": round(hits / queried, 3) if queried else None,
            "stages": stage_report(before, after, elapsed),
            "profile": (profile := take_profile(gateway_pid, profile_path)),
            "first_audio_paths": first_audio_paths(profile),
            "llm_steps_by_start": llm_steps_by_start(profile),
            "call_costs": call_costs(profile),
            "seconds": round(elapsed, 1),
            "idle_wait_s": idle_wait_s,
        }
        levels.append(level)
        report.put("levels", levels)
        report.put("stall_free_capacity", stall_free_capacity(levels, len(args.start_spread) > 1))
        report.put("repeats", repeat_spread(levels))
    if args.kernel_profile_s and plan and gateway_pid is None:
        print("[gpu_check] no kernel profile behind the balancer (no sampler there)", file=sys.stderr, flush=True)
    elif args.kernel_profile_s and plan:
        # A pass of its own: stopping the profiler holds the gateway (GIL) for tens of seconds
        # while it sums the records, so the load results of this pass are not reported.
        workload, sessions, _ = kernel_profile_level(plan)
        kernels = asyncio.create_task(profile_kernels(
            profile_path.with_suffix(".kernels.json"), max(0.0, (args.duration - args.kernel_profile_s) / 2),
            args.kernel_profile_s))
        await asyncio.to_thread(run_load, url, workload, sessions, args.start_spread[-1], args)
        report.put("kernel_profile", {"workload": workload, "sessions": sessions, **(await kernels or {})})


def kernel_profile_level(plan: list[tuple[str, int, bool]]) -> tuple[str, int, bool]:
    """The level the kernel profile pass repeats: the largest whole-reply level, else the largest."""
    return max(plan, key=lambda level: (level[0] == "full", level[1]))


def within_budget(peak_mib: float | None, budget_gb: float | None) -> bool | None:
    """Whether the card's peak use (every process on it) stayed within ``--memory-budget-gb``
    (None: no budget, or no peak read). GiB, as nvidia-smi, vLLM and token2wav_memory_gb count."""
    if budget_gb is None or peak_mib is None:
        return None
    return peak_mib <= budget_gb * 1024


def stall_free_capacity(levels: list[dict], by_spread: bool) -> dict:
    """The largest stall-free level of each workload (and start spread, ``by_spread``) that kept
    within the memory budget if there is one, or None. A level run more than once (``--sessions
    64,64``) counts only if every run of it does."""
    counted: dict[tuple[str, int, float, bool], bool] = {}  # a level (and its runs): whether it counts
    for level in levels:
        key = f"{level['workload']}@{level['start_spread_s']:g}s" if by_spread else level["workload"]
        counts = bool(level["stall_free"]) and level.get("within_memory_budget") is not False
        run = key, level["sessions"], level["start_spread_s"], level.get("word_timings", True)
        counted[run] = counted.get(run, True) and counts
    capacity: dict[str, int | None] = {}
    for (key, sessions, _, _), counts in counted.items():
        best = capacity.get(key)
        capacity[key] = max(best or 0, sessions) if counts else best
    return capacity


def repeat_spread(levels: list[dict]) -> dict:
    """For each level run more than once (same workload, sessions, start spread and word timings; the same
    seeds, so the runs differ by timing alone): how far its runs lie apart, as the smallest,
    median and largest stall-free share, TTFA p50 and p95, and stalls. At 64 sessions on one
    H100 three runs of one configuration spanned 70-95% stall-free (docs/benchmarks.md): a
    setting is told apart from the defaults by ranges like these, not by one level."""
    runs: dict[str, list[dict]] = {}
    for level in levels:
        key = f"{level['workload']}@{level['sessions']}@{level['start_spread_s']:g}s"
        if not level.get("word_timings", True):
            key += "@no-word-timings"
        runs.setdefault(key, []).append(level)

    def spread(values: list[float | None]) -> dict | None:
        ordered = sorted(value for value in values if value is not None)  # None: a run without audio
        return {"min": ordered[0], "median": statistics.median(ordered), "max": ordered[-1]} if ordered else None

    report = {}
    for key, repeated in runs.items():
        summaries = [level["summary"] for level in repeated]
        if len(summaries) < 2:
            continue
        report[key] = {
            "runs": len(summaries),
            "stall_free_fraction": spread([s["stall_free_fraction"] for s in summaries]),
            "ttfa_p50_ms": spread([s["ttfa_ms"]["p50"] for s in summaries]),
            "ttfa_p95_ms": spread([s["ttfa_ms"]["p95"] for s in summaries]),
            "stalls": spread([s["stalls"] for s in summaries]),
        }
    return report


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check")))
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/cv2-full"))
    parser.add_argument("--prompt-wav", type=Path, default=ROOT / ".gpu" / "prompt.wav")
    parser.add_argument("--sessions", type=session_list, default=[1, 16, 64, 128, 256])
    parser.add_argument("--workload", default="llm", choices=loadgen.WORKLOADS)
    parser.add_argument("--full-sessions", type=session_list, default=[1, 16, 64, 128],
                        help="levels of whole replies sent at once, run before the --workload levels")
    parser.add_argument("--first-audio-sessions", type=session_list, default=[1],
                        help="levels of whole replies cut off after first audio (full-barge-in), run first")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    parser.add_argument("--start-spread", type=float_list, default=[loadgen.DEFAULT_START_SPREAD_S],
                        help="seconds over which a level's sessions start (default: all at once); with a list "
                        "(0.5,5) every level runs once at each, on the same gateway")
    parser.add_argument("--turn-gap", default=",".join(f"{s:g}" for s in loadgen.DEFAULT_TURN_GAP_S),
                        help="MIN,MAX seconds of the user's turn after a reply has been heard out (default: %(default)s)")
    parser.add_argument("--back-to-back", action="store_true",
                        help="each agent sends its next reply as soon as the last is done (a throughput test)")
    parser.add_argument("--first-hop", type=int, default=5, help="token_first_hop_len of the gateway")
    parser.add_argument("--tokens-per-second", type=float, default=30.0)
    parser.add_argument("--stream-scale", type=int, default=2, help="stream_scale_factor of the gateway (hop growth)")
    parser.add_argument("--max-hop", type=int, default=200,
                        help="token_max_hop_len of the gateway: the hop grows up to this (8 s chunks late in a reply)")
    parser.add_argument(
        "--speech-per-text-token", type=float, default=7.5,
        help="max_speech_per_text_token of the gateway: random weights never sample eos, so every reply "
        "runs to this bound; 7.5 is a real speaking rate (25 speech tokens/s, ~3.3 text tokens/s), "
        "the official bound 20 makes replies ~2.7x too long",
    )
    parser.add_argument("--prefix-voices", type=int, default=4, help="prefix_voices of the gateway (0 = off)")
    parser.add_argument("--flow-mode", default="paged", choices=("paged", "recompute"),
                        help="flow_mode of the gateway (paged: the GPU default, the turn-state pool; recompute)")
    parser.add_argument("--token2wav-cache-gb", type=float, default=40.0,
                        help="token2wav_cache_gb of the gateway: the paged pool of turns' decoder state")
    parser.add_argument("--final-chunk-attention", default="chunk", choices=("chunk", "full"))
    parser.add_argument("--flow-steps", type=int, default=10,
                        help="flow_steps of the gateway: the flow's Euler steps (10 is the official count)")
    parser.add_argument("--graph-frame-step", type=int, default=50, help="graph_frame_step of the gateway")
    parser.add_argument("--ttfa-p95-ms", type=float, default=400.0)
    parser.add_argument("--flow-dtype", default="bfloat16")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--graph-max-batch", type=int, default=64,
                        help="graph_max_batch of the gateway: flow CUDA graphs of non-final chunks up to this batch")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    # A smaller card's settings on a large one (docs/cosyvoice2.md, the card table).
    parser.add_argument("--token2wav-memory-gb", type=float, default=None,
                        help="token2wav_memory_gb of the gateway (default: the pool and 16)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="max_num_seqs of the gateway (and the warm-up's largest batch)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--graph-max-frames", type=int, default=3200, help="graph_max_frames of the gateway")
    parser.add_argument("--memory-budget-gb", type=float, default=None,
                        help="a total in GiB the card's peak use must keep within (every process on it): levels over it "
                        "are marked and do not count towards the stall-free capacity")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-hift-graphs", action="store_true", help="the vocoder eager (hift_graphs = false)")
    parser.add_argument("--hift-graphs-all-lengths", action=argparse.BooleanOptionalAction, default=True,
                        help="one-row vocoder graphs of last and early chunks' lengths (hift_graphs_all_lengths)")
    parser.add_argument("--paged-encoder-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="the paged calls' token encoder by CUDA graphs (paged_encoder_graphs)")
    parser.add_argument("--no-first-chunk-lane", action="store_true",
                        help="first chunks wait for the main token2wav thread (first_chunk_lane = false)")
    parser.add_argument("--lane-after-prefix", action="store_true",
                        help="the lane's calls of several rows after voice prefixes (first_chunk_lane_after_prefix)")
    parser.add_argument("--first-chunk-by-load", action="store_true",
                        help="the short first chunk only when the next can follow in time (first_chunk_by_load = true)")
    parser.add_argument("--first-chunk-waits-round", action="store_true",
                        help="... judging the next chunk to wait for the engine thread's round in flight (first_chunk_waits_round)")
    parser.add_argument("--second-chunk-on-lane", action="store_true",
                        help="the lane also runs the chunk after a short first chunk (second_chunk_on_lane = true)")
    parser.add_argument("--no-flow-cudnn-attention", action="store_true",
                        help="the flow's attention left on the kernel vLLM's import leaves it (the memory-efficient "
                        "one; flow_cudnn_attention = false)")
    parser.add_argument("--min-call-rows", type=int, default=8,
                        help="min_call_rows of the gateway: calls wait for this many chunks while listeners have audio")
    parser.add_argument("--later-chunks-with-first", action=argparse.BooleanOptionalAction, default=True,
                        help="first chunks' calls also take later chunks no wider (later_chunks_with_first)")
    parser.add_argument("--playing-listeners-first", action=argparse.BooleanOptionalAction, default=True,
                        help="a reply about to run out of audio goes before first chunks (playing_listeners_first)")
    parser.add_argument("--urgent-chunks-between-calls", action="store_true",
                        help="a reply that would run dry waiting for a round of calls goes between them "
                        "(urgent_chunks_between_calls)")
    parser.add_argument("--launch-ahead", action="store_true",
                        help="the token2wav thread launches its next call before it waits for the last (launch_ahead)")
    parser.add_argument("--flow-fused-kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="the flow decoder's fused Triton kernels (flow_fused_kernels)")
    parser.add_argument("--first-audio-without-word-timings", action="store_true",
                        help="each first-audio level again with sessions that ask for no word timings (their cost)")
    parser.add_argument("--kernel-profile-s", type=float, default=0.0,
                        help="after the levels, one more pass of the largest whole-reply level with the gateway's "
                        "GPU kernels profiled for this many seconds in its middle (torch profiler; its load "
                        "results are not reported: stopping the profiler holds the gateway for seconds)")
    parser.add_argument("--llm-mps-priority", default="normal", choices=("normal", "below-normal"),
                        help="[engine.cosyvoice2.vllm] mps_priority: vLLM's engine core as an MPS client")
    parser.add_argument("--llm-mps-thread-percentage", type=int, default=100,
                        help="[engine.cosyvoice2.vllm] mps_thread_percentage")
    parser.add_argument("--token2wav-mps-priority", default="normal", choices=("normal", "below-normal"),
                        help="[engine.cosyvoice2.vllm] token2wav_mps_priority: the gateway's own process as an "
                        "MPS client")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--through-balancer", action="store_true",
                        help="start the gateway with deploy/launch-replicas.sh (one replica per GPU, its own MPS "
                        "daemon, HAProxy in front) and send the sessions through the balancer")
    parser.add_argument("--balancer-port", type=int, default=8080)
    parser.add_argument("--kill-engine-core", type=int, default=0, metavar="SESSIONS",
                        help="after the levels, kill vLLM's engine core while this many sessions speak: each must "
                        "get engine_failed and the gateway must exit non-zero")
    parser.add_argument("--skip-equality", action="store_true")
    parser.add_argument("--only-equality", action="store_true",
                        help="stop after the equality check (then a second call on the warm machine runs the ramp)")
    parser.add_argument("--equality-timeout", type=float, default=240)
    parser.add_argument("--equality-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="vLLM's precision in the equality check (bfloat16: judged by teacher-forced margins)")
    parser.add_argument("--ready-timeout", type=float, default=420)
    return parser


def main() -> int:
    parser = argument_parser()
    args = parser.parse_args()
    try:  # before minutes of start-up, not at the first level
        for spread in args.start_spread:
            loadgen.check_start_spread(spread, args.duration)
        args.turn_gap_s = None if args.back_to_back else list(loadgen.parse_turn_gap(args.turn_gap))
    except ValueError as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out)
    import torch

    report.put("machine", {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "python": sys.version.split()[0], "gpu_memory": gpu_memory(),
                           "mps_clients": mps_clients()})
    report.put("options", {name: str(value) if isinstance(value, Path) else value for name, value in vars(args).items()})
    prepare_model(args.model_dir, args.prompt_wav, report)

    status = 0
    if not args.skip_equality:
        started = time.perf_counter()
        with open(args.out / "equality.log", "w") as log:
            try:
                code = subprocess.run(
                    [sys.executable, str(ROOT / "bench" / "vllm_equality.py"), "--model-dir", str(args.model_dir),
                     "--dtype", args.equality_dtype, "--json", str(args.out / "equality.json")],
                    stdout=log, stderr=subprocess.STDOUT,
                    timeout=args.equality_timeout,
                ).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        equality = json.loads((args.out / "equality.json").read_text()) if (args.out / "equality.json").exists() else {}
        equality.update(exit=code, seconds=round(time.perf_counter() - started, 1))
        report.put("equality", equality)
        status = 0 if code == 0 else 1

    if args.only_equality:
        return status
    config = args.out / "gateway.toml"
    write_config(config, args.model_dir, args)
    with open(args.out / "gateway.log", "w") as log:
        profile_path = Path("/tmp/gateway-profile.json")
        gateway = GatewayUnderTest(args, config, log, profile_path)
        try:
            ready = gateway.wait_ready(args.ready_timeout)
            log.flush()
            gateway_log = gateway.replicas / "gateway-0.log" if args.through_balancer else args.out / "gateway.log"
            startup = [line.strip() for line in gateway_log.read_text().splitlines()
                       if "CUDA graph" in line or "vLLM warm-up" in line or "WARNING" in line][:40]
            report.put("gateway_ready", {**ready, "gpu": gpu_memory(), "mps_clients": mps_clients(), "log": startup})
            asyncio.run(drive(args, report, gateway, profile_path))
            if args.kill_engine_core and not kill_engine_core(args, report, gateway):
                status = 1
        finally:
            gateway.stop()
    return status


if __name__ == "__main__":
    sys.exit(main())
