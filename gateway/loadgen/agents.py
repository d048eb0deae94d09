"""The simulated agents: each holds one session and speaks reply after reply, timing what
its listener would hear (see the package docstring for the workloads and the measures)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass

from tts_gateway.gateway.client import GatewayError, TTSClient

WORKLOADS = ("full", "llm", "barge-in", "full-barge-in")
WHOLE_REPLY_WORKLOADS = ("full", "full-barge-in")  # the reply in one text frame; the others stream deltas
DELTA_CHARS = 4
BARGE_IN_AFTER_S = (0.2, 2.0)  # cancel this long after first audio (uniform, seeded)

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


def agent_rng(seed: int, sessions: int, index: int) -> random.Random:
    """The agent's own seeded draws: its start, its replies, its users' turns, its barge-ins.
    Agents driven some other way (bench/official_baseline.py's threads) draw the same."""
    return random.Random(f"{seed}-{sessions}-{index}")


def turn_pause(heard_at: float | None, now: float, rng: random.Random, turn_gap: tuple[float, float]) -> float:
    """Seconds from ``now`` (``time.perf_counter``) to the next reply after a done one: the
    listener hears the reply out (``heard_at``: when its audio runs out, None without audio),
    then the user speaks for a seeded draw within ``turn_gap``."""
    return max(0.0, (heard_at or 0.0) - now) + rng.uniform(*turn_gap)


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
    words: int = 0  # word timings received (alignment frames' words)


class Playback:
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

    playback = Playback()

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
        record.words = len(ctx.alignments)
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


async def run_agent(index: int, sessions: int, args: argparse.Namespace, replies: list[str], deadline: float,
                    records: list[Record]) -> None:
    """One agent until ``deadline``: its contexts' records go to ``records``; a lost session is
    reconnected, a refused or unreachable one is recorded as an error and retried."""
    loop = asyncio.get_running_loop()
    rng = agent_rng(args.seed, sessions, index)
    level_start = deadline - args.duration
    await asyncio.sleep(rng.uniform(0, args.start_spread))  # each agent's first turn starts at its own moment
    while loop.time() < deadline:
        try:
            async with TTSClient.connect(args.url, api_key=args.api_key, sample_rate=args.sample_rate,
                                         word_timings=None if args.word_timings else False) as tts:
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
                        pause = turn_pause(heard_at, time.perf_counter(), rng, args.turn_gap)
                        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        except (GatewayError, OSError, TimeoutError) as error:  # refused or unreachable
            records.append(Record(sessions, index, args.workload, 0, "error",
                                  getattr(error, "code", None) or "connect_failed"))
            await asyncio.sleep(0.5)
        except Exception as error:  # e.g. websockets.InvalidStatus (401)
            records.append(Record(sessions, index, args.workload, 0, "error", type(error).__name__))
            await asyncio.sleep(0.5)
