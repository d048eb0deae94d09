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
p95 under ``--ttfa-p95-ms``. This package uses only the public protocol
(tts_gateway.gateway.client); matplotlib (extra ``bench``) is needed for ``--plots`` only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from tts_gateway.gateway.loadgen.agents import (
    DEFAULT_START_SPREAD_S,
    DEFAULT_TURN_GAP_S,
    WHOLE_REPLY_WORKLOADS,
    WORKLOADS,
    Playback,
    Record,
    agent_rng,
    check_start_spread,
    check_turn_gap,
    parse_turn_gap,
    run_agent,
    turn_pause,
)
from tts_gateway.gateway.loadgen.corpus import LANGUAGES, load_corpus
from tts_gateway.gateway.loadgen.report import (
    markdown_table,
    ramp_result,
    slack_ms_by_chunk,
    stall_free,
    stalls_by_audio_s,
    summarize,
    write_plots,
)
from tts_gateway.gateway.wire import SAMPLE_RATES, STREAM_PATH

__all__ = [
    "DEFAULT_START_SPREAD_S",
    "DEFAULT_TURN_GAP_S",
    "WHOLE_REPLY_WORKLOADS",
    "WORKLOADS",
    "Playback",
    "Record",
    "agent_rng",
    "check_start_spread",
    "check_turn_gap",
    "load_corpus",
    "main",
    "markdown_table",
    "parse_turn_gap",
    "ramp_result",
    "run",
    "slack_ms_by_chunk",
    "stall_free",
    "stalls_by_audio_s",
    "summarize",
    "turn_pause",
    "write_plots",
]


async def run(url: str, *, sessions: int = 1, workload: str = "llm", duration: float = 15.0,
              tokens_per_second: float = 30.0, api_key: str | None = None, sample_rate: int | None = 24000,
              lang: str = "en", seed: int = 0, ramp: list[int] | None = None, ttfa_p95_ms: float = 500.0,
              corpus: Path | None = None, json_path: Path | None = None, plots: Path | None = None,
              markdown: Path | None = None, start_spread: float = DEFAULT_START_SPREAD_S,
              turn_gap: tuple[float, float] | None = DEFAULT_TURN_GAP_S, word_timings: bool = True) -> dict:
    """Run the benchmark (one level, or each ``ramp`` level in turn) and return the result.

    ``start_spread``: each agent starts its first turn at a seeded moment within this many
    seconds of the level's start. The default starts them all at once (a burst of new turns);
    a spread of several seconds staggers them, as sessions arriving over time would be.
    ``turn_gap``: (min, max) seconds of the user's turn after a reply has been heard out;
    None sends the next reply as soon as the last is done (back to back).
    ``word_timings``: False asks the gateway for no alignment frames."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}")
    check_start_spread(start_spread, duration)
    if turn_gap is not None:
        turn_gap = check_turn_gap(turn_gap)
    args = argparse.Namespace(url=url, workload=workload, tokens_per_second=tokens_per_second, api_key=api_key,
                              sample_rate=sample_rate, seed=seed, duration=duration, start_spread=start_spread,
                              turn_gap=turn_gap, word_timings=word_timings)
    replies = load_corpus(lang, corpus)
    loop = asyncio.get_running_loop()
    levels: list[tuple[int, list[Record]]] = []
    for level in ramp or [sessions]:
        level_records: list[Record] = []
        deadline = loop.time() + duration
        await asyncio.gather(*(run_agent(i, level, args, replies, deadline, level_records) for i in range(level)))
        levels.append((level, level_records))
    config = {"url": url, "sessions": ramp or [sessions], "workload": workload, "duration_s": duration,
              "tokens_per_second": tokens_per_second, "sample_rate": sample_rate, "lang": lang, "seed": seed,
              "corpus": str(corpus) if corpus else f"built-in ({lang})", "replies": len(replies),
              "ttfa_p95_ms_limit": ttfa_p95_ms, "start_spread_s": start_spread,
              "turn_gap_s": None if turn_gap is None else list(turn_gap), "word_timings": word_timings}
    result = ramp_result(config, levels, ttfa_p95_ms)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    if markdown:
        Path(markdown).write_text(markdown_table(result))
    if plots:
        write_plots(result, Path(plots))
    return result


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
    parser.add_argument("--lang", choices=LANGUAGES, default="en", help="which built-in corpus (mix: en and zh)")
    parser.add_argument("--corpus", type=Path, help="a replies file instead (one per line, \\n for line breaks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-spread", type=float, default=DEFAULT_START_SPREAD_S,
                        help="seconds over which the agents start their first turns (default: all at once)")
    parser.add_argument("--turn-gap", default=",".join(f"{s:g}" for s in DEFAULT_TURN_GAP_S),
                        help="MIN,MAX seconds of the user's turn after a reply has been heard out (default: %(default)s)")
    parser.add_argument("--back-to-back", action="store_true",
                        help="send the next reply as soon as the last is done (no listening, no user turn)")
    parser.add_argument("--no-word-timings", action="store_true", help="ask the gateway for no alignment frames")
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
               turn_gap=turn_gap, word_timings=not args.no_word_timings)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(coro)
    else:
        result = uvloop.run(coro)
    print(markdown_table(result))
    return 0 if not any(lv["summary"]["errors"] for lv in result["levels"]) else 1
