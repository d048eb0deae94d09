"""What CosyVoice2's word timings cost the event loop, per reply, on this machine's CPU.

Word timings are plain Python on the gateway's event loop: for each piece of agent text, the
spoken-word map and the text tokens' ends (``encode_with_ends`` in place of ``encode``); for each
LM round, two counters; for each audio chunk, the words it carries (engine/cosyvoice2/
alignment.py). None of it waits on the GPU. This replays the built-in corpus the way the load
generator sends it (4-character deltas), through the same objects the engine's utterance uses,
with and without word timings, and reports the difference: the most the timings can add to a
reply's first audio is what runs before its first chunk, which is bounded by the whole reply's.

    .venv/bin/python bench/word_timings_cost.py [--replies 200] [--json out.json]

The tokenizer is the official layout's (a tiny random checkpoint is written to a temporary
folder for it; the tokenizer is the same at every size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tts_gateway.engine.cosyvoice2.alignment import WordClock
from tts_gateway.engine.cosyvoice2.frontend.prompt import TextTokenizer
from tts_gateway.engine.cosyvoice2.modeldir.layout import TOKENIZER_DIR
from tts_gateway.engine.text.normalize import TextNormalizer
from tts_gateway.engine.text.spoken_words import SpokenWords
from tts_gateway.gateway.loadgen.agents import DELTA_CHARS
from tts_gateway.gateway.loadgen.corpus import load_corpus
from tts_gateway.testkit.checkpoint import make_checkpoint

SAMPLES_PER_TOKEN = 960  # 24 kHz audio, 25 speech tokens per second
SPEECH_PER_TEXT = 7.5  # gpu_check's speaking rate for random weights
ROUND_TEXT, ROUND_SPEECH = 5, 15  # bistream: text tokens, then speech tokens, per round
HOPS = (5, 50, 100, 200)  # the GPU config's chunks: a short first one, then growing


def replay(tokenizer: TextTokenizer, reply: str, timed: bool) -> float:
    """Seconds of event-loop work for one reply's text, LM rounds and chunks."""
    normalizer, spoken, clock = TextNormalizer("auto"), SpokenWords(), WordClock(SAMPLES_PER_TOKEN, SPEECH_PER_TEXT)
    deltas = [reply[i:i + DELTA_CHARS] for i in range(0, len(reply), DELTA_CHARS)]
    text_tokens = 0
    started = time.perf_counter()
    for k, delta in enumerate(deltas):
        text = normalizer.push(delta) + (normalizer.flush() if k == len(deltas) - 1 else "")
        spans = normalizer.take_spans()
        if not text:
            continue
        if timed:
            spoken.feed(text, spans)
            ids, ends = tokenizer.encode_with_ends(text)
            clock.add_text(text, ends, spoken.words_of(text))
        else:
            ids = tokenizer.encode(text)
        text_tokens += len(ids)
    speech_tokens = int(text_tokens * SPEECH_PER_TEXT)
    if timed:
        for read in range(ROUND_TEXT, text_tokens + ROUND_TEXT, ROUND_TEXT):
            clock.text_read(min(read, text_tokens))
            clock.speech(ROUND_SPEECH)
        clock.speech_ended()
        made, hop = 0, 0
        while made < speech_tokens:
            tokens = min(HOPS[min(hop, len(HOPS) - 1)], speech_tokens - made)
            made, hop = made + tokens, hop + 1
            clock.chunk(tokens * SAMPLES_PER_TOKEN, tokens / 25, made >= speech_tokens)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replies", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        make_checkpoint(Path(folder), "tiny")
        tokenizer = TextTokenizer(Path(folder) / TOKENIZER_DIR)
        corpus = load_corpus("en")
        replies = [corpus[i % len(corpus)] for i in range(args.replies)]
        for reply in replies[:20]:  # warm the normaliser's and tokenizer's caches
            replay(tokenizer, reply, True)
        timed = [replay(tokenizer, reply, True) for reply in replies]
        plain = [replay(tokenizer, reply, False) for reply in replies]
    extra_ms = [1000 * (a - b) for a, b in zip(timed, plain)]
    result = {
        "replies": len(replies), "mean_chars": round(statistics.mean(len(r) for r in replies)),
        "with_word_timings_ms_per_reply": round(1000 * statistics.mean(timed), 3),
        "without_ms_per_reply": round(1000 * statistics.mean(plain), 3),
        "extra_ms_per_reply": {"mean": round(statistics.mean(extra_ms), 3),
                               "max": round(max(extra_ms), 3)},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
