"""The vLLM backend's CPU-checkable parts: the converted model directory, the round
translation, repetition-aware sampling as one distribution, and the streaming-input
driver, run against an engine that follows vLLM's streaming-input rules on the
plain-torch model and compared token for token with the plain-torch backend.

The rules the stand-in engine follows are vLLM 0.26's (v1 scheduler,
``_update_request_as_session``): each input appends its prompt ids to the request's
context; a round samples until a stop token or ``max_tokens``; the last sampled token of
a round is dropped from the context before the next input. ``max_tokens`` is the first
input's for every round: 0.26 keeps the scheduler request's ``max_tokens`` from its first
input and does not refresh it from a continuation's parameters (vLLM PR #57676, open). The real vLLM is checked
against the plain-torch backend on the GPU (bench/gpu_check.sh).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import importlib
import json
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tts_gateway.engine.cosyvoice2.serving.lm import vllm_stage as lm_vllm
from tts_gateway.testkit.checkpoint import make_checkpoint
from tts_gateway.engine.cosyvoice2.model.llm import CosyVoice2LM
from tts_gateway.engine.cosyvoice2.modeldir.configs import LLMConfig
from tts_gateway.engine.cosyvoice2.serving.lm.planner import Chunk, offline_chunk
from tts_gateway.engine.cosyvoice2.serving.lm.torch_stage import TorchLMBackend
from tts_gateway.engine.cosyvoice2.modeldir.configs import SamplingConfig
from tts_gateway.engine.cosyvoice2.serving.lm.sampling import greedy_sampling, ras_log_probs, ras_sampling
from tts_gateway.engine.cosyvoice2.serving.lm.vllm_convert import ARCHITECTURE, convert
from tts_gateway.engine.cosyvoice2.serving.lm.vllm_rounds import RoundRule, RoundTracker, round_request
from tts_gateway.engine.cosyvoice2.modeldir.reading import load_model_configs
from tts_gateway.engine.cosyvoice2.settings import VLLMSettings
from tests.reference import randomize_lm

CONFIG = LLMConfig.tiny()
VOCAB = CONFIG.vocab
EOS, FILL = VOCAB.eos_class, VOCAB.fill_class


def random_model(seed: int, fill_bias: float = 0.0, eos_bias: float = 2.0) -> CosyVoice2LM:
    """A tiny LM whose every weight matters (tests/reference.py), fill and eos raised by the biases."""
    model = randomize_lm(CosyVoice2LM(CONFIG), seed)
    with torch.no_grad():
        model.llm_decoder.bias[FILL] += fill_bias
        model.llm_decoder.bias[EOS] += eos_bias  # turns end by eos, not by the safety bound
    return model


def masking_backend(model: CosyVoice2LM) -> TorchLMBackend:
    """The torch backend as a backend that samples once must run: greedy, eos masked where suppressed."""
    return TorchLMBackend(model, greedy_sampling, mask_impossible=True, redraw_suppressed_eos=False)


# ----------------------------------------------------------------------------- the converter


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("cv2") / "model", "tiny", seed=3)


def test_converted_directory_is_the_same_model(tiny_dir: Path) -> None:
    from transformers import Qwen2ForCausalLM

    configs = load_model_configs(tiny_dir)
    out = convert(tiny_dir, configs.llm)
    config = json.loads((out / "config.json").read_text())
    vocab = configs.llm.vocab
    assert config["architectures"] == [ARCHITECTURE]
    assert config["vocab_size"] == vocab.size and config["tie_word_embeddings"] is False
    assert config["cosyvoice2"]["speech_offset"] == vocab.speech_offset

    ours = CosyVoice2LM.from_state_dict(
        configs.llm, torch.load(tiny_dir / "llm.pt", map_location="cpu", weights_only=True)
    )
    tensors = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    backbone = Qwen2ForCausalLM.from_pretrained(str(out)).eval()
    # Every kind of id: sos, text, task_id, speech tokens, eos, fill.
    sequence = [vocab.sos_eos, 5, 17, 900, vocab.task_id, vocab.speech(0), vocab.speech(6560), vocab.speech(EOS)]
    sequence.append(vocab.speech(FILL))
    ids = torch.tensor([sequence])
    with torch.no_grad():
        hidden = backbone.model(input_ids=ids).last_hidden_state
        converted = hidden @ tensors["speech_head.weight"].T + tensors["speech_head.bias"]
        expected = ours(ours.embed(ids))
    assert torch.equal(tensors["model.embed_tokens.weight"][ids[0]], ours.embed(ids)[0])
    assert (converted - expected).abs().max().item() < 1e-5


def test_conversion_is_cached_until_llm_pt_changes(tiny_dir: Path, tmp_path: Path) -> None:
    configs = load_model_configs(tiny_dir)
    out = convert(tiny_dir, configs.llm, tmp_path / "lm")
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert convert(tiny_dir, configs.llm, tmp_path / "lm") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == written
    llm_pt = tiny_dir / "llm.pt"
    stat = llm_pt.stat()
    import os

    os.utime(llm_pt, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    convert(tiny_dir, configs.llm, tmp_path / "lm")
    assert (out / "model.safetensors").stat().st_mtime_ns != written


def test_converter_rejects_a_mismatched_checkpoint(tiny_dir: Path, tmp_path: Path) -> None:
    configs = load_model_configs(tiny_dir)
    wrong = LLMConfig(llm_input_size=64, llm_output_size=64, speech_token_size=4096, qwen=configs.llm.qwen)
    with pytest.raises(ValueError, match="do not match"):
        convert(tiny_dir, wrong, tmp_path / "lm")


# ----------------------------------------------------------------------------- rounds


def test_round_requests() -> None:
    sampling = SamplingConfig()
    bistream = Chunk(ids=(VOCAB.sos_eos, 1, 2, 3, 4, 5), stop=frozenset({FILL}), max_tokens=15)
    request = round_request(bistream, VOCAB, sampling, list(range(30)), 500, 3000)
    assert request.prompt_token_ids == list(bistream.ids)
    assert request.stop_token_ids == [VOCAB.speech(FILL)]
    assert request.max_tokens == 3000  # the model's room: vLLM keeps the first round's for all
    assert request.rule.allowed_specials(0) == (VOCAB.speech(FILL),)  # no eos, no unused class
    assert request.rule.limit == 15 and not request.rule.must_stop(14) and request.rule.must_stop(15)
    assert request.rule.history == tuple(range(20, 30))  # the ras window only
    assert RoundRule.from_extra_args(request.rule.to_extra_args()) == request.rule

    final = Chunk(ids=(VOCAB.task_id,), stop=frozenset({EOS}), final=True)
    request = round_request(final, VOCAB, None, [1, 2], 321, 400)
    assert request.max_tokens == 400 and request.rule.ras is None and request.rule.history == ()
    assert request.rule.limit == 321 and request.rule.allowed_specials(0) == (VOCAB.speech(EOS),)

    offline = offline_chunk(VOCAB, [1, 2, 3], [4], [7, 8])
    request = round_request(offline, VOCAB, sampling, [], 100, 200)
    assert request.rule.allowed_specials(5) == (VOCAB.speech(EOS + 1), VOCAB.speech(FILL))  # eos waits
    assert VOCAB.speech(EOS) in request.rule.allowed_specials(6)
    short = dataclasses.replace(offline, max_tokens=4)  # a limit below min_tokens: eos still ends it
    assert VOCAB.speech(EOS) in round_request(short, VOCAB, sampling, [], 100, 200).rule.allowed_specials(4)
    with pytest.raises(ValueError, match="malformed"):
        RoundRule.from_extra_args({"cosyvoice2": {"eos": 1}})
    assert RoundRule.from_extra_args({"other": 1}) is None


def test_round_tracker_drops_the_token_after_the_budget() -> None:
    chunk = Chunk(ids=(1,), stop=frozenset({FILL}), max_tokens=2)
    tracker = RoundTracker(chunk, VOCAB)
    assert tracker.feed([VOCAB.speech(7), VOCAB.speech(8)]) == [7, 8] and not tracker.done
    assert tracker.feed([VOCAB.speech(9)]) == [] and tracker.done
    assert tracker.history_after([1]) == [1, 7, 8, FILL]
    with pytest.raises(RuntimeError, match="after its round ended"):
        tracker.feed([VOCAB.speech(1)])
    tracker = RoundTracker(chunk, VOCAB)
    assert tracker.feed([VOCAB.speech(3), VOCAB.speech(FILL)]) == [3] and tracker.done
    with pytest.raises(RuntimeError, match="cannot occur"):
        RoundTracker(chunk, VOCAB).feed([VOCAB.speech(EOS + 1)])


def test_ras_as_one_distribution_matches_the_two_draw_sampler() -> None:
    """ras_log_probs is the law of ras_sampling: checked against 40k draws of it."""
    torch.manual_seed(0)
    logits = torch.randn(40) * 2
    for history in ([], [int(logits.argmax())], [3, 3, 9, int(logits.argsort()[-2])]):
        recent = torch.tensor([history + [-1] * (10 - len(history))])
        law = ras_log_probs(logits[None], recent, torch.tensor([0.8]), torch.tensor([25]), torch.tensor([1.0]))
        law = law.exp()[0]
        generator = torch.Generator().manual_seed(1)
        draws = collections.Counter(
            ras_sampling(logits.log_softmax(0), history, generator=generator) for _ in range(40_000)
        )
        frequency = torch.tensor([draws[c] / 40_000 for c in range(40)])
        assert abs(law.sum().item() - 1) < 1e-5
        assert (frequency - law).abs().max().item() < 0.01  # ~4 sigma at p = 0.5


# ----------------------------------------------------------------------------- the driver


class StreamingInputEngine:
    """Follows vLLM's streaming-input rules (see the module docstring) on the torch model."""

    def __init__(self, model: CosyVoice2LM, seed: int = 0) -> None:
        self.errored = False  # AsyncLLM's flag: its engine process has died
        self.model = model
        self.vocab = model.vocab
        self.generator = torch.Generator().manual_seed(seed)
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.round_ends: list[str] = []  # per round: "fill", "eos", "limit" or "length"

    def logits(self, context: list[int]) -> torch.Tensor:
        with torch.no_grad():
            speech = self.model(self.model.embed(torch.tensor([context])))[0, -1]
        logits = torch.full((self.vocab.size,), float("-inf"))
        logits[self.vocab.speech_offset :] = speech
        return logits

    def sample(self, rule: RoundRule, context: list[int], sampled: list[int], greedy: bool) -> int:
        logits = self.logits(context + sampled)
        first = self.vocab.speech(self.vocab.speech_token_size)
        closed = [u for u in range(first, self.vocab.size) if u not in rule.allowed_specials(len(sampled))]
        logits[closed] = float("-inf")
        if rule.must_stop(len(sampled)):  # as the logits processor: stop classes only, no ras
            logits[self.vocab.speech_offset : first] = float("-inf")
            return int(logits.argmax())
        if greedy:
            return int(logits.argmax())
        speech = logits[self.vocab.speech_offset :]
        p, k, win, tau = rule.ras
        recent = rule.recent(self.vocab, sampled)
        law = ras_log_probs(
            speech[None], torch.tensor([recent + [-1] * (win - len(recent))]), torch.tensor([p]),
            torch.tensor([k]), torch.tensor([win * tau]),
        )[0].exp()
        return self.vocab.speech_offset + int(law.multinomial(1, generator=self.generator))

    async def generate(self, inputs, _params, request_id):
        context: list[int] = []
        max_tokens = None  # the first input's, for every round (see the module docstring)
        try:
            async for request, greedy in inputs:
                context += request.prompt_token_ids
                max_tokens = request.max_tokens if max_tokens is None else max_tokens
                sampled: list[int] = []
                while True:
                    token = self.sample(request.rule, context, sampled, greedy)
                    sampled.append(token)
                    reason = "stop" if token in request.stop_token_ids else None
                    if reason is None and len(sampled) == max_tokens:
                        reason = "length"
                    yield SimpleNamespace(
                        outputs=[SimpleNamespace(token_ids=[token], finish_reason=reason)], finished=False
                    )
                    if reason is not None:
                        stopped_by = {self.vocab.speech(FILL): "fill", self.vocab.speech(EOS): "eos"}.get(token)
                        if request.rule.must_stop(len(sampled) - 1):
                            stopped_by = "limit"
                        self.round_ends.append(stopped_by if reason == "stop" else reason)
                        break
                    await asyncio.sleep(0)
                context += sampled[:-1]
            self.finished.append(request_id)
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], finish_reason=None)], finished=True)
        except (asyncio.CancelledError, GeneratorExit):
            if request_id not in self.finished:  # closing after the last output is no abort
                self.aborted.append(request_id)
            raise


@pytest.fixture
def plain_inputs(monkeypatch):
    """Rounds reach the stand-in engine as (RoundRequest, greedy) instead of vLLM objects."""
    monkeypatch.setattr(lm_vllm, "streaming_input", lambda request, greedy: (request, greedy))
    monkeypatch.setattr(lm_vllm, "request_params", lambda: None)


def stage_on(engine: StreamingInputEngine, *, greedy: bool) -> lm_vllm.VLLMLMStage:
    stage = lm_vllm.VLLMLMStage(engine, CONFIG, VLLMSettings(), lm_vllm.LLMStageCounters())
    stage.greedy = greedy
    return stage


async def speak(stage, pieces, prompt_text, prompt_speech) -> list[int]:
    tokens: list[int] = []
    done = asyncio.get_running_loop().create_future()
    stream = stage.open(prompt_text, prompt_speech, tokens.extend, done.set_result)
    for piece in pieces:
        stream.push_text_ids(piece)
        await asyncio.sleep(0.001)
    stream.end_text()
    assert await asyncio.wait_for(done, 30) is None
    return tokens


PROMPT_TEXT = [11, 12, 13, 14, 15, 16, 17]
PROMPT_SPEECH = [int(t) for t in torch.randint(0, 6561, (22,), generator=torch.Generator().manual_seed(5))]
TEXT = [int(t) for t in torch.randint(0, 1024, (23,), generator=torch.Generator().manual_seed(6))]


@pytest.mark.parametrize(
    ("fill_bias", "round_end"), [(0.0, "limit"), (3.0, "fill")], ids=["rounds-end-at-budget", "rounds-end-at-fill"]
)
async def test_bistream_through_streaming_input_equals_the_torch_backend(plain_inputs, fill_bias, round_end) -> None:
    model = random_model(seed=2, fill_bias=fill_bias)
    torch_tokens = list(
        masking_backend(model).generate_bistream(
            [[t] for t in TEXT], PROMPT_TEXT, PROMPT_SPEECH, first_round_budget=True
        )
    )
    engine = StreamingInputEngine(model)
    # The agent's text arrives in uneven pieces; rounds must still start every 5 tokens.
    pieces = [TEXT[:2], TEXT[2:11], TEXT[11:12], TEXT[12:]]
    tokens = await speak(stage_on(engine, greedy=True), pieces, PROMPT_TEXT, PROMPT_SPEECH)
    assert len(torch_tokens) > 40
    assert tokens == torch_tokens
    assert engine.finished and not engine.aborted
    assert round_end in engine.round_ends[:-1] and engine.round_ends[-1] == "eos"


async def test_offline_through_streaming_input_equals_the_torch_backend(plain_inputs) -> None:
    model = random_model(seed=5)
    expected = list(masking_backend(model).generate_offline(
        TEXT[:6], PROMPT_TEXT, PROMPT_SPEECH))
    stage = stage_on(StreamingInputEngine(model), greedy=True)
    assert await stage.generate_offline(TEXT[:6], PROMPT_TEXT, PROMPT_SPEECH, greedy=True) == expected
    assert 12 < len(expected) < 120  # ended by eos, between the min and max lengths


async def test_sampled_bistream_keeps_the_round_rules(plain_inputs) -> None:
    """With ras sampling: every token is a speech token, the fill marks never leak out."""
    model = random_model(seed=2, fill_bias=3.0)
    tokens = await speak(stage_on(StreamingInputEngine(model, seed=9), greedy=False), [TEXT], PROMPT_TEXT, [])
    assert tokens and all(0 <= t < VOCAB.speech_token_size for t in tokens)


async def test_cancel_aborts_the_request_at_once(plain_inputs) -> None:
    model = random_model(seed=2)
    engine = StreamingInputEngine(model)
    stage = stage_on(engine, greedy=True)
    got: list[int] = []
    done: list = []
    stream = stage.open(PROMPT_TEXT, PROMPT_SPEECH, got.extend, done.append)
    stream.push_text_ids(TEXT)
    while not got:
        await asyncio.sleep(0.001)
    stream.cancel()
    await asyncio.sleep(0.01)
    assert len(engine.aborted) == 1 and not engine.finished
    assert stage.running() == 0 and done == []  # a cancelled utterance gets no callback


async def test_an_utterance_longer_than_the_model_fails_clearly(plain_inputs) -> None:
    stage = lm_vllm.VLLMLMStage(StreamingInputEngine(random_model(1)), CONFIG, VLLMSettings(max_model_len=256),
                                lm_vllm.LLMStageCounters())
    stage.greedy = True
    done = asyncio.get_running_loop().create_future()
    stream = stage.open([], [], lambda tokens: None, done.set_result)
    stream.push_text_ids(list(range(300)))
    stream.end_text()
    error = await asyncio.wait_for(done, 30)
    assert isinstance(error, RuntimeError) and "max_model_len" in str(error)


def test_metrics_names() -> None:
    stage = lm_vllm.VLLMLMStage(None, CONFIG, VLLMSettings(), lm_vllm.LLMStageCounters(prefix_queries=10, prefix_hits=7))
    gauges, totals = stage.metrics()
    assert {"llm_running_requests", "llm_waiting_requests", "llm_kv_cache_usage_ratio"} <= set(gauges)
    assert totals["llm_prefix_cache_hit_tokens"] == 7 and totals["llm_prefix_cache_queried_tokens"] == 10


def test_a_dead_vllm_engine_is_reported() -> None:
    engine = StreamingInputEngine(random_model(1))
    stage = lm_vllm.VLLMLMStage(engine, CONFIG, VLLMSettings(), lm_vllm.LLMStageCounters())
    assert stage.failure() is None
    engine.errored = True
    assert "died" in stage.failure()


async def test_a_reply_without_eos_ends_at_the_configured_ratio(plain_inputs) -> None:
    """A model that never samples eos: the reply is stopped by the logits processor's rule
    once it has max_speech_per_text_token x the text's tokens, and the stream ends cleanly."""
    model = random_model(seed=2, eos_bias=-100.0)
    engine = StreamingInputEngine(model)
    stage = stage_on(engine, greedy=True)
    stage.max_speech_per_text_token = 6.0
    done = asyncio.get_running_loop().create_future()
    tokens: list[int] = []
    stream = stage.open(PROMPT_TEXT, PROMPT_SPEECH, tokens.extend, done.set_result)
    stream.push_text_ids(TEXT)
    stream.end_text()
    assert await asyncio.wait_for(done, 30) is None
    final = stream.rounds[-1]
    assert final.chunk.final and sum(len(r.emitted) for r in stream.rounds) == int(6.0 * len(TEXT))
    assert len(stream.rounds) > 2 and len(final.emitted) > 0
    # The torch backend under the same bound (the GPU token check's reference) says the same.
    expected = masking_backend(model).generate_bistream(
        [[t] for t in TEXT], PROMPT_TEXT, PROMPT_SPEECH, first_round_budget=True, max_reply_tokens=int(6.0 * len(TEXT))
    )
    assert tokens == list(expected)
    assert engine.round_ends[-1] == "limit" and engine.finished


async def test_teacher_forced_replay_scores_what_the_backend_chose(plain_inputs) -> None:
    """The GPU equality check's replay (bench/vllm_equality.py): greedy choices of the same model
    score 0 at every step, rounds ending at fill included; another model's choices do not."""
    from bench.vllm_equality import teacher_forced_margins

    model = random_model(seed=2, fill_bias=3.0)
    stage = stage_on(StreamingInputEngine(model), greedy=True)
    done = asyncio.get_running_loop().create_future()
    stream = stage.open(PROMPT_TEXT, PROMPT_SPEECH, lambda tokens: None, done.set_result)
    stream.push_text_ids(TEXT)
    stream.end_text()
    assert await asyncio.wait_for(done, 30) is None
    trace = stream.rounds
    margins = teacher_forced_margins(model, trace)
    emitted = sum(len(r.emitted) for r in trace)
    fills = sum(1 for r in trace if not r.chunk.final and len(r.emitted) < r.chunk.max_tokens)
    assert fills >= 1 and len(margins) == emitted + fills
    assert max(margins) <= 1e-5
    assert max(teacher_forced_margins(random_model(seed=3, fill_bias=3.0), trace)) > 0.1

    offline: list = []
    await stage.generate_offline(TEXT[:6], PROMPT_TEXT, PROMPT_SPEECH, greedy=True, trace=offline)
    assert len(offline) == 1 and max(teacher_forced_margins(model, offline)) <= 1e-5


async def test_the_vllm_backend_asks_for_a_gpu(tiny_dir) -> None:
    from tts_gateway.engine.base import EngineError
    from tts_gateway.engine.cosyvoice2.engine import CosyVoice2Engine
    from tts_gateway.engine.cosyvoice2.settings import CosyVoice2Settings

    engine = CosyVoice2Engine(CosyVoice2Settings(model_dir=str(tiny_dir), device="cpu", llm_backend="vllm"))
    with pytest.raises(EngineError, match="needs a CUDA GPU"):
        await engine.start()


async def test_the_vllm_backend_refuses_pipelined_scheduling(tiny_dir) -> None:
    """async_scheduling = true: a bistream round returned a token past its stop with it on, so
    the engine says so at start, naming the setting, before vLLM is started."""
    from tts_gateway.engine.base import EngineError
    from tts_gateway.engine.cosyvoice2.engine import CosyVoice2Engine
    from tts_gateway.engine.cosyvoice2.settings import CosyVoice2Settings, VLLMSettings

    settings = CosyVoice2Settings(model_dir=str(tiny_dir), device="cpu", llm_backend="vllm",
                                  vllm=VLLMSettings(async_scheduling=True))
    with pytest.raises(EngineError, match=r"\[engine.cosyvoice2.vllm\] async_scheduling = true cannot serve bistream rounds"):
        await CosyVoice2Engine(settings).start()


# ----------------------------------------------------------------------------- the logits processor

VLLM_MODEL = "tts_gateway.engine.cosyvoice2.serving.lm.vllm_model"
EOS_ID, UNUSED_ID, FILL_ID = VOCAB.speech(EOS), VOCAB.speech(EOS + 1), VOCAB.speech(FILL)
SPEECH = slice(VOCAB.speech_offset, VOCAB.size)  # the speech classes' columns, specials included


class MoveDirectionality(enum.Enum):
    """vLLM's ``vllm.v1.sample.logits_processor.MoveDirectionality``."""

    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


@dataclasses.dataclass
class BatchUpdate:
    """vLLM's ``BatchUpdate``, applied in its order: removed, then added, then moved."""

    batch_size: int
    removed: list[int] = dataclasses.field(default_factory=list)
    added: list[tuple] = dataclasses.field(default_factory=list)  # (index, params, prompt ids, output ids)
    moved: list[tuple] = dataclasses.field(default_factory=list)  # (a, b, MoveDirectionality)


@pytest.fixture
def vllm_model(monkeypatch):
    """tts_gateway.engine.cosyvoice2.serving.lm.vllm_model imported over stand-ins for the vLLM names it uses.

    The stand-ins live in sys.modules for this test only, and the module imported over
    them is dropped afterwards, so no other test sees a fake vLLM.
    """

    class Placeholder:
        pass

    def stub(name: str, **names) -> None:
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so that its submodules import
        module.__dict__.update(names)
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)

    stub("vllm")
    stub("vllm.config", VllmConfig=Placeholder)
    stub("vllm.model_executor")
    stub("vllm.model_executor.models")
    stub("vllm.model_executor.models.qwen2", Qwen2Model=Placeholder)
    stub("vllm.model_executor.models.utils", AutoWeightsLoader=Placeholder, maybe_prefix=lambda p, n: f"{p}.{n}")
    stub("vllm.sequence", IntermediateTensors=Placeholder)
    stub("vllm.v1")
    stub("vllm.v1.sample")
    stub(
        "vllm.v1.sample.logits_processor",
        BatchUpdate=BatchUpdate,
        LogitsProcessor=type("LogitsProcessor", (), {}),
        MoveDirectionality=MoveDirectionality,
    )
    package = importlib.import_module("tts_gateway.engine.cosyvoice2")
    had_attribute = hasattr(package, "vllm_model")
    monkeypatch.delitem(sys.modules, VLLM_MODEL, raising=False)
    yield importlib.import_module(VLLM_MODEL)
    sys.modules.pop(VLLM_MODEL, None)
    if not had_attribute and hasattr(package, "vllm_model"):
        delattr(package, "vllm_model")


def logits_processor(vllm_model):
    """The processor as vLLM builds it, over the tiny config's vocabulary, on the CPU."""
    layout = {"text_vocab_size": VOCAB.text_vocab_size, "speech_token_size": VOCAB.speech_token_size}
    config = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(cosyvoice2=layout)))
    return vllm_model.CosyVoice2LogitsProcessor(config, torch.device("cpu"), False)


def rule(*specials: int, eos: bool = False, min_tokens: int = 0, limit=None, ras=None, history=()) -> RoundRule:
    return RoundRule(
        special_allowed=tuple(specials), eos=EOS_ID if eos else None, min_tokens=min_tokens, limit=limit, ras=ras,
        history=history,
    )


def params(round_rule: RoundRule | None) -> SimpleNamespace:
    """SamplingParams as the processor reads them: a rule in extra_args, or none at all."""
    return SimpleNamespace(extra_args=None if round_rule is None else round_rule.to_extra_args())


def added(index: int, round_rule: RoundRule | None, output_ids: list[int] | None = None) -> tuple:
    return (index, params(round_rule), [VOCAB.sos_eos, 5], [] if output_ids is None else output_ids)


def masked_specials(processor, rows: int) -> list[set[int]]:
    """Per batch row, the special classes (eos, unused, fill) the processor closes."""
    out = processor.apply(torch.zeros(rows, VOCAB.size))
    return [{c for c in (EOS, EOS + 1, FILL) if out[i, VOCAB.speech(c)] == float("-inf")} for i in range(rows)]


def test_logits_processor_masks_the_special_classes_a_round_may_not_take(vllm_model) -> None:
    """Closed special classes go to -inf, open ones and speech tokens keep their logits;
    eos opens once the round has sampled min_tokens (read from the live output list); a
    request without a rule is left alone."""
    processor = logits_processor(vllm_model)
    assert processor.is_argmax_invariant() is False
    sampled: list[int] = []  # vLLM's live output list of row 0: it grows between steps
    processor.update_state(
        BatchUpdate(
            batch_size=3,
            added=[added(0, rule(eos=True, min_tokens=2), sampled), added(1, rule(FILL_ID)), added(2, None)],
        )
    )
    logits = torch.randn(3, VOCAB.size, generator=torch.Generator().manual_seed(0))
    for step, eos_open in enumerate([False, False, True, True]):
        out = processor.apply(logits.clone())
        expected = logits.clone()
        expected[0, [UNUSED_ID, FILL_ID] + ([] if eos_open else [EOS_ID])] = float("-inf")
        expected[1, [EOS_ID, UNUSED_ID]] = float("-inf")
        assert torch.equal(out, expected), f"after {step} sampled tokens"
        sampled.append(VOCAB.speech(100 + step))
    assert processor.update_state(None) is None  # a step without changes keeps the rules
    assert masked_specials(processor, 3) == [{EOS + 1, FILL}, {EOS, EOS + 1}, set()]


def test_logits_processor_stops_a_round_at_its_limit(vllm_model) -> None:
    """Once a round has emitted its limit, only its stop classes stay open: fill for a budget
    round, eos for the final one even before min_tokens, and no ras on that step. This, not
    max_tokens, ends a round: vLLM 0.26 keeps the first round's max_tokens for all rounds."""
    processor = logits_processor(vllm_model)
    budget, final = [VOCAB.speech(1)] * 2, [VOCAB.speech(2)] * 3
    ras = (0.8, 25, 10, 0.1)
    processor.update_state(
        BatchUpdate(
            batch_size=3,
            added=[
                added(0, rule(FILL_ID, limit=2, ras=ras), budget),
                added(1, rule(eos=True, min_tokens=10, limit=3), final),
                added(2, rule(FILL_ID, limit=5, ras=ras), [VOCAB.speech(3)]),
            ],
        )
    )
    logits = torch.randn(3, VOCAB.size, generator=torch.Generator().manual_seed(3))
    out = processor.apply(logits.clone())[:, VOCAB.speech_offset :]  # the model's text logits are -inf

    def open_ids(row: int) -> list[int]:
        return [VOCAB.speech_offset + c for c in (out[row] > float("-inf")).nonzero().flatten().tolist()]

    assert open_ids(0) == [FILL_ID] and out[0, FILL] == logits[0, FILL_ID]  # as it was: no ras
    assert open_ids(1) == [EOS_ID]
    assert len(open_ids(2)) > 1  # below its limit: speech stays open


def test_logits_processor_samples_ras_as_one_distribution(vllm_model) -> None:
    """A row with ras gets, over its speech classes, the log of ras_sampling's law on its masked
    logits, with the window made of the round's history and output; rows without ras and the
    non-speech columns stay as they were."""
    processor = logits_processor(vllm_model)
    history = (3, 9, FILL)
    output = [VOCAB.speech(c) for c in (3, 12, 12, 40)]
    rules = [
        rule(FILL_ID),  # greedy: no ras
        rule(FILL_ID, ras=(0.8, 25, 10, 0.1), history=history),  # window 10: history and output, padded
        rule(eos=True, ras=(0.5, 5, 4, 0.5), history=(7, 7, 7, 7, 7)),  # window 4: output only, 2 repeats
    ]
    processor.update_state(
        BatchUpdate(batch_size=3, added=[added(i, r, list(output)) for i, r in enumerate(rules)])
    )
    logits = torch.randn(3, VOCAB.size, generator=torch.Generator().manual_seed(1))
    offset = VOCAB.speech_offset
    logits[:, offset + 3] += 8.0  # likely classes that are also in the windows: ras changes them
    logits[:, offset + 12] += 7.5
    logits[:, offset + 0] += 7.5  # likely, never decoded: the window's padding must not count as class 0
    out = processor.apply(logits.clone())

    masked = logits.clone()
    masked[:2, [EOS_ID, UNUSED_ID]] = float("-inf")
    masked[2, [UNUSED_ID, FILL_ID]] = float("-inf")
    assert torch.equal(out[0], masked[0])
    assert torch.equal(out[1:, : VOCAB.speech_offset], logits[1:, : VOCAB.speech_offset])
    windows = {1: [3, 9, FILL, 3, 12, 12, 40], 2: [3, 12, 12, 40]}
    for row, window in windows.items():
        p, k, win, tau = rules[row].ras
        recent = torch.tensor([window + [-1] * (win - len(window))])
        expected = ras_log_probs(
            masked[row, SPEECH][None], recent, torch.tensor([p]), torch.tensor([k]), torch.tensor([win * tau])
        )[0]
        got = out[row, SPEECH]
        finite = expected.isfinite()
        assert torch.equal(got.isfinite(), finite)
        assert (got[finite] - expected[finite]).abs().max().item() < 1e-6
        assert abs(got.exp().sum().item() - 1) < 1e-5
        assert got.exp()[12] < masked[row, SPEECH].softmax(0)[12]  # a repeated likely class loses mass


def test_logits_processor_follows_the_batch_rows(vllm_model) -> None:
    """A rule follows its request through vLLM's row changes: removed, reused, swapped, moved."""
    processor = logits_processor(vllm_model)
    fill_round, eos_round, final_round = rule(FILL_ID), rule(eos=True), rule(EOS_ID + 1, FILL_ID)
    # closed classes of each rule
    FILL_ROUND, EOS_ROUND, FINAL_ROUND, NONE = {EOS, EOS + 1}, {EOS + 1, FILL}, {EOS}, set()
    processor.update_state(BatchUpdate(batch_size=3, added=[added(0, fill_round), added(1, eos_round), added(2, None)]))
    assert masked_specials(processor, 3) == [FILL_ROUND, EOS_ROUND, NONE]

    processor.update_state(BatchUpdate(batch_size=3, moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert masked_specials(processor, 3) == [EOS_ROUND, FILL_ROUND, NONE]

    processor.update_state(BatchUpdate(batch_size=3, moved=[(0, 2, MoveDirectionality.UNIDIRECTIONAL)]))
    assert masked_specials(processor, 3) == [NONE, FILL_ROUND, EOS_ROUND]

    processor.update_state(BatchUpdate(batch_size=2, removed=[1]))
    assert masked_specials(processor, 3) == [NONE, NONE, EOS_ROUND]

    # a freed row is reused in the same step (removed before added), then the batch condenses
    processor.update_state(
        BatchUpdate(
            batch_size=2,
            removed=[0],
            added=[(0, params(final_round), [], [])],
            moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)],
        )
    )
    assert masked_specials(processor, 3) == [FINAL_ROUND, EOS_ROUND, NONE]

    # a request without a rule (or without params) taking a row over clears the old rule
    processor.update_state(BatchUpdate(batch_size=2, added=[added(0, None), (1, None, [], [])]))
    assert masked_specials(processor, 2) == [NONE, NONE]
    logits = torch.randn(2, VOCAB.size)
    assert torch.equal(processor.apply(logits.clone()), logits)


def test_logits_processor_skips_rows_beyond_the_logits(vllm_model) -> None:
    """Rules of rows the step's logits do not have are ignored, ras rows included."""
    processor = logits_processor(vllm_model)
    processor.update_state(
        BatchUpdate(
            batch_size=4,
            added=[added(0, rule(FILL_ID)), added(3, rule(eos=True, ras=(0.8, 25, 10, 0.1), history=(1, 2)))],
        )
    )
    assert masked_specials(processor, 2) == [{EOS, EOS + 1}, set()]
    assert masked_specials(processor, 4) == [{EOS, EOS + 1}, set(), set(), {EOS + 1, FILL}]


def test_logits_processor_with_every_ruled_row_beyond_the_logits(vllm_model) -> None:
    """Logits with fewer rows than the lowest ruled row come back unchanged (an empty mask
    of shape [0] would not broadcast against the [0, 3] specials slice)."""
    processor = logits_processor(vllm_model)
    processor.update_state(BatchUpdate(batch_size=4, added=[added(2, rule(FILL_ID)), added(3, rule(eos=True))]))
    logits = torch.randn(2, VOCAB.size)
    assert torch.equal(processor.apply(logits.clone()), logits)


def test_the_engine_core_starts_with_its_mps_client_settings(monkeypatch) -> None:
    """vLLM's engine core, a process started inside ``AsyncLLM.from_engine_args``, inherits
    the MPS client settings; the gateway's own environment (its token2wav stage's CUDA
    client) is as before once the engine has started."""
    from tts_gateway.engine.cosyvoice2.serving import startup
    from tts_gateway.engine.cosyvoice2.serving.lm import vllm_plugin

    seen = {}

    class FakeAsyncLLM:
        @staticmethod
        def from_engine_args(args, stat_loggers):
            seen.update({name: os.environ.get(name) for name in MPS_NAMES})
            return "engine"

    module = types.ModuleType("vllm.v1.engine.async_llm")
    module.AsyncLLM = FakeAsyncLLM
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", module)
    monkeypatch.setattr(lm_vllm, "engine_args", lambda settings, path: None)
    monkeypatch.setattr(lm_vllm, "_stat_logger", lambda counters: None)
    monkeypatch.setattr(vllm_plugin, "register", lambda: None)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # start_engine's default, restored after
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "80")  # the operator's, for both stages
    monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "0")  # so that teardown restores the variable as it was
    monkeypatch.delenv("CUDA_MPS_CLIENT_PRIORITY")

    settings = VLLMSettings(mps_priority="below-normal", mps_thread_percentage=40)
    assert lm_vllm.start_engine(settings, "model", lm_vllm.LLMStageCounters()) == "engine"
    assert seen == {"CUDA_MPS_CLIENT_PRIORITY": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}
    assert {name: os.environ.get(name) for name in MPS_NAMES} == {
        "CUDA_MPS_CLIENT_PRIORITY": None, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "80"
    }
    # MPS's defaults add nothing: the operator's environment reaches the engine core as it is.
    lm_vllm.start_engine(VLLMSettings(), "model", lm_vllm.LLMStageCounters())
    assert seen == {"CUDA_MPS_CLIENT_PRIORITY": None, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "80"}
    # token2wav below normal: the gateway's process holds it (set before its CUDA context), the
    # engine core started inside gets vLLM's own priority, and the gateway keeps its own after.
    token2wav_low = VLLMSettings(token2wav_mps_priority="below-normal")
    startup.set_token2wav_mps_client(token2wav_low)
    lm_vllm.start_engine(token2wav_low, "model", lm_vllm.LLMStageCounters())
    assert seen["CUDA_MPS_CLIENT_PRIORITY"] == "0" and os.environ["CUDA_MPS_CLIENT_PRIORITY"] == "1"


def test_token2wav_mps_priority_is_the_gateway_process_s_and_not_the_engine_core_s(monkeypatch) -> None:
    """With token2wav's priority below normal, the gateway's process holds it before its CUDA
    context, and vLLM's engine core, which would inherit it, gets its own: normal, or below normal
    too when both are asked for."""
    from tts_gateway.engine.cosyvoice2.serving import startup

    monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "0")  # so that teardown restores the variable as it was
    monkeypatch.delenv("CUDA_MPS_CLIENT_PRIORITY")
    settings = VLLMSettings(token2wav_mps_priority="below-normal")
    startup.set_token2wav_mps_client(settings)
    assert os.environ["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert settings.engine_core_environment() == {"CUDA_MPS_CLIENT_PRIORITY": "0"}
    both = VLLMSettings(token2wav_mps_priority="below-normal", mps_priority="below-normal")
    assert both.engine_core_environment() == {"CUDA_MPS_CLIENT_PRIORITY": "1"}
    # MPS's default adds nothing to either process.
    monkeypatch.delenv("CUDA_MPS_CLIENT_PRIORITY")
    startup.set_token2wav_mps_client(VLLMSettings())
    assert "CUDA_MPS_CLIENT_PRIORITY" not in os.environ


MPS_NAMES = ("CUDA_MPS_CLIENT_PRIORITY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


async def test_bench_llm_burst_times_each_turn_and_its_round_boundaries(plain_inputs) -> None:
    """bench/llm_burst.py drives the stage as the gateway does: turns opened at once, each
    timed to its first-chunk marks, its gaps split at the ends of its rounds (of 15 here)."""
    from bench import llm_burst

    stage = stage_on(StreamingInputEngine(random_model(seed=2)), greedy=False)
    level = await llm_burst.run_level(stage, 3, PROMPT_TEXT, PROMPT_SPEECH, TEXT[:20], tokens=40)
    assert level["turns"] == 3
    assert level["token_13_ms"]["n"] == level["token_38_ms"]["n"] == 3
    assert level["gap_at_round_ms"]["n"] >= 3 * 2  # rounds end at 15 and 30 tokens, or sooner at fill
    assert level["gap_in_round_ms"]["n"] > 0
    assert stage.running() == 0  # every turn cancelled once timed
    # The same turns in one round each: no round ends; a request still running once its turn is
    # timed is aborted (a random model may end a round early by one of its stop classes).
    engine = StreamingInputEngine(random_model(seed=2))
    offline = await llm_burst.run_level(stage_on(engine, greedy=False), 3, PROMPT_TEXT, PROMPT_SPEECH, TEXT[:20],
                                        tokens=30, mode="offline")
    assert offline["mode"] == "offline" and offline["first_token_ms"]["n"] == 3
    assert offline["gap_at_round_ms"] is None and offline["gap_in_round_ms"]["n"] > 0
    assert engine.aborted and len(engine.aborted) + len(engine.finished) == 3
    with pytest.raises(ValueError, match="mode is one of"):
        await llm_burst.run_level(stage, 1, PROMPT_TEXT, PROMPT_SPEECH, TEXT[:20], tokens=5, mode="batch")


def test_bench_llm_burst_splits_gaps_at_round_ends() -> None:
    from bench import llm_burst

    turn = llm_burst.TurnTimes(arrivals=[(0.1, 1), (0.2, 2), (0.5, 3), (0.6, 5)], round_ends=[2, 5])
    assert turn.reached(3) == 0.5 and turn.reached(6) is None
    inside, across = turn.gaps()
    assert inside == pytest.approx([0.1, 0.1]) and across == pytest.approx([0.3])
    level = llm_burst.summarize([turn], steps=10, tokens=25, seconds=2.0)
    assert level["gap_at_round_ms"] == {"n": 1, "p50": pytest.approx(300.0), "p95": pytest.approx(300.0)}
    assert (level["steps_per_s"], level["tokens_per_step"]) == (5.0, 2.5)
    assert llm_burst.summarize([], steps=0, tokens=0, seconds=0)["tokens_per_step"] is None


@pytest.mark.parametrize("pipelined", [False, True], ids=["stage-warm-up", "one-input-warm-up"])
async def test_bench_llm_burst_warms_pipelined_levels_up_with_one_input_turns(
    plain_inputs, monkeypatch, tmp_path, pipelined
) -> None:
    """With --async-scheduling the stage starts without its bistream warm-up, which pipelined
    scheduling cannot serve, and each turn count runs one untimed offline level first."""
    from bench import llm_burst
    from tts_gateway.engine.cosyvoice2.serving import startup

    started = []

    async def start_stage(settings):
        started.append(settings.vllm)
        engine = StreamingInputEngine(random_model(seed=2))
        engine.shutdown = lambda: None
        return stage_on(engine, greedy=False)

    levels_run = []
    run_level = llm_burst.run_level

    async def counted_level(stage, turns, *args):
        levels_run.append((turns, args[-1]))
        return await run_level(stage, turns, *args)

    monkeypatch.setattr(startup, "start_vllm_stage", start_stage)
    monkeypatch.setattr(llm_burst, "run_level", counted_level)
    (tmp_path / "README.md").write_text("a model directory stand-in")  # no checkpoint made
    argv = ["--model-dir", str(tmp_path), "--turns", "2", "--repeats", "1", "--tokens", "10", "--modes", "offline",
            "--prompt-text", "3", "--prompt-speech", "6", "--text-tokens", "8"]
    report = await llm_burst.main(llm_burst.parse_arguments(argv + (["--async-scheduling"] if pipelined else [])))
    assert started[0].async_scheduling is pipelined
    assert (started[0].warmup_batch_sizes == ()) is pipelined
    assert levels_run == [(2, "offline")] * (2 if pipelined else 1)
    assert [(level["turns"], level["mode"]) for level in report["levels"]] == [(2, "offline")]


def test_bench_llm_burst_runs_pipelined_scheduling_on_one_input_requests_only() -> None:
    """--async-scheduling (vLLM's pipelined scheduling, which cannot serve rounds given one after
    another) is refused for bistream levels and taken for offline ones."""
    from bench import llm_burst

    with pytest.raises(SystemExit):
        llm_burst.parse_arguments(["--async-scheduling"])
    assert llm_burst.parse_arguments(["--async-scheduling", "--modes", "offline"]).async_scheduling is True
    assert llm_burst.parse_arguments([]).async_scheduling is False
