"""Greedy speech tokens through vLLM equal the plain-torch backend's, offline and in bistream.

Runs on a GPU with vLLM installed (bench/gpu_check.sh calls it). Both sides load the same
``llm.pt`` in float32; vLLM serves the converted directory through the product's own
stage (:class:`engine.cosyvoice2.lm_vllm.VLLMLMStage`), so this checks the converter, the
model, the logits processor and the streaming-input driver end to end.

Both sides mask a suppressed eos (a greedy redraw would repeat) and bound the final round
at 20 speech tokens per text token, which random weights reach, since they rarely pick eos.

    python3 bench/vllm_equality.py --model-dir DIR --json OUT.json
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

from engine.cosyvoice2.llm import CosyVoice2LM, TorchLMBackend  # noqa: E402
from engine.cosyvoice2.lm_stage import MAX_SPEECH_PER_TEXT_TOKEN  # noqa: E402
from engine.cosyvoice2.lm_vllm import VLLMLMStage  # noqa: E402
from engine.cosyvoice2.sampling import greedy_sampling  # noqa: E402
from engine.cosyvoice2.vllm_convert import convert  # noqa: E402
from engine.cosyvoice2.yamlconf import load_model_configs  # noqa: E402
from engine.settings import VLLMSettings  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def bistream_on(stage: VLLMLMStage, text, prompt_text, prompt_speech) -> list[int]:
    tokens: list[int] = []
    done = asyncio.get_running_loop().create_future()
    stream = stage.open(prompt_text, prompt_speech, tokens.extend, done.set_result)
    for start in range(0, len(text), 7):  # uneven pieces, as an agent sends them
        stream.push_text_ids(text[start : start + 7])
    stream.end_text()
    error = await done
    if error is not None:
        raise error
    return tokens


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--cases", type=int, default=3)
    args = parser.parse_args()

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
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
    model = CosyVoice2LM.from_state_dict(configs.llm, state, device="cuda", dtype=dtype)
    backend = TorchLMBackend(model, greedy_sampling, mask_impossible=True, redraw_suppressed_eos=False)

    rng = random.Random(0)
    results = []
    for case in range(args.cases):
        prompt_text = [rng.randrange(vocab.text_vocab_size) for _ in range(20 + 5 * case)]
        prompt_speech = [rng.randrange(vocab.speech_token_size) for _ in range(150)]
        text = [rng.randrange(vocab.text_vocab_size) for _ in range(12 + 9 * case)]
        bound = MAX_SPEECH_PER_TEXT_TOKEN * len(text)
        torch_offline = list(backend.generate_offline(text, prompt_text, prompt_speech))
        vllm_offline = await stage.generate_offline(text, prompt_text, prompt_speech, greedy=True)
        torch_bistream = list(backend.generate_bistream(
            [[t] for t in text], prompt_text, prompt_speech, first_round_budget=True, final_max_tokens=bound,
        ))
        vllm_bistream = await bistream_on(stage, text, prompt_text, prompt_speech)
        for mode, ours, reference in (("offline", vllm_offline, torch_offline),
                                      ("bistream", vllm_bistream, torch_bistream)):
            results.append({
                "case": case, "mode": mode, "text_tokens": len(text), "tokens": len(reference),
                "vllm_tokens": len(ours), "equal": ours == reference,
                "first_difference": first_difference(ours, reference),
            })
            print(json.dumps(results[-1]), flush=True)
    await stage.close()
    report = {
        "dtype": args.dtype, "convert_s": round(convert_s, 1), "vllm_start_s": round(start_s, 1),
        "all_equal": all(r["equal"] for r in results), "cases": results,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if report["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
