"""Time to first audio for one-sentence contexts, measured as an agent sees it.

Each run opens a context, sends the whole sentence in one `text` frame plus `end`,
and times first text byte sent -> first audio byte received (client side); the
gateway's own figure (`done.ttfa_ms`) is reported beside it. Runs are sequential,
so this is latency on an otherwise idle gateway.

    python bench/ttfa.py                        # starts an in-process gateway (config.toml + env)
    python bench/ttfa.py --url ws://HOST:PORT/v1/stream --runs 100 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tts_gateway.gateway.client import TTSClient  # noqa: E402
from tts_gateway.gateway.wire import STREAM_PATH  # noqa: E402

SENTENCES = [
    "Hello there! The total is $3.50, due May 5th.",
    "Sure, I can help with that.",
    "Your order shipped this morning and should arrive on Friday.",
    "The meeting moved to 3:30 PM in room 12.",
]


async def measure(url: str, runs: int, warmup: int) -> dict:
    client_ms, server_ms = [], []
    async with TTSClient.connect(url) as tts:
        for i in range(warmup + runs):
            context = tts.context()
            started = time.perf_counter()
            await context.send_text(SENTENCES[i % len(SENTENCES)])
            await context.end()
            first = None
            async for _chunk in context:
                if first is None:
                    first = time.perf_counter()
            if i >= warmup:
                client_ms.append((first - started) * 1000)
                server_ms.append(context.done.ttfa_ms)
    return {"runs": runs, "client_ttfa_ms": summary(client_ms), "server_ttfa_ms": summary(server_ms)}


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 1),
        "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 1),
        "min": round(ordered[0], 1),
        "max": round(ordered[-1], 1),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running gateway; default: start one in-process")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    gateway = None
    url = args.url
    if url is None:
        import dataclasses

        from tts_gateway.engine.registry import create_engine
        from tts_gateway.gateway.config import load_config
        from tts_gateway.gateway.server import Gateway

        config = load_config("config.toml" if Path("config.toml").is_file() else None)
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, port=0))
        gateway = Gateway(config, create_engine(config.engine.name, config.engine.selected))
        await gateway.start()
        url = f"ws://127.0.0.1:{gateway.port}{STREAM_PATH}"
    try:
        result = await measure(url, args.runs, args.warmup)
    finally:
        if gateway is not None:
            await gateway.stop()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
