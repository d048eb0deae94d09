"""The official CosyVoice2 serving path under the load generator's workload (issue 22).

The baseline is upstream FunAudioLLM/CosyVoice at a pinned commit (bench/official_prepare.sh puts
it, its Matcha-TTS submodule and the wheels it imports into git-ignored folders; nothing of it is
in this repository). Two arms on the same checkpoint the gateway serves:

- ``torch``: ``CosyVoice2(model_dir, load_jit=False, load_trt=False, load_vllm=False, fp16=...)``;
- ``vllm``:  the same with ``load_vllm=True`` (GPU only; whole replies, as upstream requires).

The voice is registered once (``add_zero_shot_spk``); each session is a Python thread calling
``inference_zero_shot(text, ..., zero_shot_spk_id=..., stream=True)`` on the one shared instance,
as upstream's FastAPI and gRPC servers serve. The agents are the load generator's
(tts_gateway.gateway.loadgen): the same corpus, seeded draws (seeded per level and 32-agent group as
bench/gpu_check.py seeds its load-generator processes, so both speak the same replies), start
spread, user turns, playback clock, records and summary. TTFA is the call to the first chunk
it yields. Only the ``full`` workload (whole replies) exists here.

Runtime patches, each listed in the result's ``patches`` (docs/benchmarks.md explains them):
- ``token_hop_len per request``: upstream issue #1849 (``tts()`` grows the model's shared
  ``token_hop_len``, so from the third request on a first chunk waits for ~113 tokens); the
  hop is kept per request, as the fix proposed upstream does;
- ``max_token_text_ratio``: random weights never sample eos, so every reply runs to the LM's
  length bound; it is set to the gateway's ``max_speech_per_text_token`` (gpu_check's);
- ``Qwen2 from config``: the checkpoint's CosyVoice-BlankEN has a config and no weights (they
  are overwritten by llm.pt anyway), so the LM backbone is built from its config;
- ``torchaudio.load`` by our WAV reader: only where torchcodec is missing (torchaudio >= 2.9 needs it);
- stubs (bench/official_stubs/): ``modelscope`` (downloads only; never called with a local
  model_dir) and ``matcha.utils``'s package init (Matcha's training helpers: hydra, wget, gdown) is skipped;
- vLLM arm: ``typing.Union`` made visible to upstream's vLLM model file and ``embed_input_ids``
  added, delegating to its Qwen2Model's ``embed_input_ids`` (vLLM 0.26 names), the model registered at import.
- CPU only, where torchaudio has no build for the installed torch: a stand-in torchaudio from
  this repository's features (``load``, ``transforms.Resample``, ``compliance.kaldi.fbank``).

    python bench/official_baseline.py --upstream .official/src --model-dir /tmp/cv2-full \\
        --prompt-wav .gpu/prompt.wav --arm torch --levels 1,4,8,16,32 --duration 40 --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # inference_zero_shot's progress bar per call, before tqdm is imported
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402
from tts_gateway.gateway import loadgen  # noqa: E402
from tts_gateway.gateway.loadgen.report import percentile  # noqa: E402

PROMPT_TEXT = "This is the voice of the prompt, spoken clearly and slowly."  # .gpu/prompt.wav says this
VOICE_ID = "narrator"
STUBS = ROOT / "bench" / "official_stubs"
ARMS = ("torch", "vllm")
VLLM_ENV = "TTS_OFFICIAL_VLLM"  # set: this process and its spawned children register upstream's vLLM model


# ----------------------------------------------------------------------------- agents (no upstream)

Speak = Callable[[str], Iterator[int]]  # reply text -> the samples of each chunk, as they come


def agent_seeds(level: int) -> list[tuple[int, int, int]]:
    """(seed, sessions, index) of each agent of a level, drawn as by bench/gpu_check.py's
    load-generator processes (each its own seed and its own agent indices)."""
    return [(seed, count, i) for seed, count in gpu_check.load_clients(level) for i in range(count)]


def speak_timed(speak: Speak, text: str, record: loadgen.Record, deadline: float, sample_rate: int) -> float | None:
    """One reply on the load generator's playback clock: TTFA from the call to the first chunk;
    a chunk after ``deadline`` is not heard (the context stays ``truncated``). Returns when
    (``time.perf_counter``) the listener has heard all of its audio, None without audio."""
    playback = loadgen.Playback()
    started = time.perf_counter()
    chunks = speak(text)
    try:
        for samples in chunks:
            now = time.perf_counter()
            if now > deadline:
                return playback.runs_out
            if samples <= 0:
                continue
            duration_ms = samples * 1000 / sample_rate
            if record.ttfa_ms is None:
                record.ttfa_ms = (now - started) * 1000
            playback.add(now, duration_ms, record)
            record.audio_ms += duration_ms
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    record.outcome = "done"
    record.wall_ms = (time.perf_counter() - started) * 1000
    if record.audio_ms > 0:
        record.rtf = record.wall_ms / record.audio_ms
    return playback.runs_out


def run_agent(agent: int, seed: tuple[int, int, int], level: int, speak: Speak, replies: list[str],
              args: argparse.Namespace, level_start: float, records: list[loadgen.Record],
              errors: list[str]) -> None:
    """One session's thread until the level's time is up: loadgen.run_agent's turns, without a socket."""
    rng = loadgen.agent_rng(*seed)
    deadline = level_start + args.duration
    time.sleep(rng.uniform(0, args.start_spread))
    while time.perf_counter() < deadline:
        text = rng.choice(replies)
        record = loadgen.Record(level, agent, "full", len(text), started_s=round(time.perf_counter() - level_start, 3))
        records.append(record)
        heard_at = None
        try:
            heard_at = speak_timed(speak, text, record, deadline, args.sample_rate)
        except Exception as error:  # noqa: BLE001 - the official path failed: count it, keep the level going
            record.outcome, record.error_code = "error", type(error).__name__
            if len(errors) < 5:
                errors.append(traceback.format_exc()[-3000:])
            time.sleep(0.5)
        if args.turn_gap is not None and record.outcome == "done":
            pause = loadgen.turn_pause(heard_at, time.perf_counter(), rng, args.turn_gap)
            time.sleep(min(pause, max(0.0, deadline - time.perf_counter())))


def run_level(level: int, speak: Speak, replies: list[str],
              args: argparse.Namespace) -> tuple[list[loadgen.Record], dict]:
    """``level`` agent threads sharing ``speak``; then waits for threads they left behind (upstream's
    LLM threads of truncated replies) so that the next level starts on an idle model."""
    records: list[loadgen.Record] = []
    errors: list[str] = []
    level_start = time.perf_counter()
    threads = [threading.Thread(target=run_agent, name=f"agent-{agent}", daemon=True,
                                args=(agent, seed, level, speak, replies, args, level_start, records, errors))
               for agent, seed in enumerate(agent_seeds(level))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ended = time.perf_counter()
    while leftover_llm_threads() and time.perf_counter() - ended < args.drain_timeout:
        time.sleep(0.1)
    info = {"wall_s": round(ended - level_start, 2), "drain_s": round(time.perf_counter() - ended, 2),
            "threads_left": leftover_llm_threads(), "error_samples": errors}
    return records, info


def leftover_llm_threads() -> int:
    """Upstream's LLM threads still running (``threading.Thread(target=self.llm_job)``, named so)."""
    return sum(thread.name.endswith("(llm_job)") for thread in threading.enumerate())


def run(speak: Speak, args: argparse.Namespace, config: dict, write: Callable[[dict], None] | None = None,
        stages: StageTimes | None = None) -> dict:
    """Each level in turn; the result has the load generator's shape (loadgen.ramp_result), with
    each level's wall time, drain time, first errors and (given ``stages``) upstream's stage times
    added. ``write`` gets it after each level."""
    replies = loadgen.load_corpus(args.lang, args.corpus)
    config = {"workload": "full", "sessions": args.levels, "duration_s": args.duration, "tokens_per_second": None,
              "sample_rate": args.sample_rate, "lang": args.lang, "seed": "per level and group, as bench/gpu_check.py",
              "corpus": str(args.corpus) if args.corpus else f"built-in ({args.lang})", "replies": len(replies),
              "ttfa_p95_ms_limit": args.ttfa_p95_ms, "start_spread_s": args.start_spread,
              "turn_gap_s": None if args.turn_gap is None else list(args.turn_gap), **config}
    levels: list[tuple[int, list[loadgen.Record]]] = []
    infos = []
    result: dict = {}
    for level in args.levels:
        if stages is not None:
            stages.reset()
        records, info = run_level(level, speak, replies, args)
        if stages is not None:
            info["upstream_stages"] = stages.summary()
        levels.append((level, records))
        infos.append(info)
        result = loadgen.ramp_result(config, levels, args.ttfa_p95_ms)
        for entry, extra in zip(result["levels"], infos):
            entry.update(extra)
        print(f"[official] {level} sessions: {json.dumps(result['levels'][-1]['summary'])[:800]}", flush=True)
        if write is not None:
            write(result)
    return result


# ----------------------------------------------------------------------------- upstream, patched at run time

def _torchaudio_stand_in() -> types.ModuleType:
    """CPU only: torchaudio for what the official inference path calls, from this repository's
    features (no torchaudio build exists for the CPU test environment's torch)."""
    import numpy as np
    import torch

    from tts_gateway.engine.cosyvoice2.frontend import features
    from tts_gateway.engine.cosyvoice2.frontend.prompt import _resample

    def module(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = mod
        return mod

    torchaudio = module("torchaudio")
    torchaudio.__path__ = []
    torchaudio.load = _load_wav

    class Resample(torch.nn.Module):
        def __init__(self, orig_freq: int, new_freq: int) -> None:
            super().__init__()
            self.rates = (int(orig_freq), int(new_freq))

        def forward(self, waveform):
            rows = [_resample(row.numpy().astype(np.float64), *self.rates) for row in waveform]
            return torch.from_numpy(np.stack(rows)).float()

    transforms = module("torchaudio.transforms")
    transforms.Resample = Resample
    compliance = module("torchaudio.compliance")
    compliance.__path__ = []
    kaldi = module("torchaudio.compliance.kaldi")

    def fbank(waveform, num_mel_bins=23, dither=0.0, sample_frequency=16000.0, **kwargs):
        return features.fbank(waveform[0], num_mel_bins=num_mel_bins, dither=dither,
                              sample_frequency=sample_frequency, **kwargs)

    kaldi.fbank = fbank
    torchaudio.transforms, torchaudio.compliance, compliance.kaldi = transforms, compliance, kaldi
    return torchaudio


def _load_wav(path, *args, **kwargs):
    """torchaudio.load's result for a WAV file: ([channels, frames] float32, sample rate)."""
    import torch

    from tts_gateway.engine.cosyvoice2.frontend.prompt import read_wav

    audio, rate = read_wav(Path(path).read_bytes())
    return torch.from_numpy(audio.T.copy()), rate


def prepare_imports(upstream: Path, patches: list[str]) -> None:
    """Upstream's packages importable (here and in processes this one starts), stubs for what
    inference never uses, and the torchaudio patches where this machine's torchaudio differs."""
    sys.path.insert(0, str(upstream))
    sys.path.append(str(STUBS))  # after site-packages: a real modelscope wins
    os.environ["PYTHONPATH"] = os.pathsep.join([str(upstream), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")]),
                                                str(STUBS)])
    patches.append("stub: modelscope (snapshot_download, never called with a local model_dir)")
    # matcha.utils' package init imports Matcha's training helpers (hydra, wget, gdown); inference
    # needs only matcha.utils.audio and matcha.utils.pylogger, imported as submodules.
    matcha = importlib.import_module("matcha")
    utils_dir = upstream / "matcha" / "utils"
    utils = types.ModuleType("matcha.utils")
    utils.__path__ = [str(utils_dir)]
    utils.__spec__ = importlib.machinery.ModuleSpec("matcha.utils", None, is_package=True)
    utils.__spec__.submodule_search_locations = [str(utils_dir)]
    sys.modules["matcha.utils"] = matcha.utils = utils
    patches.append("stub: matcha.utils package init skipped (training helpers: hydra, wget, gdown)")
    try:
        import torchaudio  # noqa: F401
    except ImportError:
        _torchaudio_stand_in()
        patches.append("CPU: torchaudio stand-in (load, transforms.Resample, compliance.kaldi.fbank from "
                       "tts_gateway.engine.cosyvoice2.frontend)")
        return
    if importlib.util.find_spec("torchcodec") is None:
        import torchaudio

        torchaudio.load = _load_wav
        patches.append("torchaudio.load via the WAV reader of tts_gateway.engine.cosyvoice2.frontend.prompt "
                       "(no torchcodec)")


class _Qwen2FromConfig:
    """Stands in for transformers.Qwen2ForCausalLM in upstream's llm module when the checkpoint's
    CosyVoice-BlankEN holds no weights (load_official checks): the model built from its config
    (llm.pt overwrites every weight anyway)."""

    @staticmethod
    def from_pretrained(path, *args, **kwargs):
        from transformers import AutoConfig, Qwen2ForCausalLM

        return Qwen2ForCausalLM(AutoConfig.from_pretrained(path))


def register_vllm_model() -> None:
    """Upstream's vLLM model under its architecture name, with the vLLM 0.26 shims. At import
    time of this script when VLLM_ENV is set: vLLM's engine core is a spawned process that
    imports this script again."""
    import builtins
    import typing

    if not hasattr(builtins, "Union"):
        builtins.Union = typing.Union  # upstream's file uses Union from qwen2's star import
    from vllm import ModelRegistry

    from cosyvoice.vllm.cosyvoice2 import CosyVoice2ForCausalLM

    if not hasattr(CosyVoice2ForCausalLM, "embed_input_ids"):
        # vLLM 0.26 embeds generated tokens through embed_input_ids, and its Qwen2Model has only
        # that name: upstream's get_input_embeddings calls self.model.get_input_embeddings, which
        # no longer exists, so an alias of it would fail at the first decoded token.
        def embed_input_ids(self, input_ids):
            return self.model.embed_input_ids(input_ids)

        CosyVoice2ForCausalLM.embed_input_ids = embed_input_ids
    ModelRegistry.register_model("CosyVoice2ForCausalLM", CosyVoice2ForCausalLM)


if os.environ.get(VLLM_ENV) == "1" and __name__ != "__main__":  # a spawned child of the vllm arm
    prepare_imports(Path(os.environ["TTS_OFFICIAL_UPSTREAM"]), [])
    register_vllm_model()


def fix_shared_hop_len(model, patches: list[str]) -> None:
    """Upstream issue #1849: CosyVoice2Model.tts() grows ``self.token_hop_len`` as it streams,
    shared by every request. Here each request (one thread's tts() call) starts at the configured
    hop and grows its own."""
    start = model.token_hop_len
    local = threading.local()
    base = type(model)

    class PerRequestHop(base):
        @property
        def token_hop_len(self):
            return getattr(local, "hop", start)

        @token_hop_len.setter
        def token_hop_len(self, value):
            local.hop = value

        def tts(self, *args, **kwargs):
            local.hop = start
            yield from base.tts(self, *args, **kwargs)

    PerRequestHop.__name__ = base.__name__
    model.__dict__.pop("token_hop_len", None)
    model.__class__ = PerRequestHop
    patches.append(f"token_hop_len per request, starting at {start} (upstream issue #1849)")


def cap_reply_length(llm, ratio: float, patches: list[str]) -> None:
    """The LM's length bound (max_token_text_ratio, upstream default 20) set to ``ratio``."""
    llm.inference = functools.partial(type(llm).inference.__get__(llm), max_token_text_ratio=ratio)
    patches.append(f"max_token_text_ratio = {ratio:g} (the gateway's max_speech_per_text_token)")


class StageTimes:
    """Where upstream's time goes, observed from outside: its LM's generator and its ``token2wav``
    are wrapped with clocks and do what they did. Per level: the LM's first speech token after
    the call (prefill), the gaps between later tokens (one decode step each, every thread's LM
    sharing the GPU and the GIL), and each token2wav call (the flow over the turn so far + HiFT)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._times: dict[str, list[float]] = {"lm_first_token_ms": [], "lm_token_gap_ms": [], "token2wav_ms": []}

    def _add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._times[name].append(seconds * 1000.0)

    def observe(self, model) -> None:
        inference = model.llm.inference
        token2wav = model.token2wav

        def timed_inference(*args, **kwargs):
            last = time.perf_counter()
            name = "lm_first_token_ms"
            for token in inference(*args, **kwargs):
                now = time.perf_counter()
                self._add(name, now - last)
                last, name = now, "lm_token_gap_ms"
                yield token

        def timed_token2wav(*args, **kwargs):
            started = time.perf_counter()
            try:
                return token2wav(*args, **kwargs)
            finally:
                self._add("token2wav_ms", time.perf_counter() - started)

        model.llm.inference = timed_inference
        model.token2wav = timed_token2wav

    def summary(self) -> dict:
        with self._lock:
            return {name: {"p50": percentile(values, 50), "p95": percentile(values, 95),
                           "n": len(values)} for name, values in self._times.items()}


def load_official(args: argparse.Namespace, patches: list[str]):
    """The official CosyVoice2, patched as listed, with the voice registered once."""
    import torch

    if args.arm == "vllm":
        os.environ[VLLM_ENV] = "1"
        os.environ["TTS_OFFICIAL_UPSTREAM"] = str(args.upstream)
        register_vllm_model()
        patches.append("vLLM 0.26: typing.Union visible to cosyvoice/vllm/cosyvoice2.py, "
                       "embed_input_ids added (its Qwen2Model's embed_input_ids), model registered at import")
    llm_module = importlib.import_module("cosyvoice.llm.llm")
    if not any(p.suffix in (".safetensors", ".bin") for p in (args.model_dir / "CosyVoice-BlankEN").iterdir()):
        llm_module.Qwen2ForCausalLM = _Qwen2FromConfig
        patches.append("Qwen2 backbone built from CosyVoice-BlankEN/config.json (no blank weights in the checkpoint)")
    from cosyvoice.cli.cosyvoice import CosyVoice2

    torch.manual_seed(args.seed)
    started = time.perf_counter()
    cosyvoice = CosyVoice2(str(args.model_dir), load_jit=False, load_trt=False, load_vllm=args.arm == "vllm",
                           fp16=args.fp16)
    load_s = time.perf_counter() - started
    fix_shared_hop_len(cosyvoice.model, patches)
    cap_reply_length(cosyvoice.model.llm, args.max_speech_per_text_token, patches)
    cosyvoice.add_zero_shot_spk(args.prompt_text, str(args.prompt_wav), VOICE_ID)
    return cosyvoice, {"load_s": round(load_s, 1), "sample_rate": cosyvoice.sample_rate,
                       "device": str(cosyvoice.model.device), "fp16": cosyvoice.model.fp16}


def official_speaker(cosyvoice, prompt_text: str, prompt_wav: str) -> Speak:
    def speak(text: str) -> Iterator[int]:
        outputs = cosyvoice.inference_zero_shot(text, prompt_text, prompt_wav, zero_shot_spk_id=VOICE_ID, stream=True)
        try:
            for output in outputs:
                yield int(output["tts_speech"].shape[1])
        finally:
            outputs.close()

    return speak


WARM_UP_TEXT = "Hello there. This reply is spoken once before any level is measured."


def warm_up(speak: Speak) -> dict:
    """One reply spoken before any level, as the gateway speaks its warm-up before it reports
    ready: the first call pays one-time set-up (CUDA context, kernel selection), which would
    otherwise land on the first level's first reply."""
    started = time.perf_counter()
    first_chunk_s = None
    samples = 0
    for count in speak(WARM_UP_TEXT):
        first_chunk_s = first_chunk_s or time.perf_counter() - started
        samples += count
    return {"seconds": round(time.perf_counter() - started, 2),
            "first_chunk_s": None if first_chunk_s is None else round(first_chunk_s, 2), "samples": samples}


def gateway_speech_cap() -> float:
    """gpu_check's max_speech_per_text_token: the bound the gateway runs the same levels with."""
    return float(gpu_check.argument_parser().get_default("speech_per_text_token"))


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=ARMS, default="torch")
    parser.add_argument("--upstream", type=Path, default=ROOT / ".official" / "src",
                        help="folder holding upstream's cosyvoice/ and matcha/ (bench/official_prepare.sh)")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/cv2-full"))
    parser.add_argument("--prompt-wav", type=Path, default=ROOT / ".gpu" / "prompt.wav")
    parser.add_argument("--prompt-text", default=PROMPT_TEXT)
    parser.add_argument("--levels", type=lambda s: [int(n) for n in s.split(",")], default=[1, 4, 8, 16, 32])
    parser.add_argument("--workload", choices=("full",), default="full", help="whole replies (the only one here)")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per level")
    parser.add_argument("--start-spread", type=float, default=loadgen.DEFAULT_START_SPREAD_S)
    parser.add_argument("--turn-gap", default=",".join(f"{s:g}" for s in loadgen.DEFAULT_TURN_GAP_S))
    parser.add_argument("--back-to-back", action="store_true")
    parser.add_argument("--lang", choices=loadgen.LANGUAGES, default="en")
    parser.add_argument("--corpus", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="torch's seed (sampling); the agents' are gpu_check's")
    parser.add_argument("--ttfa-p95-ms", type=float, default=400.0)
    parser.add_argument("--max-speech-per-text-token", type=float, default=None,
                        help="the LM's length bound (default: bench/gpu_check.py's, the gateway's in that run)")
    parser.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--drain-timeout", type=float, default=120.0,
                        help="seconds to wait after a level for upstream's leftover LLM threads")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "official-out")))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    try:
        loadgen.check_start_spread(args.start_spread, args.duration)
        args.turn_gap = None if args.back_to_back else loadgen.parse_turn_gap(args.turn_gap)
    except ValueError as error:
        parser.error(str(error))
    if args.max_speech_per_text_token is None:
        args.max_speech_per_text_token = gateway_speech_cap()
    args.upstream = args.upstream.resolve()  # also for the vLLM arm's spawned processes
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"official_{args.arm}.json"
    patches: list[str] = []
    prepare_imports(args.upstream, patches)
    print(f"[official] loading upstream's CosyVoice2 ({args.arm} arm) from {args.model_dir}", flush=True)
    cosyvoice, loaded = load_official(args, patches)
    print(f"[official] loaded in {loaded['load_s']} s, the voice registered", flush=True)
    stages = StageTimes()
    stages.observe(cosyvoice.model)
    args.sample_rate = loaded["sample_rate"]
    config = {"arm": args.arm, "model_dir": str(args.model_dir),
              "max_speech_per_text_token": args.max_speech_per_text_token,
              "upstream": _pinned(args.upstream), "patches": patches, **loaded}

    def write(result: dict) -> None:
        path.write_text(json.dumps(result, indent=1))

    speak = official_speaker(cosyvoice, args.prompt_text, str(args.prompt_wav))
    config["warm_up"] = warm_up(speak)
    config["warm_up"]["upstream_stages"] = stages.summary()
    print(f"[official] warm-up: {config['warm_up']}", flush=True)
    result = run(speak, args, config, write, stages)
    print(loadgen.markdown_table(result))
    print(f"[official] wrote {path}")
    return 0 if result["levels"] and any(lv["summary"]["ttfa_ms"]["n"] for lv in result["levels"]) else 1


def _pinned(upstream: Path) -> str | None:
    pinned = upstream / "PINNED"
    return pinned.read_text().strip() if pinned.is_file() else None


if __name__ == "__main__":
    sys.exit(main())
