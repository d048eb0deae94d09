"""The vLLM backend's CPU-checkable parts: the converted model directory, the round
translation, repetition-aware sampling as one distribution, and the streaming-input
driver, run against an engine that follows vLLM's streaming-input rules on the
plain-torch model and compared token for token with the plain-torch backend.

The rules the stand-in engine follows are vLLM 0.26's (v1 scheduler,
``_update_request_as_session``): each input appends its prompt ids to the request's
context; a round samples until a stop token or ``max_tokens``; the last sampled token of
a round is dropped from the context before the next input. The real vLLM is checked
against the plain-torch backend on the GPU (bench/gpu_check.sh).
"""

from __future__ import annotations

import asyncio
import collections
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from engine.cosyvoice2 import lm_vllm
from engine.cosyvoice2.checkpoint import make_checkpoint
from engine.cosyvoice2.llm import Chunk, CosyVoice2LM, LLMConfig, TorchLMBackend, offline_chunk
from engine.cosyvoice2.sampling import SamplingConfig, greedy_sampling, ras_log_probs, ras_sampling
from engine.cosyvoice2.vllm_convert import ARCHITECTURE, convert
from engine.cosyvoice2.vllm_rounds import RoundRule, RoundTracker, round_request
from engine.cosyvoice2.yamlconf import load_model_configs
from engine.settings import VLLMSettings
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
    request = round_request(bistream, VOCAB, sampling, list(range(30)), 500)
    assert request.prompt_token_ids == list(bistream.ids)
    assert request.stop_token_ids == [VOCAB.speech(FILL)]
    assert request.max_tokens == 16  # the 16th is sampled only to end the round
    assert request.rule.allowed_specials(0) == (VOCAB.speech(FILL),)  # no eos, no unused class
    assert request.rule.history == tuple(range(20, 30))  # the ras window only
    assert RoundRule.from_extra_args(request.rule.to_extra_args()) == request.rule

    final = Chunk(ids=(VOCAB.task_id,), stop=frozenset({EOS}), final=True)
    request = round_request(final, VOCAB, None, [1, 2], 321)
    assert request.max_tokens == 321 and request.rule.ras is None and request.rule.history == ()
    assert request.rule.allowed_specials(0) == (VOCAB.speech(EOS),)

    offline = offline_chunk(VOCAB, [1, 2, 3], [4], [7, 8])
    request = round_request(offline, VOCAB, sampling, [], 100)
    assert request.rule.allowed_specials(5) == (VOCAB.speech(EOS + 1), VOCAB.speech(FILL))  # eos waits
    assert VOCAB.speech(EOS) in request.rule.allowed_specials(6)
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
        self.round_ends: list[str] = []  # per round: "fill", "eos" or "length"

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
        try:
            async for request, greedy in inputs:
                context += request.prompt_token_ids
                sampled: list[int] = []
                while True:
                    token = self.sample(request.rule, context, sampled, greedy)
                    sampled.append(token)
                    reason = "stop" if token in request.stop_token_ids else None
                    if reason is None and len(sampled) == request.max_tokens:
                        reason = "length"
                    yield SimpleNamespace(
                        outputs=[SimpleNamespace(token_ids=[token], finish_reason=reason)], finished=False
                    )
                    if reason is not None:
                        stopped_by = {self.vocab.speech(FILL): "fill", self.vocab.speech(EOS): "eos"}.get(token)
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
    ("fill_bias", "round_end"), [(0.0, "length"), (3.0, "fill")], ids=["rounds-end-at-budget", "rounds-end-at-fill"]
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
    from engine.base import EngineError
    from engine.cosyvoice2.engine import CosyVoice2Engine
    from engine.settings import CosyVoice2Settings

    engine = CosyVoice2Engine(CosyVoice2Settings(model_dir=str(tiny_dir), device="cpu", llm_backend="vllm"))
    with pytest.raises(EngineError, match="needs a CUDA GPU"):
        await engine.start()
