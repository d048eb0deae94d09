"""Greedy speech tokens through vLLM equal the plain-torch backend's, offline and in bistream.

Runs on a GPU with vLLM installed (bench/gpu_check.sh calls it). Both sides load the same
``llm.pt`` in float32; vLLM serves the converted directory through the product's own
stage (:class:`tts_gateway.engine.cosyvoice2.serving.lm.vllm_stage.VLLMLMStage`), so this checks the converter, the
model, the logits processor and the streaming-input driver end to end.

Both sides mask a suppressed eos (a greedy redraw would repeat) and bound the final round
at 20 speech tokens per text token, which random weights reach, since they rarely pick eos.

Two measures: the token streams are equal (expected with ``--dtype float32``), and every
greedy choice vLLM made, replayed through the float32 model, is its argmax or within
``--margin`` logits of it (:func:`teacher_forced_margins`; the measure for bf16, where a
near-tie may go either way and the streams then part).

    python3 bench/vllm_equality.py --model-dir DIR --json OUT.json [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tts_gateway.engine.cosyvoice2.model.llm import CosyVoice2LM  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.lm.torch_stage import TorchLMBackend  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.lm.stage import MAX_SPEECH_PER_TEXT_TOKEN  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.lm.vllm_stage import VLLMLMStage  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.lm.sampling import greedy_sampling  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.lm.vllm_convert import convert  # noqa: E402
from tts_gateway.engine.cosyvoice2.serving.lm.vllm_rounds import RoundTracker, round_request  # noqa: E402
from tts_gateway.engine.cosyvoice2.modeldir.reading import load_model_configs  # noqa: E402
from tts_gateway.engine.cosyvoice2.settings import VLLMSettings  # noqa: E402


def teacher_forced_margins(model: CosyVoice2LM, rounds: list[RoundTracker]) -> list[float]:
    """Replays what vLLM decoded through ``model`` and scores each greedy choice.

    The context is rebuilt as vLLM held it: each round's ids, then its emitted tokens; a
    round that ended before its budget ended on fill, which is scored too and not kept.
    For every choice: (the best logit the round allowed) - (the chosen class's logit).
    0 means the model's own argmax; a small positive value a near-tie that a lower
    precision may break either way. This checks a bf16 vLLM against the float32 model.
    """
    vocab = model.vocab
    backend = TorchLMBackend(model)
    backend.reset()
    pending: list[int] = []
    margins: list[float] = []
    for tracker in rounds:
        chunk = tracker.chunk
        # The replayed steps are all before the round's limit, so the limit is the tokens it emitted.
        rule = round_request(chunk, vocab, None, [], len(tracker.emitted), len(tracker.emitted) + 1).rule
        pending += list(chunk.ids)
        choices = list(tracker.emitted)
        if not chunk.final and chunk.max_tokens is not None and len(choices) < chunk.max_tokens:
            choices.append(vocab.fill_class)
        for step, choice in enumerate(choices):
            logits = backend.append(pending).float()
            pending = []
            allowed = torch.zeros_like(logits, dtype=torch.bool)
            allowed[: vocab.speech_token_size] = True
            for unified in rule.allowed_specials(step):
                allowed[vocab.speech_class(unified)] = True
            best = logits.masked_fill(~allowed, float("-inf")).max()
            margins.append(float(best - logits[choice]))
            if step < len(tracker.emitted):
                pending = [vocab.speech(choice)]
    return margins


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def bistream_on(stage: VLLMLMStage, text, prompt_text, prompt_speech, trace: list) -> list[int]:
    tokens: list[int] = []
    done = asyncio.get_running_loop().create_future()
    stream = stage.open(prompt_text, prompt_speech, tokens.extend, done.set_result)
    for start in range(0, len(text), 7):  # uneven pieces, as an agent sends them
        stream.push_text_ids(text[start : start + 7])
    stream.end_text()
    error = await done
    if error is not None:
        raise error
    trace.extend(stream.rounds)
    return tokens


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="vLLM's precision; the torch reference is always float32")
    parser.add_argument("--margin", type=float, default=0.5,
                        help="largest teacher-forced logit margin accepted below float32 (near-ties)")
    parser.add_argument("--cases", type=int, default=3)
    args = parser.parse_args()

    configs = load_model_configs(args.model_dir)
    vocab = configs.llm.vocab
    started = time.perf_counter()
    path = convert(args.model_dir, configs.llm)
    convert_s = time.perf_counter() - started
    settings = VLLMSettings(
        dtype=args.dtype, enforce_eager=True, gpu_memory_utilization=0.2, max_num_seqs=8,
        max_num_batched_tokens=4096, warmup_batch_sizes=(1,),
    )
    started = time.perf_counter()
    stage = await VLLMLMStage.start(settings, str(path), configs.llm)
    start_s = time.perf_counter() - started
    stage.greedy = True
    state = torch.load(args.model_dir / "llm.pt", map_location="cpu", weights_only=True, mmap=True)
    model = CosyVoice2LM.from_state_dict(configs.llm, state, device="cuda", dtype=torch.float32)
    backend = TorchLMBackend(model, greedy_sampling, mask_impossible=True, redraw_suppressed_eos=False)

    rng = random.Random(0)
    results = []
    for case in range(args.cases):
        prompt_text = [rng.randrange(vocab.text_vocab_size) for _ in range(20 + 5 * case)]
        prompt_speech = [rng.randrange(vocab.speech_token_size) for _ in range(150)]
        text = [rng.randrange(vocab.text_vocab_size) for _ in range(12 + 9 * case)]
        bound = MAX_SPEECH_PER_TEXT_TOKEN * len(text)
        offline_trace: list = []
        bistream_trace: list = []
        torch_offline = list(backend.generate_offline(text, prompt_text, prompt_speech))
        vllm_offline = await stage.generate_offline(text, prompt_text, prompt_speech, greedy=True, trace=offline_trace)
        torch_bistream = list(backend.generate_bistream(
            [[t] for t in text], prompt_text, prompt_speech, first_round_budget=True, max_reply_tokens=bound,
        ))
        vllm_bistream = await bistream_on(stage, text, prompt_text, prompt_speech, bistream_trace)
        for mode, ours, reference, trace in (("offline", vllm_offline, torch_offline, offline_trace),
                                             ("bistream", vllm_bistream, torch_bistream, bistream_trace)):
            margins = teacher_forced_margins(model, trace)
            results.append({
                "case": case, "mode": mode, "text_tokens": len(text), "tokens": len(reference),
                "vllm_tokens": len(ours), "equal": ours == reference,
                "first_difference": first_difference(ours, reference),
                "choices": len(margins),
                "argmax_share": round(sum(m <= 0 for m in margins) / max(len(margins), 1), 4),
                "max_margin": round(max(margins, default=0.0), 4),
            })
            if ours != reference:  # how vLLM's rounds went: ids given, tokens emitted, final, how it ended
                results[-1]["vllm_rounds"] = [[len(t.chunk.ids), len(t.emitted), t.chunk.final, t.finish_reason]
                                              for t in trace]
            print(json.dumps(results[-1]), flush=True)
    await stage.close()
    exact = all(r["equal"] for r in results)
    within = all(r["max_margin"] <= args.margin for r in results)
    report = {
        "vllm_dtype": args.dtype, "reference_dtype": "float32", "convert_s": round(convert_s, 1),
        "vllm_start_s": round(start_s, 1), "all_equal": exact, "all_within_margin": within,
        "margin_limit": args.margin, "cases": results,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    ok = exact if args.dtype == "float32" else within
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
