"""How fast the LLM stage alone makes the first chunks of N turns begun at once.

In a 64-session opening burst the gateway's first audio waits ~300 ms for the LLM's first-chunk
tokens while token2wav has nothing to do yet (docs/benchmarks.md, fifteenth round). This times
the LLM stage on vLLM by itself, as the gateway drives it (``bistream``): each turn a streaming
request of the voice prompt and its whole reply text at once, fed in bistream rounds (5 text
tokens, then up to 15 speech tokens; the next round is given to vLLM once the last has ended).
``offline`` decodes the same turns in one round each, the whole text first: the same tokens' pace
without round boundaries. Per level of N turns and mode, over its turns (ms from opening the
turn, p50 / p95):

- ``token_13_ms`` / ``token_38_ms``: when the turn had the tokens of a short first chunk (10 +
  3 look-ahead after a 90-token prompt) and of the official one (35 + 3);
- ``gap_in_round_ms`` / ``gap_at_round_ms``: the time between two arrivals of tokens inside a
  round, and from a round's last tokens to the next round's first. The latter holds the step of
  the token that ends the round (never handed out), the wait for the next round's input, and its
  prefill: what a round boundary costs against a step;
- ``steps_per_s``, ``tokens_per_step``: vLLM's engine steps while the level ran.

Random weights never sample eos, so every turn runs to ``--tokens`` and is then cancelled.

``--async-scheduling`` starts vLLM with its pipelined scheduling (the ``async_scheduling``
setting, which the engine refuses: on vLLM 0.26 a bistream round then returned a token past its
stop, docs/cosyvoice2.md), for ``offline`` levels only, whose requests take one input: what a
step costs when vLLM prepares the next while the GPU runs this one. Each level is then warmed up
by one untimed offline level, not by the stage's bistream warm-up.

    python3 bench/llm_burst.py --turns 1,16,64 --modes bistream,offline --json llm_burst.json
    python3 bench/llm_burst.py --turns 1,16,64 --modes offline --async-scheduling --json llm_burst_async.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tts_gateway.gateway.loadgen.report import p50_p95  # noqa: E402

# Speech tokens of the two first chunks, look-ahead included (a 90-token voice prompt).
MARKS = (13, 38)
MODES = ("bistream", "offline")


@dataclass
class TurnTimes:
    """One turn's token arrivals: (seconds since the turn was opened, tokens so far), and the
    cumulative token counts at which its rounds ended."""

    arrivals: list[tuple[float, int]] = field(default_factory=list)
    round_ends: list[int] = field(default_factory=list)

    def reached(self, tokens: int) -> float | None:
        """When the turn had ``tokens`` tokens (None: never)."""
        return next((t for t, count in self.arrivals if count >= tokens), None)

    def gaps(self) -> tuple[list[float], list[float]]:
        """The gaps between consecutive arrivals: inside a round, and across a round's end."""
        inside, across = [], []
        for (t0, count0), (t1, _) in zip(self.arrivals, self.arrivals[1:]):
            (across if count0 in self.round_ends else inside).append(t1 - t0)
        return inside, across


def summarize(turns: list[TurnTimes], steps: float, tokens: float, seconds: float) -> dict:
    """A level's report (the module's docstring says what each figure is)."""
    def ms(values: list[float]) -> dict | None:
        return p50_p95([1000 * v for v in values])

    inside = [gap for turn in turns for gap in turn.gaps()[0]]
    across = [gap for turn in turns for gap in turn.gaps()[1]]
    report = {"turns": len(turns), "first_token_ms": ms([t for turn in turns if (t := turn.reached(1)) is not None])}
    for mark in MARKS:
        report[f"token_{mark}_ms"] = ms([t for turn in turns if (t := turn.reached(mark)) is not None])
    report.update({
        "gap_in_round_ms": ms(inside),
        "gap_at_round_ms": ms(across),
        "steps_per_s": round(steps / seconds, 1) if seconds > 0 else None,
        "tokens_per_step": round(tokens / steps, 1) if steps else None,
    })
    return report


async def run_level(stage, turns: int, prompt_text: list[int], prompt_speech: list[int], text: list[int],
                    tokens: int, mode: str = "bistream") -> dict:
    """``turns`` turns opened at once, each until it has ``tokens`` speech tokens (``MODES``)."""
    from tts_gateway.engine.cosyvoice2.serving.lm.planner import offline_chunk

    times = [TurnTimes() for _ in range(turns)]
    finished = [asyncio.Event() for _ in range(turns)]
    errors: list[BaseException] = []
    counters = stage.counters
    steps, generated = counters.steps, counters.generated_tokens
    started = time.perf_counter()

    def on_tokens(i: int):
        def record(new: list[int]) -> None:
            count = (times[i].arrivals[-1][1] if times[i].arrivals else 0) + len(new)
            times[i].arrivals.append((time.perf_counter() - started, count))
            if count >= tokens:
                finished[i].set()
        return record

    def on_done(i: int):
        def done(error: BaseException | None) -> None:
            if error is not None:
                errors.append(error)
            finished[i].set()
        return done

    async def offline(i: int) -> None:  # one round: no round ends to mark
        chunk = offline_chunk(stage.vocab, text, prompt_text, prompt_speech)
        error = None
        try:
            await stage.run_rounds([chunk], on_tokens=on_tokens(i))
        except Exception as exc:  # reported as the bistream turns' failures are
            error = exc
        on_done(i)(error)

    if mode not in MODES:
        raise ValueError(f"mode is one of {', '.join(MODES)}, not {mode!r}")
    streams, tasks = [], []
    for i in range(turns):
        if mode == "offline":
            tasks.append(asyncio.create_task(offline(i)))
            continue
        stream = stage.open(prompt_text, prompt_speech, on_tokens(i), on_done(i))
        stream.push_text_ids(text)
        stream.end_text()
        streams.append(stream)
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in finished)), timeout=120)
    seconds = time.perf_counter() - started
    for i, stream in enumerate(streams):
        ends, total = [], 0
        for tracker in stream.rounds:
            total += len(tracker.emitted)
            ends.append(total)
        times[i].round_ends = ends
        stream.cancel()
    for task in tasks:  # cancelling aborts the turn's vLLM request
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if errors:
        raise RuntimeError(f"{len(errors)} turns failed: {errors[0]}")
    return {"mode": mode, **summarize(times, counters.steps - steps, counters.generated_tokens - generated, seconds)}


async def main(args) -> dict:
    from tts_gateway.engine.cosyvoice2.serving import startup
    from tts_gateway.engine.cosyvoice2.settings import CosyVoice2Settings, VLLMSettings
    from tts_gateway.testkit.checkpoint import make_checkpoint

    if not (args.model_dir / "README.md").is_file():  # make_checkpoint writes README.md last
        make_checkpoint(args.model_dir, "full", 0)
    largest = max(args.turns)
    vllm = VLLMSettings(
        gpu_memory_utilization=args.gpu_memory_utilization,
        # The stage's warm-up runs bistream rounds, which pipelined scheduling cannot serve
        # (docs/cosyvoice2.md): with it on, each level is warmed up below by one-input turns.
        warmup_batch_sizes=() if args.async_scheduling else tuple(
            n for n in VLLMSettings.warmup_batch_sizes if n <= largest),
        async_scheduling=args.async_scheduling,
    )
    settings = CosyVoice2Settings(model_dir=str(args.model_dir), llm_backend="vllm", vllm=vllm)
    started = time.perf_counter()
    stage = await startup.start_vllm_stage(settings)
    report = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "start_s": round(time.perf_counter() - started, 1), "levels": []}
    try:
        stage.max_speech_per_text_token = 20.0
        vocab = stage.vocab
        rng = random.Random(0)
        prompt_text = [rng.randrange(vocab.text_vocab_size) for _ in range(args.prompt_text)]
        prompt_speech = [rng.randrange(vocab.speech_token_size) for _ in range(args.prompt_speech)]
        text = [rng.randrange(vocab.text_vocab_size) for _ in range(args.text_tokens)]
        for turns in args.turns:
            if args.async_scheduling:  # untimed: vLLM's first steps of a batch shape may compile
                await run_level(stage, turns, prompt_text, prompt_speech, text, args.tokens, "offline")
            for repeat in range(args.repeats):
                for mode in args.modes:
                    level = await run_level(stage, turns, prompt_text, prompt_speech, text, args.tokens, mode)
                    level["repeat"] = repeat
                    report["levels"].append(level)
                    print(json.dumps(level), flush=True)
                    await asyncio.sleep(0.5)
    finally:
        await stage.close()
    return report


def modes(value: str) -> list[str]:
    chosen = value.split(",")
    if any(mode not in MODES for mode in chosen):
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}, comma-separated: {value!r}")
    return chosen


def turn_counts(value: str) -> list[int]:
    try:
        counts = [int(n) for n in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"turn counts are integers, comma-separated: {value!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"turn counts are at least 1: {value!r}")
    return counts


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/cv2-full"),
                        help="an official-layout model directory (a full-size random one is made there if missing)")
    parser.add_argument("--turns", type=turn_counts, default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", type=modes, default=list(MODES), help="bistream (as the gateway), offline")
    parser.add_argument("--tokens", type=int, default=60, help="speech tokens each turn runs to")
    parser.add_argument("--prompt-text", type=int, default=12, help="text tokens of the voice prompt")
    parser.add_argument("--prompt-speech", type=int, default=90, help="speech tokens of the voice prompt")
    parser.add_argument("--text-tokens", type=int, default=40, help="text tokens of each reply")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="vLLM's pipelined scheduling (offline levels only)")
    parser.add_argument("--json", type=Path)
    return parser


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argument_parser()
    args = parser.parse_args(argv)
    if args.async_scheduling and args.modes != ["offline"]:
        parser.error("--async-scheduling runs offline levels only: pass --modes offline")
    return args


if __name__ == "__main__":
    arguments = parse_arguments()
    result = asyncio.run(main(arguments))
    if arguments.json:
        arguments.json.write_text(json.dumps(result, indent=1))
