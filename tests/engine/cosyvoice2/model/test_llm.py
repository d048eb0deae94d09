"""CosyVoice2 LLM stage (engine/cosyvoice2/model/llm.py, sampling.py) against the official Qwen2LM.

Both sides get the same random weights (the official state dict, loaded strictly into
ours, and back), the same inputs and the same sampler. The official module is used
unmodified; two things of its environment are adapted on the *instance* (see
``official_lm``): under transformers 5 its incremental decoding masks the cache away and
its bistream code cannot index the cache.

Measured max abs error against the official module: full-sequence logits exactly 0 (the
same HF Qwen2 kernels); per-step log-probabilities of incremental decoding <= 3e-6
(float32 rounding: the reference passes an explicit all-ones mask, ours none, and ours
runs a token deferred at a round's budget together with the next round's ids). The
assertions allow 1e-4. Token sequences and every sampler call (greedy with scripted
events, and seeded repetition-aware sampling) are identical.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from transformers import DynamicCache, Qwen2ForCausalLM

from tts_gateway.engine.cosyvoice2.model.llm import OFFICIAL_TARGET, CosyVoice2LM, load_llm, qwen2_config
from tts_gateway.engine.cosyvoice2.modeldir.configs import LLMConfig, UnifiedVocab
from tts_gateway.engine.cosyvoice2.serving.lm.planner import BistreamPlanner, Chunk, offline_chunk
from tts_gateway.engine.cosyvoice2.serving.lm.torch_stage import TorchLMBackend
from tts_gateway.engine.cosyvoice2.serving.lm.sampling import (
    greedy_sampling,
    make_sampler,
    nucleus_sampling,
    random_sampling,
    ras_sampling,
)
from tests.reference import official, randomize_lm

# The reference passes the deprecated ``past_key_values`` name on every step.
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

TOLERANCE = 1e-4
# Scores are compared within TOLERANCE plus float32 rounding at their own magnitude: the
# tests bias some classes by -1e4, where one float32 ulp is 2**-10, so an absolute bound
# alone would hold on one CPU's kernels (AVX-512) and fail on another's (AVX2) for a
# difference of one ulp in a class that is never drawn. 1e-6 is about 8 ulps relative.
RELATIVE_TOLERANCE = 1e-6
TINY = LLMConfig.tiny()
VOCAB = TINY.vocab
S = TINY.speech_token_size
EOS, UNUSED, FILL = S, S + 1, S + 2


# ---------------------------------------------------------------------------------------
# Building both sides


class IndexableCache(DynamicCache):
    """transformers 5 caches are not indexable; the reference reads ``cache[0][0].size(2)``."""

    def __getitem__(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.layers[layer].keys, self.layers[layer].values


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 for the reference's ``Qwen2ForCausalLM.from_pretrained``."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    torch.manual_seed(0)
    Qwen2ForCausalLM(qwen2_config(TINY)).save_pretrained(path)
    return path


def official_lm(qwen_dir: Path, state_dict: Mapping[str, Tensor] | None = None) -> nn.Module:
    """The reference Qwen2LM on the tiny backbone, with its environment adapted on the instance.

    Offline, the reference's ``forward_one_step`` gets an all-ones mask as long as the *new*
    inputs only. transformers 4 applied a 2-D mask shorter than the keys to the first keys
    (all ones: no effect); transformers 5 pads it with False, so each decoding step would
    attend to the first position only (measured on a tiny model: 0.07 log-prob error from
    the second step on). The wrapper passes the all-ones mask of the full length, "no
    padding" in both versions, as the reference's bistream code already does. The cache
    it starts with is indexable (``IndexableCache``).
    """
    module = official("cosyvoice.llm.llm")
    encoder = module.Qwen2Encoder(str(qwen_dir))
    reference_step = type(encoder).forward_one_step

    def forward_one_step(xs: Tensor, masks: Tensor, cache: DynamicCache | None = None):
        cache = IndexableCache() if cache is None else cache
        length = cache.get_seq_length() + xs.shape[1]
        full = torch.ones(1, length, length, dtype=torch.bool, device=xs.device)
        return reference_step(encoder, xs, full, cache)

    encoder.forward_one_step = forward_one_step
    lm = module.Qwen2LM(
        llm_input_size=TINY.llm_input_size,
        llm_output_size=TINY.llm_output_size,
        speech_token_size=TINY.speech_token_size,
        llm=encoder,
        sampling=None,
        length_normalized_loss=TINY.length_normalized_loss,
        lsm_weight=TINY.lsm_weight,
        mix_ratio=list(TINY.mix_ratio),
    )
    if state_dict is not None:
        lm.load_state_dict(state_dict, strict=True)
    return lm.eval()


def randomized_state(qwen_dir: Path, seed: int) -> dict[str, Tensor]:
    """The official LM's state, every parameter random (tests/reference.py ``randomize_lm``)."""
    lm = randomize_lm(official_lm(qwen_dir), seed)
    return {k: v.clone() for k, v in lm.state_dict().items()}


def with_bias(state: Mapping[str, Tensor], **shifts: float) -> dict[str, Tensor]:
    """The state with ``llm_decoder.bias`` shifted for eos / unused / fill (same for both sides)."""
    state = dict(state)
    bias = state["llm_decoder.bias"].clone()
    for name, shift in shifts.items():
        bias[{"eos": EOS, "unused": UNUSED, "fill": FILL}[name]] += shift
    state["llm_decoder.bias"] = bias
    return state


def ours_from(state: Mapping[str, Tensor]) -> CosyVoice2LM:
    model = CosyVoice2LM(TINY)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def state(qwen_dir: Path) -> dict[str, Tensor]:
    return randomized_state(qwen_dir, seed=1)


def ids(seed: int, n: int, high: int) -> list[int]:
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def row(values: Sequence[int]) -> Tensor:
    return torch.tensor([list(values)], dtype=torch.long)


def length(values: Sequence[int]) -> Tensor:
    return torch.tensor([len(values)], dtype=torch.int32)


def run_official_offline(lm: nn.Module, text, prompt_text, prompt_speech, **kwargs) -> list[int]:
    return list(
        lm.inference(
            text=row(text),
            text_len=length(text),
            prompt_text=row(prompt_text),
            prompt_text_len=length(prompt_text),
            prompt_speech_token=row(prompt_speech),
            prompt_speech_token_len=length(prompt_speech),
            embedding=torch.zeros(1, 0),
            **kwargs,
        )
    )


def run_official_bistream(lm: nn.Module, pieces: Iterable[Sequence[int]], prompt_text, prompt_speech) -> list[int]:
    return list(
        lm.inference_bistream(
            text=(row(piece) for piece in pieces),
            prompt_text=row(prompt_text),
            prompt_text_len=length(prompt_text),
            prompt_speech_token=row(prompt_speech),
            prompt_speech_token_len=length(prompt_speech),
            embedding=torch.zeros(1, 0),
        )
    )


class Script:
    """A deterministic test sampler shared by both sides; it logs every call.

    Greedy, except for scripted events: ``forced`` maps a call number to the class to
    return; ``fill_first_in_rounds``: return fill at the first call of these bistream
    rounds (the round number is the count of fills in the history, which both sides keep);
    once the text stream has ended (``text_ended``), fill is left out of the argmax and eos
    is returned from the ``final_eos_after``-th final call on.
    """

    def __init__(
        self,
        forced: Mapping[int, int] | None = None,
        fill_first_in_rounds: Iterable[int] = (),
        final_eos_after: int | None = None,
    ) -> None:
        self.forced = dict(forced or {})
        self.fill_first_in_rounds = set(fill_first_in_rounds)
        self.final_eos_after = final_eos_after
        self.text_ended = False
        self.final_calls = 0
        self.calls: list[tuple[int, tuple[int, ...]]] = []  # (returned class, history seen)
        self.scores: list[Tensor] = []

    MAX_CALLS = 1000  # a run that never stops fails quickly instead of at the test timeout

    def __call__(self, scores: Tensor, decoded: Sequence[int]) -> int:
        call = len(self.calls)
        assert call < self.MAX_CALLS, "the run does not stop"
        starts_round = not decoded or decoded[-1] == FILL
        if call in self.forced:
            choice = self.forced[call]
        elif self.text_ended:
            self.final_calls += 1
            eos_due = self.final_eos_after is not None and self.final_calls > self.final_eos_after
            choice = EOS if eos_due else greedy_sampling(scores[:FILL])
        elif starts_round and list(decoded).count(FILL) in self.fill_first_in_rounds:
            choice = FILL
        else:
            choice = greedy_sampling(scores)
        self.calls.append((choice, tuple(decoded)))
        self.scores.append(scores.detach().clone())
        return choice

    def official(self):
        """The reference's sampling signature: (scores, decoded, top_k) -> 1-element tensor."""
        return lambda scores, decoded, sampling: torch.tensor([self(scores, decoded)])

    def pieces(self, pieces: Iterable[Sequence[int]]) -> Iterator[Sequence[int]]:
        """The text stream; the sampler learns when it has ended."""
        yield from pieces
        self.text_ended = True


class TracingBackend(TorchLMBackend):
    """Ours, recording each round: its plan and the tokens it emitted."""

    def __init__(self, model: CosyVoice2LM, sampler) -> None:
        super().__init__(model, sampler)
        self.rounds: list[tuple[Chunk, list[int]]] = []

    def run(self, chunk: Chunk, history: list[int]) -> Iterator[int]:
        self.rounds.append((chunk, []))
        for token in super().run(chunk, history):
            self.rounds[-1][1].append(token)
            yield token


def assert_same_run(ref: Script, ours: Script, ref_tokens: list[int], our_tokens: list[int]) -> float:
    """Same tokens, same sampler calls (results and the histories passed), and the same scores
    within TOLERANCE plus RELATIVE_TOLERANCE of their magnitude; returns the max score error
    beyond that relative part (<= TOLERANCE)."""
    assert our_tokens == ref_tokens
    assert ours.calls == ref.calls
    error = max(
        ((a - b).abs() - RELATIVE_TOLERANCE * a.abs()).max().item()
        for a, b in zip(ref.scores, ours.scores, strict=True)
    )
    assert error <= TOLERANCE
    return error


# ---------------------------------------------------------------------------------------
# Configuration, vocabulary, loading


def test_config_names_follow_the_official_yaml() -> None:
    module_path, _, class_name = OFFICIAL_TARGET.rpartition(".")
    assert class_name in vars(official(module_path))
    full = LLMConfig.full()
    assert (full.llm_input_size, full.llm_output_size, full.speech_token_size) == (896, 896, 6561)
    assert full.mix_ratio == (5, 15)
    assert (full.sampling.top_p, full.sampling.top_k, full.sampling.win_size, full.sampling.tau_r) == (0.8, 25, 10, 0.1)
    qwen = qwen2_config(full)
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads) == (
        896, 24, 14, 2,
    )
    assert qwen.vocab_size == 151936 and qwen.tie_word_embeddings
    assert qwen2_config(TINY).vocab_size == 1024 and TINY.speech_token_size == 6561


def test_unified_vocab_mapping(state: dict[str, Tensor]) -> None:
    vocab = UnifiedVocab(text_vocab_size=1024, speech_token_size=6561)
    assert vocab == VOCAB
    assert (vocab.sos_eos, vocab.task_id, vocab.speech_offset) == (1024, 1025, 1026)
    assert (vocab.eos_class, vocab.fill_class, vocab.num_speech_classes) == (6561, 6563, 6564)
    assert vocab.size == 1024 + 2 + 6564
    assert vocab.speech(0) == 1026 and vocab.speech(FILL) == vocab.size - 1
    assert vocab.speech_class(vocab.speech(1234)) == 1234
    assert vocab.text([0, 1023]) == [0, 1023]
    for bad in (lambda: vocab.speech(6564), lambda: vocab.speech_class(1025), lambda: vocab.text([1024])):
        with pytest.raises(ValueError):
            bad()

    model = ours_from(state)
    unified = torch.tensor([[0, 1023, 1024, 1025, 1026, 1026 + 6561, vocab.size - 1, 7]])
    expected = torch.stack(
        [
            model.llm.model.model.embed_tokens.weight[0],
            model.llm.model.model.embed_tokens.weight[1023],
            model.llm_embedding.weight[0],
            model.llm_embedding.weight[1],
            model.speech_embedding.weight[0],
            model.speech_embedding.weight[6561],
            model.speech_embedding.weight[6563],
            model.llm.model.model.embed_tokens.weight[7],
        ]
    )
    assert torch.equal(model.embed(unified)[0], expected)
    # the head scores the speech classes
    assert model.llm_decoder.out_features == vocab.num_speech_classes
    with pytest.raises(IndexError):
        model.embed(torch.tensor([vocab.size]))


def test_strict_loading_both_ways(qwen_dir: Path, state: dict[str, Tensor]) -> None:
    ours = ours_from(state)  # official -> ours, strict
    ours_state = ours.state_dict()
    assert list(ours_state) == list(state)
    for key, value in state.items():
        assert torch.equal(ours_state[key], value), key
    back = official_lm(qwen_dir, ours_state)  # ours -> official, strict
    for key, value in back.state_dict().items():
        assert torch.equal(value, state[key]), key
    # the backbone's lm_head is tied to the text embedding, as in the reference
    assert ours.llm.model.lm_head.weight is ours.llm.model.model.embed_tokens.weight


def test_full_size_keys_and_shapes_match_official(qwen_dir: Path) -> None:
    module = official("cosyvoice.llm.llm")
    encoder = module.Qwen2Encoder(str(qwen_dir))  # built tiny, then given the real backbone
    full = LLMConfig.full()
    with torch.device("meta"):
        encoder.model = Qwen2ForCausalLM(qwen2_config(full))
        reference = module.Qwen2LM(896, 896, 6561, encoder, None, mix_ratio=[5, 15])
        ours = CosyVoice2LM(full)
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert shapes["llm.model.lm_head.weight"] == (151936, 896)
    assert shapes["llm_decoder.weight"] == (6564, 896) and shapes["speech_embedding.weight"] == (6564, 896)
    assert len([k for k in shapes if k.endswith("self_attn.q_proj.bias")]) == 24
    assert 500e6 < sum(p.numel() for p in ours.parameters()) < 510e6  # tied: counted once


def test_load_llm_from_a_model_directory(tmp_path: Path, state: dict[str, Tensor]) -> None:
    """The official layout (llm.pt + CosyVoice-BlankEN/config.json) loads without a random init."""
    (tmp_path / "CosyVoice-BlankEN").mkdir()
    qwen2_config(TINY).to_json_file(tmp_path / "CosyVoice-BlankEN" / "config.json")
    torch.save(state, tmp_path / "llm.pt")
    loaded = load_llm(tmp_path, llm_input_size=64, llm_output_size=64)
    built = ours_from(state)
    unified = torch.tensor([[VOCAB.sos_eos, 3, 5, VOCAB.task_id, VOCAB.speech(9), VOCAB.speech(40)]])
    with torch.no_grad():
        assert torch.equal(loaded(loaded.embed(unified)), built(built.embed(unified)))
    assert loaded.llm.model.lm_head.weight is loaded.llm.model.model.embed_tokens.weight
    untied = dict(state, **{"llm.model.lm_head.weight": state["llm.model.lm_head.weight"] + 1})
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        CosyVoice2LM.from_state_dict(TINY, untied)


# ---------------------------------------------------------------------------------------
# Equivalence with the official Qwen2LM


def test_equivalence_llm_logits(qwen_dir: Path, state: dict[str, Tensor]) -> None:
    """Per-step log-probabilities of offline decoding, and full-sequence logits."""
    text, prompt_text, prompt_speech = ids(1, 6, 1024), ids(2, 4, 1024), ids(3, 9, S)
    state = with_bias(state, unused=-1e4, fill=-1e4)  # see test_equivalence_llm_offline_greedy
    reference, ours = official_lm(qwen_dir, state), ours_from(state)
    ref_script, our_script = Script(), Script()
    reference.sampling = ref_script.official()
    ref_tokens = run_official_offline(reference, text, prompt_text, prompt_speech, max_token_text_ratio=4)
    our_tokens = list(
        TorchLMBackend(ours, our_script).generate_offline(text, prompt_text, prompt_speech, max_token_text_ratio=4)
    )
    assert len(ref_tokens) == 24  # ran to max_len (eos is never the argmax here)
    step_error = assert_same_run(ref_script, our_script, ref_tokens, our_tokens)

    # Teacher-forced: the reference's batch forward (Qwen2Encoder.forward + llm_decoder) on
    # the same embeddings, against ours over unified ids.
    sequence = list(offline_chunk(VOCAB, text, prompt_text, prompt_speech).ids) + [VOCAB.speech(t) for t in our_tokens]
    unified = torch.tensor([sequence])
    with torch.no_grad():
        embeds = torch.cat(
            [
                reference.llm_embedding.weight[:1],
                reference.llm.model.model.embed_tokens(torch.tensor(prompt_text + text)),
                reference.llm_embedding.weight[1:],
                reference.speech_embedding(torch.tensor(prompt_speech + our_tokens)),
            ]
        )[None]
        hidden, _ = reference.llm(embeds, torch.tensor([embeds.shape[1]]))
        ref_logits = reference.llm_decoder(hidden)
        our_logits = ours(ours.embed(unified))
    assert torch.equal(ours.embed(unified), embeds)
    full_error = (ref_logits - our_logits).abs().max().item()
    assert full_error <= TOLERANCE
    print(f"max error: per-step log-probs {step_error:.2e} (beyond 1e-6 relative), full-sequence logits {full_error:.2e}")


def test_equivalence_llm_offline_greedy(qwen_dir: Path, state: dict[str, Tensor]) -> None:
    """Greedy offline decoding: eos refused below min_len, accepted at min_len, max_len.

    The reference torch path skips a sampled unused/fill class and feeds its last input
    again (upstream later stops there, as its vLLM path always did; so do we). Those two
    classes are biased out, so both sides stay on the path where they agree.
    """
    state = with_bias(state, unused=-1e4, fill=-1e4)
    text, prompt_text, prompt_speech = ids(4, 4, 1024), ids(5, 3, 1024), ids(6, 7, S)
    # min_len = 8. Calls: steps 0, 1; step 2 = eos (refused) + redraw; steps 3, 4;
    # step 5 = eos (refused) + redraw; steps 6, 7; step 8 = call 10: eos accepted.
    scenarios = [
        (text, prompt_text, prompt_speech, {2: EOS, 6: EOS, 10: EOS}, 8),
        (text[:1], [], [], {}, 20),  # no prompt, eos never chosen: stops at max_len = 20
    ]
    for text, prompt_text, prompt_speech, forced, expected_tokens in scenarios:
        reference, ours = official_lm(qwen_dir, state), ours_from(state)
        ref_script, our_script = Script(forced), Script(forced)
        reference.sampling = ref_script.official()
        ref_tokens = run_official_offline(reference, text, prompt_text, prompt_speech)
        our_tokens = list(TorchLMBackend(ours, our_script).generate_offline(text, prompt_text, prompt_speech))
        assert len(ref_tokens) == expected_tokens
        assert_same_run(ref_script, our_script, ref_tokens, our_tokens)


# With this fill bias the greedy model ends some rounds itself and runs others to the
# 15-token budget (measured on these weights: the rounds below are asserted).
FILL_BIAS = 2.5

BISTREAM_SCENARIOS = {
    # Prompt: 7 text tokens, 20 speech tokens = one full group and a partial one (5 of 15).
    # Text one token per piece, as the reference frontend streams it. Round 0 continues
    # the partial group (unbounded until the model's own fill), round 1 refuses an eos
    # (call 4) and ends with a fill of its own, round 2 hits the budget, round 3 is
    # scripted to stop at once, round 4 stops at once by itself; the final round starts
    # with round 4's text again (the reference's refeed), then 1 text token and task_id.
    "prompt, token by token": dict(
        prompt_text=ids(7, 7, 1024),
        prompt_speech=ids(8, 20, S),
        pieces=[[t] for t in ids(9, 24, 1024)],
        script=dict(forced={4: EOS}, fill_first_in_rounds={3}, final_eos_after=6),
        rounds=[(1 + 20 + 10, None, 2), (5, 15, 9), (5, 15, 15), (5, 15, 0), (5, 15, 0), (5 + 1 + 1, None, 6)],
    ),
    # No prompt; pieces of 3, 7, 1, 6, 2 tokens: at most one round per piece, the surplus
    # text waits (4 tokens are left for the final round). Round 0 runs past 15 (no fill
    # yet, so no budget), round 1 hits the budget; the final round starts with the last
    # speech token again.
    "no prompt, uneven pieces": dict(
        prompt_text=[],
        prompt_speech=[],
        pieces=[ids(10, 3, 1024), ids(11, 7, 1024), [5], ids(12, 6, 1024), [9, 8]],
        script=dict(final_eos_after=4),
        rounds=[(1 + 5, None, 17), (5, 15, 15), (5, 15, 10), (1 + 4 + 1, None, 4)],
    ),
    # The text ends before the prompt speech is used up: the rest of the prompt speech is
    # dropped and the planned context goes into the final round.
    "text ends inside the prompt": dict(
        prompt_text=ids(13, 2, 1024),
        prompt_speech=ids(14, 40, S),
        pieces=[[1], [2], [3, 4]],
        script=dict(final_eos_after=5),
        rounds=[(1 + 5 + 15 + 1 + 1, None, 5)],
    ),
}


@pytest.mark.parametrize("name", list(BISTREAM_SCENARIOS))
def test_equivalence_llm_bistream_greedy(qwen_dir: Path, state: dict[str, Tensor], name: str) -> None:
    scenario = BISTREAM_SCENARIOS[name]
    state = with_bias(state, eos=-1e4, unused=-1e4, fill=FILL_BIAS)
    reference, ours = official_lm(qwen_dir, state), ours_from(state)
    ref_script, our_script = Script(**scenario["script"]), Script(**scenario["script"])
    reference.sampling = ref_script.official()
    prompt_text, prompt_speech, pieces = scenario["prompt_text"], scenario["prompt_speech"], scenario["pieces"]
    ref_tokens = run_official_bistream(reference, ref_script.pieces(pieces), prompt_text, prompt_speech)
    backend = TracingBackend(ours, our_script)
    our_tokens = list(backend.generate_bistream(our_script.pieces(pieces), prompt_text, prompt_speech))
    assert_same_run(ref_script, our_script, ref_tokens, our_tokens)
    # the branches this scenario is meant to exercise were taken
    assert [(len(chunk.ids), chunk.max_tokens, len(emitted)) for chunk, emitted in backend.rounds] == scenario["rounds"]


# ---------------------------------------------------------------------------------------
# Sampling


def test_equivalence_llm_ras_sampling() -> None:
    """Same seed, same draws: nucleus, random and repetition-aware sampling, global RNG or a generator."""
    common = official("cosyvoice.utils.common")
    rng = torch.Generator().manual_seed(0)
    for case in range(40):
        scores = (torch.randn(6564, generator=rng) * (0.5 + case % 4)).log_softmax(0)
        top = scores.topk(3).indices.tolist()
        # histories with and without the likely classes, so the redraw happens sometimes
        decoded = ids(case, 12, 6564) + (top[: case % 3] if case % 2 else [])
        for seed in (case, case + 100):
            torch.manual_seed(seed)
            expected = [
                common.nucleus_sampling(scores, top_p=0.8, top_k=25).item(),
                common.random_sampling(scores, decoded, 25).item(),
                common.ras_sampling(scores, decoded, 25, top_p=0.8, top_k=25, win_size=10, tau_r=0.1).item(),
                common.ras_sampling(scores, decoded, 25, top_p=0.5, top_k=5, win_size=4, tau_r=0.5).item(),
            ]
            for generator in (None, torch.Generator().manual_seed(seed)):
                torch.manual_seed(seed)
                got = [
                    nucleus_sampling(scores, top_p=0.8, top_k=25, generator=generator),
                    random_sampling(scores, decoded, generator=generator),
                    ras_sampling(scores, decoded, generator=generator),
                    ras_sampling(scores, decoded, top_p=0.5, top_k=5, win_size=4, tau_r=0.5, generator=generator),
                ]
                assert got == expected, (case, seed)
    assert greedy_sampling(torch.tensor([0.0, 2.0, 2.0, 1.0])) == 1


def test_equivalence_llm_ras_generation(qwen_dir: Path, state: dict[str, Tensor]) -> None:
    """Whole runs with the shipped sampler and one seed: offline and bistream, token for token.

    eos is biased up so that it is drawn (and redrawn where it is not allowed), fill so
    that the model ends rounds itself. With seed 1 the bistream's final round draws fill,
    which both sides treat as an error, after the same tokens.
    """
    common = official("cosyvoice.utils.common")
    shipped = TINY.sampling

    def reference_with(state_dict: dict[str, Tensor]) -> nn.Module:
        reference = official_lm(qwen_dir, state_dict)
        # as the yaml builds it: !name:cosyvoice.utils.common.ras_sampling with the sampling kwargs
        reference.sampling = functools.partial(common.ras_sampling, **dataclasses.asdict(shipped))
        return reference

    text, prompt_text, prompt_speech = ids(15, 6, 1024), ids(16, 3, 1024), ids(17, 7, S)
    offline_state = with_bias(state, eos=4.0, unused=-1e4, fill=-1e4)
    reference, ours = reference_with(offline_state), ours_from(offline_state)
    for seed in range(3):
        torch.manual_seed(seed)
        ref_tokens = run_official_offline(reference, text, prompt_text, prompt_speech)
        torch.manual_seed(seed)
        backend = TorchLMBackend(ours, make_sampler(shipped))
        our_tokens = list(backend.generate_offline(text, prompt_text, prompt_speech))
        assert our_tokens == ref_tokens and len(our_tokens) >= 2 * len(text)

    scenario = BISTREAM_SCENARIOS["prompt, token by token"]
    bistream_state = with_bias(state, eos=4.0, unused=-1e4, fill=4.5)
    reference, ours = reference_with(bistream_state), ours_from(bistream_state)
    args = scenario["pieces"], scenario["prompt_text"], scenario["prompt_speech"]
    torch.manual_seed(0)
    ref_tokens = run_official_bistream(reference, *args)
    torch.manual_seed(0)
    backend = TracingBackend(ours, make_sampler(shipped))
    assert list(backend.generate_bistream(*args)) == ref_tokens
    ended_by_model = [len(emitted) < 15 for chunk, emitted in backend.rounds[1:-1]]
    assert any(ended_by_model) and not all(ended_by_model)  # fills drawn, and the budget reached

    torch.manual_seed(1)
    ref_tokens = []
    text_pieces = (row(piece) for piece in args[0])
    prompt = row(args[1]), length(args[1]), row(args[2]), length(args[2])
    with pytest.raises(ValueError, match="should not get token 6563"):
        for token in reference.inference_bistream(text_pieces, *prompt, torch.zeros(1, 0)):
            ref_tokens.append(token)
    torch.manual_seed(1)
    our_tokens = []
    with pytest.raises(RuntimeError, match="speech class 6563"):
        for token in TorchLMBackend(ours, make_sampler(shipped)).generate_bistream(*args):
            our_tokens.append(token)
    assert our_tokens == ref_tokens


# ---------------------------------------------------------------------------------------
# Our own behaviour


def test_offline_stops_on_fill_and_the_unused_class(state: dict[str, Tensor]) -> None:
    """Where the reference torch path feeds its last input again, we end the utterance."""
    text = ids(18, 3, 1024)
    for stop in (UNUSED, FILL):
        script = Script(forced={3: stop})
        tokens = list(TorchLMBackend(ours_from(state), script).generate_offline(text))
        assert len(tokens) == 3 and len(script.calls) == 4


def test_bistream_planner_layout() -> None:
    """The plan as unified ids, without a model: groups, budget, refeed and the options."""
    vocab = VOCAB
    prompt_text, prompt_speech = [11, 12, 13, 14, 15, 16], list(range(17))
    speech = [vocab.speech(s) for s in prompt_speech]
    planner = BistreamPlanner(vocab, prompt_text, prompt_speech)
    assert planner.push_text([21, 22, 23]) is None  # 9 text: one group; 2 prompt speech tokens wait
    first = planner.push_text([24])  # 5 text for the second group: the prompt is used up
    assert first is not None and first.ids == (
        vocab.sos_eos, 11, 12, 13, 14, 15, *speech[:15], 16, 21, 22, 23, 24, *speech[15:],
    )
    assert (first.stop, first.max_tokens, first.final) == (frozenset({FILL}), None, False)
    with pytest.raises(RuntimeError):
        planner.push_text([1])  # the open round must be reported first
    planner.round_done([7, 8])
    assert planner.push_text([31, 32, 33, 34]) is None
    second = planner.push_text([35, 36])
    assert second is not None and second.ids == (31, 32, 33, 34, 35) and second.max_tokens == 15
    planner.round_done([])  # stopped at once
    final = planner.finish()
    assert final.ids == (31, 32, 33, 34, 35, 36, vocab.task_id)
    assert (final.stop, final.max_tokens, final.final) == (frozenset({EOS}), None, True)

    # Training layout and upstream's later first-round budget: 15 - 17 % 15 = 13 tokens.
    planner = BistreamPlanner(
        vocab, prompt_text, prompt_speech, refeed_last_input=False, first_round_budget=True, final_max_tokens=50
    )
    planner.push_text([21, 22, 23])
    assert planner.push_text([24]).max_tokens == 13
    planner.round_done([7, 8])
    final = planner.finish()
    assert final.ids == (vocab.task_id,) and final.max_tokens == 50
    with pytest.raises(RuntimeError):
        planner.finish()

    # Offline: [sos, prompt text + text, task_id, prompt speech], eos below 2x text refused.
    chunk = offline_chunk(vocab, [1, 2, 3], [4], [5, 6])
    assert chunk.ids == (vocab.sos_eos, 4, 1, 2, 3, vocab.task_id, vocab.speech(5), vocab.speech(6))
    assert (chunk.min_tokens, chunk.max_tokens, chunk.final) == (6, 60, True)
    assert chunk.stop == frozenset({EOS, UNUSED, FILL})


def test_backend_budget_token_goes_into_the_next_round(state: dict[str, Tensor]) -> None:
    """A token emitted at the budget is run with the next round's ids: same logits as step by step."""
    model = ours_from(state)
    script = Script()
    backend = TorchLMBackend(model, script)
    backend.reset()
    history: list[int] = []
    round_ids = (VOCAB.sos_eos, 1, 2, 3, 4, 5)
    emitted = list(backend.run(Chunk(ids=round_ids, stop=frozenset({FILL}), max_tokens=3), history))
    assert len(emitted) == 3 and history == [*emitted, FILL]
    assert backend.context_length == len(round_ids) + 2  # the third token is not run yet
    logits = backend.append([6, 7])
    sequence = [*round_ids, *(VOCAB.speech(t) for t in emitted), 6, 7]
    with torch.no_grad():
        expected = model(model.embed(torch.tensor([sequence])))[0, -1]
    assert (logits - expected).abs().max().item() <= TOLERANCE


def test_serving_masks_classes_a_round_cannot_take():
    """A model that favours fill in the final round: the reference (and our exact mode)
    raise; the serving mode gives fill no probability there and the turn ends normally."""
    model = CosyVoice2LM(LLMConfig.tiny()).eval()
    with torch.no_grad():
        model.llm_decoder.bias.zero_()
        model.llm_decoder.bias[FILL] = 50.0  # fill always wins
        model.llm_decoder.bias[EOS] = 40.0  # then eos
    exact = TorchLMBackend(model, greedy_sampling)
    with pytest.raises(RuntimeError, match="cannot occur"):
        list(exact.generate_bistream([[1, 2, 3]], prompt_text=[4], prompt_speech=[]))
    serving = TorchLMBackend(model, greedy_sampling, mask_impossible=True)
    assert list(serving.generate_bistream([[1, 2, 3]], prompt_text=[4], prompt_speech=[])) == []
