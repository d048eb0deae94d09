"""Stream a simulated LLM reply through the gateway and save the speech as a WAV file.

An LLM emits its reply a few characters at a time; this script imitates that by
cutting --text into ~4-character tokens (mid-word, like real tokenizers) and
sending them at --tokens-per-second while the audio streams back concurrently.

    python examples/simulated_llm_to_wav.py --url ws://127.0.0.1:8765/v1/stream \\
        --text "Hello! How can I help you today?" --tokens-per-second 30 -o out.wav

It prints the time to first audio as the agent sees it (first token sent ->
first audio received), the gateway's own measure, and the audio duration.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

# Run from a checkout without installing: make `gateway` importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI  # noqa: E402

from tts_gateway.gateway.client import GatewayError, TTSClient, write_wav  # noqa: E402

DEFAULT_TEXT = (
    "Sure! Streaming speech starts while the model is still writing, "
    "so the listener hears the first words almost at once."
)


def llm_tokens(text: str, size: int = 4) -> list[str]:
    """Cut ``text`` the way an LLM streams it: each word keeps its leading space,
    and words longer than ``size`` characters are split mid-word."""
    tokens = []
    for word in re.findall(r"\s*\S+", text):
        tokens.extend(word[i : i + size] for i in range(0, len(word), size))
    return tokens


async def paced(tokens: list[str], tokens_per_second: float) -> AsyncIterator[str]:
    """Yield ``tokens`` at a steady rate, as a model would produce them."""
    interval = 1.0 / tokens_per_second
    start = time.perf_counter()
    for i, token in enumerate(tokens):
        await asyncio.sleep(max(0.0, start + i * interval - time.perf_counter()))
        yield token


async def run(args: argparse.Namespace) -> None:
    async with TTSClient.connect(
        args.url, api_key=args.api_key, voice=args.voice, sample_rate=args.sample_rate
    ) as tts:
        # WAV holds 16-bit PCM, so ask for that whatever the session default is.
        reply = tts.context(encoding="pcm_s16le")
        tokens = llm_tokens(args.text)
        first_sent_at: float | None = None

        async def send_tokens() -> None:
            nonlocal first_sent_at
            async for token in paced(tokens, args.tokens_per_second):
                if first_sent_at is None:
                    first_sent_at = time.perf_counter()
                await reply.send_text(token)
            await reply.end()

        sender = asyncio.create_task(send_tokens())
        audio = bytearray()
        first_audio_at: float | None = None
        try:
            async for chunk in reply:
                if first_audio_at is None:
                    first_audio_at = time.perf_counter()
                audio += chunk.data
            await sender
        finally:
            sender.cancel()

    write_wav(args.output, bytes(audio), reply.sample_rate)
    duration_s = len(audio) / 2 / reply.sample_rate
    print(f"voice {reply.voice}, {reply.sample_rate} Hz, {len(tokens)} tokens at {args.tokens_per_second:g}/s")
    if first_audio_at is not None and first_sent_at is not None:
        ttfa_ms = (first_audio_at - first_sent_at) * 1000
        print(f"TTFA (client: first token sent -> first audio received): {ttfa_ms:.0f} ms")
    else:
        print("TTFA: no audio received")
    if reply.done is not None and reply.done.ttfa_ms is not None:
        print(f"TTFA (gateway: first text received -> first audio sent): {reply.done.ttfa_ms:.0f} ms")
    print(f"audio: {duration_s:.2f} s -> {args.output}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8765/v1/stream", help="gateway stream URL")
    parser.add_argument("--text", default=DEFAULT_TEXT, help="the reply the simulated LLM writes")
    parser.add_argument("--tokens-per-second", type=float, default=30.0, help="simulated LLM speed")
    parser.add_argument("-o", "--output", default="out.wav", help="WAV file to write")
    parser.add_argument("--api-key", help="API key, when the gateway requires one")
    parser.add_argument("--voice", help="voice id (default: the gateway's default voice)")
    parser.add_argument("--sample-rate", type=int, help="output sample rate in Hz (default: the gateway's)")
    args = parser.parse_args(argv)
    if args.tokens_per_second <= 0:
        parser.error("--tokens-per-second must be > 0")
    if not args.text.strip():
        parser.error("--text must not be empty")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(run(args))
    except InvalidStatus as exc:
        status = exc.response.status_code
        hint = " (wrong or missing --api-key)" if status == 401 else ""
        print(f"error: the gateway refused the connection: HTTP {status}{hint}", file=sys.stderr)
    except InvalidURI as exc:
        print(f"error: bad --url: {exc}", file=sys.stderr)
    except InvalidHandshake as exc:
        print(f"error: WebSocket handshake with {args.url} failed: {exc}", file=sys.stderr)
    except (OSError, TimeoutError) as exc:
        print(f"error: cannot reach the gateway at {args.url}: {exc}", file=sys.stderr)
    except GatewayError as exc:
        print(f"error: the gateway reported {exc.code}: {exc.message}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    else:
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
