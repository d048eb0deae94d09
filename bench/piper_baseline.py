"""In-process baseline: the load generator's corpus spoken by direct PiperEngine calls (no gateway,
no socket).

For each reply: open an utterance, push the whole text, end input, and time
push -> first chunk (the engine's TTFA) and push -> last chunk over the audio
length (RTF). Replies run one after another, like `tts-gateway bench
--sessions 1 --workload full`, so the gateway's overhead on the CPU path is
gateway TTFA - direct TTFA. Prints JSON.

    .venv/bin/python bench/piper_baseline.py [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tts_gateway.engine.base import AudioChunk, UtteranceOptions, drive  # noqa: E402
from tts_gateway.engine.piper.engine import PiperEngine  # noqa: E402
from tts_gateway.gateway.config import load_config  # noqa: E402
from tts_gateway.gateway.loadgen import load_corpus  # noqa: E402


async def measure(replies: list[str], rounds: int) -> dict:
    config = load_config(ROOT / "config.toml" if (ROOT / "config.toml").is_file() else None)
    engine = PiperEngine(config.engine.piper)  # the settings the gateway runs with
    await engine.start()
    rows = []
    try:
        for _ in range(rounds):
            for text in replies:
                rows.append(await speak_timed(engine, text))
    finally:
        await engine.close()
    ttfa = sorted(r["ttfa_ms"] for r in rows)
    return {
        "engine": "piper (in-process)",
        "replies": len(replies),
        "rounds": rounds,
        "summary": {
            "ttfa_ms": {"p50": round(statistics.median(ttfa), 1), "p95": ttfa[min(len(ttfa) - 1, int(0.95 * len(ttfa)))],
                        "min": ttfa[0], "max": ttfa[-1]},
            "rtf_p50": round(statistics.median(r["rtf"] for r in rows), 3),
            "audio_s": round(sum(r["audio_s"] for r in rows), 2),
        },
        "per_reply": rows,
    }


async def speak_timed(engine: PiperEngine, text: str) -> dict:
    """One reply, the whole text at once: push -> first chunk (TTFA), push -> last chunk over
    the audio length (RTF)."""
    arrivals: list[tuple[float, int]] = []  # (perf_counter time, samples) per chunk

    async def note(chunk: AudioChunk) -> None:
        arrivals.append((time.perf_counter(), len(chunk.samples)))

    utterance = engine.open_utterance(UtteranceOptions(voice=engine.default_voice))
    started = time.perf_counter()
    await drive(utterance, note, text=text)
    wall = time.perf_counter() - started
    audio_s = sum(samples for _, samples in arrivals) / engine.sample_rate
    return {"chars": len(text), "ttfa_ms": round((arrivals[0][0] - started) * 1000, 1),
            "audio_s": round(audio_s, 2), "rtf": round(wall / audio_s, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, help="replies file (default: the load generator's English replies)")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the corpus")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = asyncio.run(measure(load_corpus("en", args.corpus), args.rounds))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
