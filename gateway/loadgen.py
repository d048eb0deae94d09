"""Load generator: N simulated agents talking to a gateway (``tts-gateway bench``).

Each agent holds one session and, until the run's time is up, picks a reply
from the corpus and speaks it in a new context, as in a conversation:
after a reply is ``done``, the agent waits until its listener has
heard all of it (the playback clock below), then for the user's turn (a seeded
pause within ``--turn-gap``), and only then sends its next reply. So a session
never asks for more than real-time audio. ``--back-to-back`` sends the next reply
as soon as ``done`` arrives instead: a throughput test, where each session asks
for audio as fast as the gateway makes it.

- ``full``: the whole reply in one ``text`` frame, then ``end``;
- ``llm``: ~4-character deltas at ``--tokens-per-second`` while audio is read;
- ``barge-in``: like ``llm``, then ``cancel`` at a random (seeded) moment after
  first audio, and on to the next reply;
- ``full-barge-in``: like ``full``, then ``cancel`` as in ``barge-in``: many
  first-audio samples per session, each without text arrival in it.

Per context, on the client's clock:

- **TTFA**: first text byte sent -> first audio byte received;
- **stalls**: a playback clock starts at the first chunk and plays each chunk
  for its duration; a chunk that arrives after the buffered audio ran out is a
  stall, and the gap is added to the stall time (strict: no jitter buffer);
- **RTF**: wall time from first text to ``done`` / audio duration (for ``llm``
  this includes the time the text takes to arrive);
- **outcome**: ``done``, ``cancelled``, ``error`` (with its code) or
  ``truncated`` (still running when the run's time was up; its TTFA and stalls
  up to then still count).

``--ramp 1,2,4,8`` runs each level for ``--duration`` and reports the
*stall-free capacity*: the largest level with no stalls, no errors and TTFA
p95 under ``--ttfa-p95-ms``. This module uses only the public protocol
(gateway.client); matplotlib (extra ``bench``) is needed for ``--plots`` only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.client import GatewayError, TTSClient
from gateway.wire import SAMPLE_RATES, STREAM_PATH

DATA_DIR = Path(__file__).resolve().parent.parent / "bench" / "data"
WORKLOADS = ("full", "llm", "barge-in", "full-barge-in")
WHOLE_REPLY_WORKLOADS = ("full", "full-barge-in")  # the reply in one text frame; the others stream deltas
DELTA_CHARS = 4
BARGE_IN_AFTER_S = (0.2, 2.0)  # cancel this long after first audio (uniform, seeded)


def load_corpus(lang: str = "en", path: Path | None = None) -> list[str]:
    """Replies, one per line; ``\\n`` in the file is a line break in the reply."""
    if path is not None:
        files = [Path(path)]
    else:
        files = [DATA_DIR / f"replies_{code}.txt" for code in (("en", "zh") if lang == "mix" else (lang,))]
    replies = []
    for file in files:
        for line in file.read_text(encoding="utf-8").splitlines():
            if line.strip():
                replies.append(line.strip().replace("\\n", "\n"))
    if not replies:
        raise ValueError(f"no replies in {', '.join(map(str, files))}")
    return replies


# Agents start within this many seconds: all at once, though not on the same tick.
DEFAULT_START_SPREAD_S = 0.5
# The user's turn between two replies (seconds, uniform, seeded): after the listener has heard
# the reply, they speak, and their agent's next reply starts.
DEFAULT_TURN_GAP_S = (1.0, 3.0)


def check_start_spread(start_spread: float, duration: float) -> None:
    """Agents must start within their level: raises ValueError otherwise."""
    if not 0 <= start_spread < duration:
        raise ValueError(f"start_spread must be at least 0 and below the duration ({duration} s), got {start_spread}")


def check_turn_gap(turn_gap: tuple[float, float]) -> tuple[float, float]:
    """(MIN, MAX) seconds of the user's turn: raises ValueError unless 0 <= MIN <= MAX."""
    if len(turn_gap) != 2 or not 0 <= turn_gap[0] <= turn_gap[1]:
        raise ValueError(f"turn gap must be MIN,MAX seconds with 0 <= MIN <= MAX, got {turn_gap}")
    return float(turn_gap[0]), float(turn_gap[1])


def parse_turn_gap(text: str) -> tuple[float, float]:
    """``MIN,MAX`` (or one number for both), checked as ``check_turn_gap`` does."""
    parts = [float(part) for part in text.split(",")]
    return check_turn_gap(tuple(parts * 2 if len(parts) == 1 else parts))


@dataclass
class Record:
    """One context, as the agent saw it."""

    sessions: int  # the concurrency level it ran at
    agent: int
    workload: str
    chars: int
    outcome: str = "truncated"  # done | cancelled | error | truncated
    error_code: str | None = None
    ttfa_ms: float | None = None
    server_ttfa_ms: float | None = None
    audio_ms: float = 0.0
    wall_ms: float | None = None  # first text -> done
    rtf: float | None = None
    stalls: int = 0
    stall_ms: float = 0.0
    started_s: float | None = None  # when it began, in seconds from the start of its level
    # Where each stall fell: the reply's audio received before it, in ms (which chunk was late).
    stall_audio_ms: list[float] = dataclasses.field(default_factory=list)
    # Each chunk after the first: the audio its listener still had buffered when it arrived, in
    # ms (negative: how long the listener had been waiting for it, a stall). How close each
    # chunk came to a stall, also when none was late.
    slack_ms: list[float] = dataclasses.field(default_factory=list)


class _Playback:
    """A player that starts at the first chunk and never waits on purpose."""

    def __init__(self) -> None:
        self.runs_out = None  # perf_counter time when the buffered audio is used up

    def add(self, now: float, duration_ms: float, record: Record) -> None:
        start = now
        if self.runs_out is not None:  # a chunk after the first
            record.slack_ms.append(round((self.runs_out - now) * 1000, 1))
            if now > self.runs_out:
                record.stalls += 1
                record.stall_ms += (now - self.runs_out) * 1000
                record.stall_audio_ms.append(round(record.audio_ms, 1))
            start = max(now, self.runs_out)
        self.runs_out = start + duration_ms / 1000


async def _speak(tts: TTSClient, text: str, record: Record, rng: random.Random, tokens_per_second: float,
                 deadline: float) -> float | None:
    """Run one context to its end (or the deadline), filling in ``record``; returns when
    (``time.perf_counter``) its listener has heard all of its audio, None without audio."""
    loop = asyncio.get_running_loop()
    ctx = tts.context()
    deltas = [text] if record.workload in WHOLE_REPLY_WORKLOADS else [text[i:i + DELTA_CHARS] for i in range(0, len(text), DELTA_CHARS)]
    started = None
    first_audio = asyncio.Event()
    stopping = False  # we cancel: send nothing more

    async def send() -> None:
        nonlocal started
        due = loop.time()
        for delta in deltas:
            if stopping or ctx.finished:
                return
            if started is None:
                started = time.perf_counter()
            await ctx.send_text(delta)
            if len(deltas) > 1:
                due += 1 / tokens_per_second
                await asyncio.sleep(max(0.0, due - loop.time()))
        await ctx.end()

    playback = _Playback()

    async def receive() -> None:
        async for chunk in ctx:
            now = time.perf_counter()
            if record.ttfa_ms is None:
                record.ttfa_ms = (now - started) * 1000
                first_audio.set()
            playback.add(now, chunk.duration_ms, record)
            record.audio_ms += chunk.duration_ms

    async def barge_in() -> None:
        nonlocal stopping
        await first_audio.wait()
        await asyncio.sleep(rng.uniform(*BARGE_IN_AFTER_S))
        stopping = True
        await ctx.cancel()

    tasks = [asyncio.create_task(send())]
    if record.workload.endswith("barge-in"):
        tasks.append(asyncio.create_task(barge_in()))
    receiver = asyncio.create_task(receive())
    try:
        await asyncio.wait_for(asyncio.shield(receiver), max(0.0, deadline - loop.time()))
        sender = tasks[0]
        if sender.done() and sender.exception() is not None:
            raise sender.exception()
    except TimeoutError:
        receiver.cancel()
        stopping = True
        if not ctx.finished:
            await ctx.cancel()  # free the gateway; the outcome stays "truncated"
        return playback.runs_out
    except GatewayError as error:
        record.outcome, record.error_code = "error", error.code
        raise
    finally:
        for task in (*tasks, receiver):
            task.cancel()
        await asyncio.gather(*tasks, receiver, return_exceptions=True)
    if ctx.cancelled:
        record.outcome = "cancelled"
    elif ctx.done is not None:
        record.outcome = "done"
        record.server_ttfa_ms = ctx.done.ttfa_ms
        if started is not None:
            record.wall_ms = (time.perf_counter() - started) * 1000
            if record.audio_ms > 0:
                record.rtf = record.wall_ms / record.audio_ms
    return playback.runs_out


async def _agent(index: int, sessions: int, args: argparse.Namespace, replies: list[str], deadline: float,
                 records: list[Record]) -> None:
    loop = asyncio.get_running_loop()
    rng = random.Random(f"{args.seed}-{sessions}-{index}")
    level_start = deadline - args.duration
    await asyncio.sleep(rng.uniform(0, args.start_spread))  # each agent's first turn starts at its own moment
    while loop.time() < deadline:
        try:
            async with TTSClient.connect(args.url, api_key=args.api_key, sample_rate=args.sample_rate) as tts:
                while loop.time() < deadline:
                    text = rng.choice(replies)
                    record = Record(sessions, index, args.workload, len(text),
                                    started_s=round(loop.time() - level_start, 3))
                    records.append(record)
                    try:
                        heard_at = await _speak(tts, text, record, rng, args.tokens_per_second, deadline)
                    except GatewayError as error:
                        if error.context_id is None:
                            break  # the session is gone: reconnect
                    if args.turn_gap is not None and record.outcome == "done":
                        # The listener hears the reply out, then the user speaks.
                        pause = max(0.0, (heard_at or 0.0) - time.perf_counter()) + rng.uniform(*args.turn_gap)
                        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        except (GatewayError, OSError, TimeoutError) as error:  # refused or unreachable
            records.append(Record(sessions, index, args.workload, 0, "error",
                                  getattr(error, "code", None) or "connect_failed"))
            await asyncio.sleep(0.5)
        except Exception as error:  # e.g. websockets.InvalidStatus (401)
            records.append(Record(sessions, index, args.workload, 0, "error", type(error).__name__))
            await asyncio.sleep(0.5)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)  # linear interpolation between closest ranks
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return round(ordered[low] + (ordered[high] - ordered[low]) * (rank - low), 1)


# Bins of stalls by the reply's audio before them (seconds). With the GPU engine's 10-token
# first chunk (0.4 s) and hops of 1, 2, 4 and 8 s, the bins are about its 2nd, 3rd, 4th, 5th
# and later chunks.
STALL_AUDIO_BINS_S = (0.5, 1.5, 3.5, 7.5)


def stalls_by_audio_s(records: list[Record]) -> dict[str, int]:
    """Stalls counted by how much of its reply the listener had received before each."""
    edges = (0.0, *STALL_AUDIO_BINS_S)
    labels = [f"{low:g}-{high:g}" for low, high in zip(edges, edges[1:])] + [f"{edges[-1]:g}+"]
    counts = dict.fromkeys(labels, 0)
    for record in records:
        for audio_ms in record.stall_audio_ms:
            counts[labels[sum(audio_ms / 1000 >= edge for edge in STALL_AUDIO_BINS_S)]] += 1
    return counts


SLACK_CHUNKS = 4  # slack_ms_by_chunk: chunks 2, 3 and 4 each, then 5 and later together


def slack_ms_by_chunk(records: list[Record]) -> dict[str, dict]:
    """The audio still buffered when each chunk arrived (``Record.slack_ms``), by the chunk's
    place in its reply: p5 and p50 in ms, and how many chunks."""
    by_chunk: dict[str, list[float]] = {}
    for record in records:
        for index, slack in enumerate(record.slack_ms, start=2):
            key = str(index) if index <= SLACK_CHUNKS else f"{SLACK_CHUNKS + 1}+"
            by_chunk.setdefault(key, []).append(slack)
    return {key: {"p5": _percentile(values, 5), "p50": _percentile(values, 50), "n": len(values)}
            for key, values in sorted(by_chunk.items())}


def summarize(records: list[Record]) -> dict:
    spoken = [r for r in records if r.ttfa_ms is not None]
    ttfa = [r.ttfa_ms for r in spoken]
    rtf = [r.rtf for r in records if r.rtf is not None]
    errors: dict[str, int] = {}
    for r in records:
        if r.outcome == "error":
            errors[r.error_code or "unknown"] = errors.get(r.error_code or "unknown", 0) + 1
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    return {
        "contexts": len(records),
        "outcomes": outcomes,
        "ttfa_ms": {"p50": _percentile(ttfa, 50), "p95": _percentile(ttfa, 95), "p99": _percentile(ttfa, 99),
                    "n": len(ttfa)},
        "stall_free_fraction": round(sum(r.stalls == 0 for r in spoken) / len(spoken), 3) if spoken else None,
        "stalls": sum(r.stalls for r in records),
        "stall_ms": round(sum(r.stall_ms for r in records), 1),
        "stalls_by_audio_s": stalls_by_audio_s(records),
        "slack_ms_by_chunk": slack_ms_by_chunk(records),
        "rtf_p50": None if not rtf else round(sorted(rtf)[len(rtf) // 2], 3),
        "audio_s": round(sum(r.audio_ms for r in records) / 1000, 2),
        "errors": sum(errors.values()),
        "errors_by_code": errors,
    }


def stall_free(summary: dict, ttfa_p95_ms: float) -> bool:
    p95 = summary["ttfa_ms"]["p95"]
    return summary["stalls"] == 0 and summary["errors"] == 0 and p95 is not None and p95 < ttfa_p95_ms


async def run(url: str, *, sessions: int = 1, workload: str = "llm", duration: float = 15.0,
              tokens_per_second: float = 30.0, api_key: str | None = None, sample_rate: int | None = 24000,
              lang: str = "en", seed: int = 0, ramp: list[int] | None = None, ttfa_p95_ms: float = 500.0,
              corpus: Path | None = None, json_path: Path | None = None, plots: Path | None = None,
              markdown: Path | None = None, start_spread: float = DEFAULT_START_SPREAD_S,
              turn_gap: tuple[float, float] | None = DEFAULT_TURN_GAP_S) -> dict:
    """Run the benchmark (one level, or each ``ramp`` level in turn) and return the result.

    ``start_spread``: each agent starts its first turn at a seeded moment within this many
    seconds of the level's start. The default starts them all at once (a burst of new turns);
    a spread of several seconds staggers them, as sessions arriving over time would be.
    ``turn_gap``: (min, max) seconds of the user's turn after a reply has been heard out;
    None sends the next reply as soon as the last is done (back to back)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}")
    check_start_spread(start_spread, duration)
    if turn_gap is not None:
        turn_gap = check_turn_gap(turn_gap)
    args = argparse.Namespace(url=url, workload=workload, tokens_per_second=tokens_per_second, api_key=api_key,
                              sample_rate=sample_rate, seed=seed, duration=duration, start_spread=start_spread,
                              turn_gap=turn_gap)
    replies = load_corpus(lang, corpus)
    loop = asyncio.get_running_loop()
    levels, records = [], []
    for level in ramp or [sessions]:
        level_records: list[Record] = []
        deadline = loop.time() + duration
        await asyncio.gather(*(_agent(i, level, args, replies, deadline, level_records) for i in range(level)))
        records += level_records
        levels.append({"sessions": level, "summary": summarize(level_records)})
    passing = [lv["sessions"] for lv in levels if stall_free(lv["summary"], ttfa_p95_ms)]
    result = {
        "config": {"url": url, "sessions": ramp or [sessions], "workload": workload, "duration_s": duration,
                   "tokens_per_second": tokens_per_second, "sample_rate": sample_rate, "lang": lang, "seed": seed,
                   "corpus": str(corpus) if corpus else f"bench/data ({lang})", "replies": len(replies),
                   "ttfa_p95_ms_limit": ttfa_p95_ms, "start_spread_s": start_spread,
                   "turn_gap_s": None if turn_gap is None else list(turn_gap)},
        "summary": levels[-1]["summary"],
        "levels": levels,
        "stall_free_capacity": max(passing) if passing else None,
        "records": [dataclasses.asdict(r) for r in records],
    }
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    if markdown:
        Path(markdown).write_text(markdown_table(result))
    if plots:
        write_plots(result, Path(plots))
    return result


def markdown_table(result: dict) -> str:
    cfg = result["config"]
    rate = f" at {cfg['tokens_per_second']:g} tokens/s" if cfg["workload"] not in WHOLE_REPLY_WORKLOADS else ""
    lines = [
        f"Workload `{cfg['workload']}`{rate}, {cfg['duration_s']:g} s per level, corpus {cfg['corpus']}.",
        "",
        "| sessions | contexts | TTFA p50 ms | TTFA p95 ms | TTFA p99 ms | stall-free | stalls | stall ms "
        "| RTF p50 | audio s | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level in result["levels"]:
        s = level["summary"]
        t = s["ttfa_ms"]
        free = "–" if s["stall_free_fraction"] is None else f"{s['stall_free_fraction']:.0%}"
        lines.append(f"| {level['sessions']} | {s['contexts']} | {t['p50']} | {t['p95']} | {t['p99']} | {free} "
                     f"| {s['stalls']} | {s['stall_ms']} | {s['rtf_p50']} | {s['audio_s']} | {s['errors']} |")
    capacity = result["stall_free_capacity"]
    lines += ["", f"Stall-free capacity (no stalls, no errors, TTFA p95 < {cfg['ttfa_p95_ms_limit']:g} ms): "
              + (f"{capacity} sessions." if capacity else "none of the levels run."), ""]
    return "\n".join(lines)


def write_plots(result: dict, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    levels = [lv["sessions"] for lv in result["levels"]]
    workload = result["config"]["workload"]
    ttfa = [[r["ttfa_ms"] for r in result["records"] if r["sessions"] == n and r["ttfa_ms"] is not None]
            for n in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.boxplot([values or [float("nan")] for values in ttfa])
    ax.set_xticks(range(1, len(levels) + 1), [str(n) for n in levels])
    ax.set(xlabel="concurrent sessions", ylabel="TTFA (ms, client)", title=f"TTFA per concurrency ({workload})")
    fig.tight_layout()
    paths = [directory / f"ttfa_{workload}.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    fractions = [lv["summary"]["stall_free_fraction"] for lv in result["levels"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(levels, [f if f is not None else float("nan") for f in fractions], marker="o")
    ax.set(xlabel="concurrent sessions", ylabel="stall-free contexts (fraction)", ylim=(0, 1.05),
           title=f"Stall-free fraction vs concurrency ({workload})")
    fig.tight_layout()
    paths.append(directory / f"stall_free_{workload}.png")
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tts-gateway bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True,
                        help=f"the gateway's WebSocket URL, e.g. ws://127.0.0.1:8765{STREAM_PATH}")
    parser.add_argument("--sessions", type=int, default=1, help="concurrent agents (one session each)")
    parser.add_argument("--workload", choices=WORKLOADS, default="llm")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per concurrency level")
    parser.add_argument("--json", type=Path, help="write config, per-context records and summary here")
    parser.add_argument("--tokens-per-second", type=float, default=30.0, help="delta rate of llm and barge-in")
    parser.add_argument("--api-key")
    parser.add_argument("--sample-rate", type=int, default=24000,
                        help=f"Hz, one of {', '.join(map(str, SAMPLE_RATES))} (default: %(default)s)")
    parser.add_argument("--lang", choices=("en", "zh", "mix"), default="en", help="which corpus in bench/data")
    parser.add_argument("--corpus", type=Path, help="a replies file instead (one per line, \\n for line breaks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-spread", type=float, default=DEFAULT_START_SPREAD_S,
                        help="seconds over which the agents start their first turns (default: all at once)")
    parser.add_argument("--turn-gap", default=",".join(f"{s:g}" for s in DEFAULT_TURN_GAP_S),
                        help="MIN,MAX seconds of the user's turn after a reply has been heard out (default: %(default)s)")
    parser.add_argument("--back-to-back", action="store_true",
                        help="send the next reply as soon as the last is done (no listening, no user turn)")
    parser.add_argument("--ramp", help="concurrency levels to run in turn, e.g. 1,2,4,8 (overrides --sessions)")
    parser.add_argument("--ttfa-p95-ms", type=float, default=500.0, help="TTFA p95 limit for stall-free capacity")
    parser.add_argument("--plots", type=Path, help="write PNG charts into this directory (needs matplotlib)")
    parser.add_argument("--markdown", type=Path, help="write a Markdown table here")
    args = parser.parse_args(argv)
    ramp = [int(n) for n in args.ramp.split(",")] if args.ramp else None
    if any(n < 1 for n in ramp or [args.sessions]):
        parser.error("session counts must be >= 1")
    try:
        check_start_spread(args.start_spread, args.duration)
        turn_gap = None if args.back_to_back else parse_turn_gap(args.turn_gap)
    except ValueError as error:
        parser.error(str(error))
    coro = run(args.url, sessions=args.sessions, workload=args.workload, duration=args.duration,
               tokens_per_second=args.tokens_per_second, api_key=args.api_key, sample_rate=args.sample_rate,
               lang=args.lang, seed=args.seed, ramp=ramp, ttfa_p95_ms=args.ttfa_p95_ms, corpus=args.corpus,
               json_path=args.json, plots=args.plots, markdown=args.markdown, start_spread=args.start_spread,
               turn_gap=turn_gap)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(coro)
    else:
        result = uvloop.run(coro)
    print(markdown_table(result))
    return 0 if not any(lv["summary"]["errors"] for lv in result["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
