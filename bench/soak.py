"""Soak test: mixed, partly hostile traffic against a Piper gateway for a long time, watching
for slow leaks.

It starts `tts-gateway serve` (Piper, CPU) on a free port, unless ``--url`` names a running
gateway (then ``--pid`` names its process), and keeps ``--workers`` clients busy for
``--duration`` seconds, each picking one scenario after another at random:

- conversation: a few replies streamed in deltas, each read to its ``done``;
- barge-in: a long reply cancelled at its first audio;
- disconnect: a long reply whose client vanishes (no close handshake) at its first audio;
- slow reader: a long reply never read (the gateway cuts the client off, or it gives up);
- hostile: bad JSON, huge unknown types, control characters, binary frames, unknown contexts.

After ``--warmup`` seconds of traffic (memory pools and caches filling up are not a leak),
every ``--interval`` seconds it samples the gateway's resident memory and open file
descriptors (/proc) and, from /metrics, its event loop's tasks, sessions, contexts and engine
work. The verdict, per series: **growth** when the median of the last third of the samples
exceeds the median of the first third by more than the series' allowance (a share of the
first third plus a constant, below), and **not drained** when, ``--settle`` seconds after the
traffic stops, sessions, contexts or engine utterances are not back to 0. Either exits 1.

    .venv/bin/python bench/soak.py                   # 1 minute's warm-up, then 30 minutes, 8 clients
    .venv/bin/python bench/soak.py --warmup 4 --duration 16 --interval 2 --workers 3 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
from websockets.asyncio.client import connect

from tts_gateway.gateway.wire import STREAM_PATH

ROOT = Path(__file__).resolve().parent.parent

# Allowed growth, last third's median over the first third's: (share of the first, constant).
ALLOWANCES = {
    "rss_mib": (0.10, 32.0),
    "open_fds": (0.10, 16.0),
    "loop_tasks": (0.10, 32.0),
    "engine_utterances": (0.0, 4.0),
    "engine_queue_depth": (0.0, 8.0),
}
# Gauges that must be back to 0 once the traffic has stopped.
MUST_DRAIN = ("sessions", "contexts", "engine_utterances")
METRICS = {
    "tts_event_loop_tasks": "loop_tasks",
    "tts_active_sessions": "sessions",
    "tts_active_contexts": "contexts",
    'tts_engine_utterances{engine="piper"}': "engine_utterances",
    'tts_engine_queue_depth{engine="piper"}': "engine_queue_depth",
}
LONG_REPLY = " ".join(
    ["The quarterly report covers revenue, costs, hiring and the roadmap for the next two releases."] * 6
)
REPLIES = [
    "Sure! The weather in Paris is sunny today, with a high of twenty-one degrees.",
    "Your order number 4521 ships on Tuesday; the total is $38.20.",
    "Let me check that for you. One moment, please.",
]
HOSTILE_FRAMES = [
    "{oops",
    orjson.dumps({"type": "x" * 60_000}).decode(),
    orjson.dumps({"type": "text", "text": "Hello \u0000 world."}).decode(),
    orjson.dumps({"type": "text", "context_id": "c" * 500, "text": "Hi"}).decode(),
    orjson.dumps({"type": "end", "context_id": "nobody"}).decode(),
    orjson.dumps({"type": "text", "text": "Hi", "voice": "v" * 10_000}).decode(),
    b"\x00\x01binary",
]


# ------------------------------------------------------------------ scenarios


async def read_until(ws, kinds: set[str], context_id: str | None = None) -> dict:
    while True:
        message = await ws.recv()
        if isinstance(message, str):
            frame = orjson.loads(message)
            if frame["type"] in kinds and (context_id is None or frame.get("context_id") == context_id):
                return frame


async def conversation(url: str, rng: random.Random) -> None:
    async with connect(url) as ws:
        await read_until(ws, {"ready"})
        for turn in range(rng.randint(1, 3)):
            text, context_id = rng.choice(REPLIES), f"r{turn}"
            # Audio is read while the text streams in, as an agent does.
            reading = asyncio.create_task(read_until(ws, {"done", "error"}, context_id))
            for i in range(0, len(text), 7):
                await ws.send(orjson.dumps({"type": "text", "context_id": context_id, "text": text[i : i + 7]}).decode())
                await asyncio.sleep(0.01)
            await ws.send(orjson.dumps({"type": "end", "context_id": context_id}).decode())
            await reading


async def barge_in(url: str, rng: random.Random) -> None:
    async with connect(url) as ws:
        await read_until(ws, {"ready"})
        await ws.send(orjson.dumps({"type": "text", "context_id": "long", "text": LONG_REPLY}).decode())
        await ws.send('{"type":"end","context_id":"long"}')
        await read_until(ws, {"audio"})
        await ws.send('{"type":"cancel","context_id":"long"}')
        await read_until(ws, {"cancelled", "done"}, "long")


async def disconnect(url: str, rng: random.Random) -> None:
    ws = await connect(url)
    await read_until(ws, {"ready"})
    await ws.send(orjson.dumps({"type": "text", "text": LONG_REPLY}).decode())
    await ws.send('{"type":"end"}')
    await read_until(ws, {"audio"})
    ws.transport.abort()


async def slow_reader(url: str, rng: random.Random) -> None:
    ws = await connect(url, max_queue=1)
    ws.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await ws.send(orjson.dumps({"type": "text", "text": LONG_REPLY}).decode())
    await ws.send('{"type":"end"}')
    await asyncio.sleep(rng.uniform(2.0, 5.0))  # reading nothing
    ws.transport.abort()


async def hostile(url: str, rng: random.Random) -> None:
    async with connect(url, max_queue=4) as ws:
        await read_until(ws, {"ready"})
        for _ in range(rng.randint(20, 200)):
            await ws.send(rng.choice(HOSTILE_FRAMES))


SCENARIOS = {
    "conversation": (conversation, 5),
    "barge_in": (barge_in, 2),
    "disconnect": (disconnect, 2),
    "slow_reader": (slow_reader, 1),
    "hostile": (hostile, 2),
}


async def client(url: str, seed: int, stop_at: float, counts: dict[str, dict]) -> None:
    """Run scenarios one after another until ``stop_at``; count each as ok or failed (a
    scenario that raises is counted, not fatal: a cut-off client is one of the outcomes),
    keeping the first few reasons for failing."""
    rng = random.Random(seed)
    names = list(SCENARIOS)
    weights = [SCENARIOS[name][1] for name in names]
    while time.monotonic() < stop_at:
        name = rng.choices(names, weights)[0]
        try:
            await asyncio.wait_for(SCENARIOS[name][0](url, rng), 60)
            counts[name]["ok"] += 1
        except Exception as exc:
            counts[name]["failed"] += 1
            if len(counts[name]["reasons"]) < 3:
                counts[name]["reasons"].append(repr(exc)[:200])
            await asyncio.sleep(0.1)


# ------------------------------------------------------------------ sampling


def scrape(http_base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{http_base}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in METRICS:
            values[METRICS[name]] = float(value)
    return values


def sample(http_base: str, pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return {
        "t": time.monotonic(),
        "rss_mib": rss_kib / 1024,
        "open_fds": float(len(os.listdir(f"/proc/{pid}/fd"))),
        **scrape(http_base),
    }


def verdict(samples: list[dict[str, float]], final: dict[str, float]) -> list[str]:
    """What went wrong (empty: nothing). See the module docstring for the rule."""
    problems = []
    third = max(1, len(samples) // 3)
    for series, (share, constant) in ALLOWANCES.items():
        first = statistics.median(s[series] for s in samples[:third])
        last = statistics.median(s[series] for s in samples[-third:])
        if last > first * (1 + share) + constant:
            problems.append(f"{series} grew: median {first:.1f} in the first third, {last:.1f} in the last")
    for series in MUST_DRAIN:
        if final.get(series, 0.0) != 0.0:
            problems.append(f"{series} is {final[series]:g} after the traffic stopped (expected 0)")
    return problems


# ------------------------------------------------------------------ the gateway under test


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def piper_gateway(send_buffer_bytes: int):
    """`tts-gateway serve` on the Piper voice, on free ports; yields (ws base, http base, pid)."""
    port = free_port()
    env = os.environ | {
        "TTS_GATEWAY__ENGINE__NAME": "piper",
        "TTS_GATEWAY__LIMITS__SEND_BUFFER_BYTES": str(send_buffer_bytes),
        "TTS_GATEWAY__SERVER__LOG_LEVEL": "warning",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "tts_gateway.gateway", "serve", "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT, env=env
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {process.returncode} while starting")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{base}/readyz", timeout=2) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not become ready within 120 s")
            time.sleep(0.5)
        yield f"ws://127.0.0.1:{port}", base, process.pid
    finally:
        process.terminate()
        process.wait(30)


# ------------------------------------------------------------------ main


async def soak(ws_base: str, http_base: str, pid: int, args: argparse.Namespace) -> dict:
    url = f"{ws_base}{STREAM_PATH}"
    counts = {name: {"ok": 0, "failed": 0, "reasons": []} for name in SCENARIOS}
    loop = asyncio.get_running_loop()
    stop_at = time.monotonic() + args.warmup + args.duration
    clients = [asyncio.create_task(client(url, args.seed + i, stop_at, counts)) for i in range(args.workers)]
    await asyncio.sleep(args.warmup)
    samples = []
    while time.monotonic() < stop_at:
        await asyncio.sleep(min(args.interval, max(0.0, stop_at - time.monotonic())))
        samples.append(await loop.run_in_executor(None, sample, http_base, pid))
    await asyncio.gather(*clients)
    await asyncio.sleep(args.settle)
    final = await loop.run_in_executor(None, sample, http_base, pid)
    problems = verdict(samples, final)
    return {
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "workers": args.workers,
        "scenarios": counts,
        "samples": samples,
        "final": final,
        "problems": problems,
        "passed": not problems,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic (default 30 minutes)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of traffic before the first sample")
    parser.add_argument("--workers", type=int, default=8, help="concurrent clients")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after the traffic before the drain check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--send-buffer-bytes", type=int, default=1_048_576,
                        help="the started gateway's send buffer (small, so that slow readers are cut off)")
    parser.add_argument("--url", help="a running gateway's ws://HOST:PORT (default: start one)")
    parser.add_argument("--pid", type=int, help="with --url: the gateway's process id, for memory and descriptors")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.interval <= 0 or args.warmup < 0 or args.workers < 1:
        parser.error("--duration and --interval must be > 0, --warmup >= 0, --workers >= 1")
    if (args.url is None) != (args.pid is None):
        parser.error("--url and --pid go together")
    if args.duration < 3 * args.interval:
        parser.error("--duration must hold at least three --interval samples")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url is not None:
        report = asyncio.run(soak(args.url, args.url.replace("ws", "http", 1), args.pid, args))
    else:
        with piper_gateway(args.send_buffer_bytes) as (ws_base, http_base, pid):
            report = asyncio.run(soak(ws_base, http_base, pid, args))
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.write_text(text)
    summary = {key: report[key] for key in ("scenarios", "final", "problems", "passed")}
    print(json.dumps(summary, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
