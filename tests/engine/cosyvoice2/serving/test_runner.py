"""Streaming token2wav against the official streaming path, on one random tiny checkpoint.

The official ``CosyVoice2Model.tts(stream=True)`` runs its own chunk loop (first hop
padded to a 25-token boundary, 25-token hops, 3 look-ahead tokens, HiFT mel/source caches
and cross-fade). It gets its speech tokens from an LLM object; here that object replays a
fixed token list, so both sides vocode exactly the same tokens.
"""

from __future__ import annotations

import functools
import gc
import math
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import create_autospec

import numpy as np
import pytest
import torch

import dataclasses

from tts_gateway.engine.cosyvoice2.model.cfm import N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.model.loading import load_models
from tts_gateway.engine.cosyvoice2.serving import call_plan as call_plan_module
from tts_gateway.engine.cosyvoice2.serving import phase_clock
from tts_gateway.engine.cosyvoice2.serving import runner as runner_module
from tts_gateway.engine.cosyvoice2.serving.buckets import FlowBuckets
from tts_gateway.engine.cosyvoice2.serving.calls import Lane
from tts_gateway.engine.cosyvoice2.serving.chunking import ChunkSchedule, call_kind
from tts_gateway.engine.cosyvoice2.serving.flow_graphs import FlowGraphs
from tts_gateway.engine.cosyvoice2.serving.request import Request, RequestStatus, StreamState, VoicePrompt
from tts_gateway.engine.cosyvoice2.serving.encoder_graphs import EncoderGraphs
from tts_gateway.engine.cosyvoice2.serving.incremental_encoder_graphs import IncrementalEncoderGraphs
from tts_gateway.engine.cosyvoice2.serving.runner import Token2WavRunner
from tts_gateway.engine.cosyvoice2.serving.turn_pool import TurnStatePool
from tts_gateway.testkit.checkpoint import make_checkpoint
from tests.engine.cosyvoice2.flow_pairs import STEPS, official_steps
from tests.reference import official, official_modules


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("cv2") / "model", "tiny", seed=0)


@pytest.fixture(scope="module")
def models(tiny_dir):
    return load_models(tiny_dir, load_llm=False)


def make_runner(models, *, scale: int = 1, max_hop_len: int = 100, first_hop_len: int = 25, **options) -> Token2WavRunner:
    """The engine's token2wav runner (hop 25, as the official streaming) on the test model."""
    return Token2WavRunner.build(
        models.flow, models.hift, scale=scale, max_hop_len=max_hop_len, first_hop_len=first_hop_len, **options
    )


def stream(runner: Token2WavRunner, prompt: VoicePrompt, tokens=(), done: bool = False) -> Request:
    """A request of this voice holding ``tokens``; ``done``: they are all of its speech tokens."""
    status = RequestStatus.TOKENS_DONE if done else RequestStatus.INPUT_ENDED
    return Request(prompt, runner.new_stream(), None, status=status, tokens=list(tokens))


def voiced(seconds: float, rate: int) -> np.ndarray:
    """A prompt recording stand-in: a vowel-like harmonic tone with a slow pitch glide."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = 130 + 20 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    audio = sum(np.sin(k * phase) / k for k in range(1, 8))
    return (0.3 * audio / np.max(np.abs(audio))).astype(np.float32)


@pytest.fixture(scope="module")
def voice(models):
    return models.frontend.prepare(voiced(2.2, 24000), 24000, "A short prompt.")


class ReplayLLM:
    """Stands in for the official LLM: yields a fixed token list."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def inference(self, **_kwargs):
        yield from self.tokens


def official_stream(
    tiny_dir: Path, models, voice, tokens: list[int], final_attention: str = "full", flow_steps: int = N_TIMESTEPS
) -> list[np.ndarray]:
    """The official streaming loop's chunks; ``final_attention="chunk"``: its last chunk with the
    official flow in streaming mode too (``streaming=True, finalize=True``), the loop as released;
    the flow's decoder solving with ``flow_steps`` Euler steps (10 as released)."""
    configs = models.configs
    _, flow, hift = official_modules(configs.llm, configs.flow, configs.hift)
    flow.load_state_dict(torch.load(tiny_dir / "flow.pt", weights_only=True), strict=True)
    hift.load_state_dict(torch.load(tiny_dir / "hift.pt", weights_only=True), strict=True)
    flow.eval(), hift.eval()
    if final_attention == "chunk":
        released = flow.inference

        def streaming_inference(**kwargs):
            return released(**(kwargs | {"streaming": True}))

        flow.inference = streaming_inference
    model = official("cosyvoice.cli.model").CosyVoice2Model(ReplayLLM(tokens), flow, hift, fp16=False)
    model.llm = ReplayLLM(tokens)
    inputs = voice.model_input()
    torch.manual_seed(1234)
    with torch.inference_mode(), official_steps(flow, flow_steps):
        chunks = model.tts(
            text=torch.zeros(1, 3, dtype=torch.int32),
            flow_embedding=inputs["flow_embedding"],
            llm_embedding=inputs["llm_embedding"],
            prompt_text=inputs["prompt_text"],
            llm_prompt_speech_token=inputs["llm_prompt_speech_token"],
            flow_prompt_speech_token=inputs["flow_prompt_speech_token"],
            prompt_speech_feat=inputs["prompt_speech_feat"],
            stream=True,
        )
        return [c["tts_speech"][0].numpy() for c in chunks]


def our_stream(
    models, voice, tokens: list[int], incremental: bool, prefix_voices: int = 0, final_attention: str = "full",
    turn_state_pages: int = 0, flow_steps: int = N_TIMESTEPS, encoder_programs: bool = False,
) -> list[np.ndarray]:
    page = TurnStatePool.page_bytes(models.flow.decoder, torch.float32, flow_steps)
    token2wav = make_runner(
        models, scale=1, incremental=incremental, prefix_voices=prefix_voices, final_attention=final_attention,
        turn_state_bytes=(turn_state_pages + 1) * page if turn_state_pages else 0, flow_steps=flow_steps,
    )
    served = []  # what the encoder programs returned, call by call (None: the call went eager)
    if encoder_programs:
        programs = token2wav.token_encoder.graphs = IncrementalEncoderGraphs(token2wav.flow, 4, graphs=False)
        run = programs.run
        programs.run = lambda *args: served.append(run(*args)) or served[-1]
    state = stream(token2wav, VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding), tokens, done=True)
    torch.manual_seed(1234)
    chunks = []
    stored = []
    encoded = []  # tokens whose encoding the stream keeps (paged mode: its encoder state)
    fed = []  # tokens each paged call gave the token encoder
    if token2wav.token_encoder is not None:
        step = token2wav.token_encoder.step
        token2wav.token_encoder.step = lambda states, new, final: fed.append(len(new[0])) or step(states, new, final)
    while (job := token2wav.schedule.next_job(state)) is not None:
        chunks.append(token2wav.run([job])[0])
        stored.append(state.stream.turn.frames if state.stream.turn is not None else 0)
        encoded.append(state.stream.encoder.committed if state.stream.encoder is not None else 0)
        if state.stream.turn is not None and state.stream.turn.fell_back:
            assert state.stream.encoder is None  # dropped with the turn's pages: recompute from here
    if prefix_voices:  # the stream really started its decoder after a stored prefix (of flow_steps steps)
        assert len(token2wav.prefixes._slots) == 1
        assert token2wav.prefixes.bank.frames == 2 * ((voice.speech_tokens.shape[1] - 3) // 25 * 25) > 0
        assert token2wav.prefixes.bank.keys[0].shape[0] == flow_steps
    if turn_state_pages:  # ... and after its own stored chunks (where they fit), given back at its end
        pool = token2wav.turn_pool
        assert stored[-1] == 0 and pool.pages_in_use == 0
        assert pool.inputs[0].shape[0] == flow_steps * 2 * (pool.pages + 1)
        prefix_pages = -(-token2wav.prefixes.bank.frames // pool.page_frames)
        if turn_state_pages >= prefix_pages + len(tokens) * 2 // pool.page_frames + 2:
            assert stored[-2] >= 4 * 50 and pool.fallbacks == 0
            # The token encoder kept the turn's complete chunks (prompt and tokens) from call to
            # call, as far as the decoder's stored frames; both are given back at the end.
            assert encoded[-2] * 2 == stored[-2] + token2wav.flow.voice_prefix_frames(voice.speech_tokens.shape[1])
            # Each token once, but for the look-ahead and the incomplete chunk a call gives again
            # (a last chunk of full attention is no paged call).
            assert len(fed) == len(chunks) - (final_attention == "full")
            assert sum(fed) < voice.speech_tokens.shape[1] + len(tokens) + 28 * len(fed)
            assert fed[0] > voice.speech_tokens.shape[1] and max(fed[1:]) < fed[0]
        else:  # the turn fell back to recompute when it outgrew what the prefix left
            assert 0 < pool.peak_pages <= turn_state_pages - prefix_pages and pool.fallbacks > 0
        assert encoded[-1] == 0 and state.stream.encoder is None
    if encoder_programs:  # every paged call's encode by them, and counted
        assert served and None not in served and len(served) == len(fed)
        assert token2wav.work_totals()["flow_encoder_graph_calls"] == len(served)
    return chunks


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, 6561, (137,), generator=generator).tolist()


STREAMING_MODES = {
    "recompute": dict(incremental=False),
    "recompute-after-voice-prefix": dict(incremental=False, prefix_voices=2),
    "incremental": dict(incremental=True),
    "paged": dict(incremental=False, prefix_voices=2, turn_state_pages=64),
    "paged-pool-full": dict(incremental=False, prefix_voices=2, turn_state_pages=16),
    # The paged calls' token encodes by the programs of their CUDA graphs (run eagerly on a CPU).
    "paged-encoder-programs": dict(incremental=False, prefix_voices=2, turn_state_pages=64, encoder_programs=True),
}


@pytest.fixture(scope="module")
def official_chunks(tiny_dir, models, voice, tokens):
    """``official_stream`` of the test's tokens by (final_attention, flow_steps): run once for
    all the modes compared with it."""
    return functools.cache(functools.partial(official_stream, tiny_dir, models, voice, tokens))


@pytest.mark.parametrize("flow_steps", STEPS)
@pytest.mark.parametrize("final_attention", ["full", "chunk"])
@pytest.mark.parametrize("mode", list(STREAMING_MODES))
def test_equivalence_streaming(official_chunks, models, voice, tokens, mode, final_attention, flow_steps):
    """Every chunk equals the official streaming loop's, its last chunk with full attention
    (the released loop) or chunk-causal (the official flow's streaming mode), in every mode,
    the flow solving with the official 10 Euler steps or another number (flow_steps) on both
    sides."""
    reference = official_chunks(final_attention, flow_steps)
    ours = our_stream(
        models, voice, tokens, final_attention=final_attention, flow_steps=flow_steps, **STREAMING_MODES[mode]
    )
    assert [len(c) for c in ours] == [len(c) for c in reference]
    assert len(reference) >= 4  # first (padded) hop, full hops, the final flush
    error = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, reference))
    assert error <= 1e-4, error
    audio = np.concatenate(ours)
    assert len(audio) == len(tokens) * 2 * 480  # every token spoken, nothing duplicated at borders
    assert np.isfinite(audio).all() and np.abs(audio).max() > 1e-3


def test_paged_calls_ask_the_graphs_first(models, voice, tokens):
    """In paged mode every call is offered to the flow graphs (as FlowGraphs takes it) before
    it runs eagerly."""
    page = TurnStatePool.page_bytes(models.flow.decoder, torch.float32)
    token2wav = make_runner(models, incremental=False, prefix_voices=2, turn_state_bytes=65 * page)
    graphs = create_autospec(FlowGraphs, instance=True)
    graphs.has.return_value = False
    graphs.run.return_value = graphs.run_after_prefix.return_value = graphs.run_paged.return_value = None
    token2wav.flow_graphs = graphs
    state = stream(token2wav, VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding), tokens, done=True)
    while (job := token2wav.schedule.next_job(state)) is not None:
        token2wav.run([job])
    assert graphs.run_paged.call_count >= 4


def test_a_runner_dropped_is_freed_at_once(models, voice, tokens):
    """Nothing a runner holds refers back to it (its paged flow and its vocoder keep no method of
    it): a runner dropped, its turn pool and prefix bank with it, is freed at once, by reference
    counting, not at the cyclic collector's next pass (which this test keeps from running)."""
    page = TurnStatePool.page_bytes(models.flow.decoder, torch.float32)
    token2wav = make_runner(models, incremental=False, prefix_voices=2, turn_state_bytes=65 * page)
    state = stream(token2wav, VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding), tokens, done=True)
    token2wav.run([token2wav.schedule.next_job(state)], Lane())
    while (job := token2wav.schedule.next_job(state)) is not None:
        token2wav.run([job])
    dropped = [weakref.ref(token2wav), weakref.ref(token2wav.turn_pool), weakref.ref(token2wav.prefixes.bank)]
    gc.disable()
    try:
        del token2wav
        assert [ref() for ref in dropped] == [None, None, None]
    finally:
        gc.enable()


def test_a_flow_of_no_euler_steps_is_refused(models):
    with pytest.raises(ValueError, match="flow_steps must be >= 1, got 0"):
        make_runner(models, flow_steps=0)


def test_recompute_chunks_of_several_utterances_batch_exactly(models, voice, tokens):
    """Non-final chunks of different utterances (different prompts, lengths, offsets) in one
    flow call give each utterance the mel it gets alone."""
    shorter = models.frontend.prepare(voiced(1.4, 24000), 24000, "Short.")
    token2wav = make_runner(models, scale=1, incremental=False)
    after_prefix = make_runner(models, scale=1, incremental=False, prefix_voices=1)
    # One VoicePrompt per voice, as the engine keeps them.
    prompts = {id(v): VoicePrompt(v.speech_tokens, v.speech_feat, v.embedding) for v in (voice, shorter)}

    def streams():
        made = []
        for prompt, n, skip in ((voice, 137, 1), (shorter, 90, 0), (voice, 120, 2)):
            state = stream(token2wav, prompts[id(prompt)], tokens[:n], done=True)
            for _ in range(skip):  # different chunk indices
                token2wav.run([token2wav.schedule.next_job(state)])
            made.append(state)
        return made

    alone = [token2wav._flow(token2wav.schedule.next_job(state)) for state in streams()]
    jobs = [token2wav.schedule.next_job(state) for state in streams()]
    together = token2wav._flow_batched(jobs, False)
    # A flow call with more voices than the bank holds runs without prefixes.
    after_prefix._flow_batched(jobs, False)
    assert not after_prefix.prefixes._slots
    after_prefix.prefixes.capacity = 2
    together_after_prefix = after_prefix._flow_batched(jobs, False)
    assert len(after_prefix.prefixes._slots) == 2
    assert not any(job.finalize for job in jobs)
    for a, b, c in zip(alone, together, together_after_prefix):
        assert a.shape == b.shape == c.shape
        assert float((a - b).abs().max()) <= 1e-4
        assert float((a - c).abs().max()) <= 1e-4


def chunk_after(token2wav: Token2WavRunner, prompt: VoicePrompt, tokens, skip: int):
    """A new stream of all ``tokens``: its chunk after ``skip`` chunks have run."""
    state = stream(token2wav, prompt, list(tokens), done=True)
    for _ in range(skip):
        token2wav.run([token2wav.schedule.next_job(state)])
    return token2wav.schedule.next_job(state)


@pytest.mark.parametrize("call_row_frames, skips, calls", [
    (0, [1, 3, 1], [2, 1]),  # calls cost nothing beyond their rows: the wider chunk alone
    (None, [1, 3, 1], [3]),  # the per-call cost measured on the GPU: these tiny contexts share one call
    (None, [0, 3, 0], [2, 1]),  # first chunks never wait for a later chunk's call
])
def test_chunks_run_in_the_flow_calls_that_cost_least(models, voice, tokens, monkeypatch, call_row_frames, skips,
                                                      calls):
    """Rows of one flow call are padded to its longest: a batch is split into the calls of
    least total cost, except that a new turn's first chunks run apart from later chunks.
    Each chunk still gets its own mel."""
    if call_row_frames is not None:
        monkeypatch.setattr(call_plan_module, "CALL_ROW_FRAMES", call_row_frames)
    token2wav = make_runner(models, scale=1, incremental=False)
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)

    jobs = [chunk_after(token2wav, prompt, tokens, skip) for skip in skips]
    widths = [token2wav.schedule.job_frames(j) for j in jobs]
    assert widths[1] > 1.2 * widths[0] and widths[0] == widths[2] and not any(j.finalize for j in jobs)
    alone = [token2wav._flow(j) for j in jobs]
    made = []
    batched = token2wav._flow_call
    monkeypatch.setattr(token2wav, "_flow_call", lambda args, *a: made.append(args[0].shape[0]) or batched(args, *a))
    together = token2wav._flows(jobs)
    assert made == calls
    for a, b in zip(alone, together):
        assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-4


def test_a_call_of_several_rows_is_held_to_the_call_limit(models, voice, tokens, monkeypatch):
    """A flow call runs to its end while new turns wait: calls of several rows stay within
    MAX_CALL_ROW_FRAMES even where one call would cost less; each chunk keeps its mel."""
    token2wav = make_runner(models, scale=1, incremental=False)
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)

    jobs = [chunk_after(token2wav, prompt, tokens, 1) for _ in range(5)]
    width = token2wav.schedule.job_frames(jobs[0])
    assert [len(g) for g in token2wav.plan(jobs)] == [5]
    monkeypatch.setattr(call_plan_module, "MAX_CALL_ROW_FRAMES", call_plan_module.CALL_ROW_FRAMES + 2 * width)
    assert sorted(len(g) for g in token2wav.plan(jobs)) == [1, 2, 2]
    alone = [token2wav._flow(j) for j in jobs]
    for a, b in zip(alone, token2wav._flows(jobs)):
        assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-4


class GraphsOfEveryShape:
    """Stands in for the flow's CUDA graphs of every bucket up to ``max_batch`` rows (the
    cost of a call asks only which bucket it pads to)."""

    def __init__(self, max_batch: int) -> None:
        self.buckets = FlowBuckets.up_to(max_batch, 3200)

    def has(self, rows, frames, streaming, after_prefix=False):
        return self.buckets.covers(self.buckets.key(rows, frames, streaming, after_prefix))


def test_on_a_gpu_a_call_costs_its_graph_buckets_rows(models, voice, tokens, monkeypatch):
    """A graph of five rows computes eight (batch buckets 1, 2, 4, 8): on a GPU the plan counts
    the padded rows, so five wide rows go as four + one rather than as eight."""
    token2wav = make_runner(models, scale=1, incremental=False)
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    jobs = [chunk_after(token2wav, prompt, tokens, 1) for _ in range(5)]
    # The per-call cost of this tiny model's width: three padded rows cost more than a call.
    width = token2wav.schedule.job_frames(jobs[0])
    monkeypatch.setattr(call_plan_module, "CALL_ROW_FRAMES", 2 * width)
    token2wav.flow_graphs = GraphsOfEveryShape(8)
    assert [len(g) for g in token2wav.plan(jobs)] == [5]  # on a CPU: no graphs, no padding
    token2wav.planner = dataclasses.replace(token2wav.planner, on_gpu=True)
    assert sorted(len(g) for g in token2wav.plan(jobs)) == [1, 4]
    token2wav.flow_graphs = GraphsOfEveryShape(5)  # a bucket of five: one call
    assert [len(g) for g in token2wav.plan(jobs)] == [5]


class GraphsWithNoShapes:
    """Stands in for the flow's CUDA graphs on a CPU (where they are never replayed): holds
    no shape, so every decision that asks for graphs takes its no-graph branch."""

    def has(self, rows, frames, streaming, after_prefix=False):
        return False


@pytest.mark.parametrize("use_lane", [False, True])
def test_chunks_run_with_graphs_set_on_either_thread(models, voice, tokens, monkeypatch, use_lane):
    """With the decoder's graphs set, batched streaming chunks after voice prefixes (the
    engine's thread) and a lane's calls (its own graphs, no prefixes) both run, each chunk
    with its own mel."""
    token2wav = make_runner(models, scale=1, incremental=False, prefix_voices=1)
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    token2wav.prepare_voices([prompt], prompt.tokens)

    jobs = [chunk_after(token2wav, prompt, tokens, skip) for skip in (0, 0, 1)]
    alone = [token2wav._flow(j) for j in jobs]
    own, lanes = GraphsWithNoShapes(), GraphsWithNoShapes()
    token2wav.flow_graphs = own
    calls = []  # (the decoder ran after the voice prefixes, the graphs it was offered)
    whole, after = token2wav._flow_call, token2wav._solve_after_prefix

    def recording_whole(args, streaming, finalize, graphs, *encoder):
        calls.append((False, graphs))
        return whole(args, streaming, finalize, graphs, *encoder)

    def recording_after(graphs, *args):
        calls.append((True, graphs))
        return after(graphs, *args)

    monkeypatch.setattr(token2wav, "_flow_call", recording_whole)
    monkeypatch.setattr(token2wav, "_solve_after_prefix", recording_after)
    lane = Lane(flow_graphs=lanes) if use_lane else None
    together = token2wav._flows(jobs, lane)
    for a, b in zip(alone, together):
        assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-4
    # The engine's thread: after the prefixes, with the decoder's own graphs; a lane: its own, whole.
    assert calls and set(calls) == ({(False, lanes)} if use_lane else {(True, own)})
    # The lane's graphs are captured at first_chunk_widths: the width its first chunks ask for.
    assert jobs[0].first and [token2wav.planner.decoder_width(token2wav.schedule.job_frames(jobs[0]), False)] == (
        token2wav.schedule.first_chunk_widths(prompt.tokens)
    )
    # A lane without graphs (a CPU) runs any chunk; one with graphs only those it has a shape for.
    assert token2wav.lane_serves(jobs[0], Lane())
    assert not token2wav.lane_serves(jobs[0], Lane(flow_graphs=lanes))



class GraphsAfterPrefixes(GraphsWithNoShapes):
    """Stands in for a lane's graphs that hold its calls after voice prefixes (never replayed
    on a CPU: the solve runs eagerly)."""

    def has(self, rows, frames, streaming, after_prefix=False):
        return after_prefix


def test_a_lane_after_prefixes_runs_calls_of_several_rows_there_and_unpins_their_slots_when_done(
    models, voice, tokens, monkeypatch
):
    """With ``Lane.after_prefix``, a lane's call of several first chunks whose voices the bank
    holds, and which its graphs hold after the prefixes, starts after the voice prefixes, each
    chunk's mel the one it gets alone; the call pins the voices' slots until ``finish``, or
    until it fails. One row, a voice the bank does not hold, or a call no graph of the lane
    holds after the prefixes runs whole."""
    def runner_with_voice() -> tuple[Token2WavRunner, VoicePrompt]:
        runner = make_runner(models, scale=1, incremental=False, prefix_voices=2)
        prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
        runner.prepare_voices([prompt], prompt.tokens)
        return runner, prompt

    token2wav, prompt = runner_with_voice()
    apart, apart_prompt = runner_with_voice()  # each chunk alone, without touching token2wav's slots
    stranger = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)  # a voice it does not hold
    lanes = GraphsAfterPrefixes()
    calls, mels, pins = [], [], []
    whole, after, flows = token2wav._flow_call, token2wav._solve_after_prefix, token2wav._flows
    monkeypatch.setattr(token2wav, "_flow_call", lambda args, *rest: calls.append("whole") or whole(args, *rest))
    monkeypatch.setattr(
        token2wav, "_solve_after_prefix", lambda graphs, *a: calls.append(("after", graphs)) or after(graphs, *a)
    )

    def recording_flows(jobs, lane=None):
        mels.extend(flows(jobs, lane))
        pins.append(dict(token2wav.prefixes._pins))
        return mels[-len(jobs):]

    monkeypatch.setattr(token2wav, "_flows", recording_flows)
    cases = [
        (Lane(flow_graphs=lanes, after_prefix=True), [prompt] * 3, [("after", lanes)]),
        (Lane(after_prefix=True), [prompt] * 2, [("after", None)]),  # a lane without graphs (a CPU)
        (Lane(flow_graphs=lanes, after_prefix=True), [prompt], ["whole"]),
        (Lane(flow_graphs=lanes, after_prefix=True), [prompt, stranger], ["whole"]),
        (Lane(flow_graphs=GraphsWithNoShapes(), after_prefix=True), [prompt] * 2, ["whole"]),
        (Lane(flow_graphs=lanes), [prompt] * 2, ["whole"]),
    ]
    for lane, voices, expected in cases:
        orders = [tokens[i:] + tokens[:i] for i in range(len(voices))]
        jobs = [chunk_after(token2wav, p, order, 0) for p, order in zip(voices, orders)]
        alone = [apart._flows([chunk_after(apart, apart_prompt, order, 0)])[0] for order in orders]
        calls.clear(), mels.clear(), pins.clear()
        call = token2wav.launch(jobs, lane)
        assert calls == expected
        for a, b in zip(alone, mels, strict=True):
            assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-4
        pinned = len(voices) if expected != ["whole"] else 0
        assert pins == [{0: pinned} if pinned else {}] and call.pinned == [0] * pinned
        token2wav.finish(call)
        assert not token2wav.prefixes._pins and not call.pinned
    assert list(token2wav.prefixes._slots) == [id(prompt)]  # the lane took no slot
    assert token2wav.work_totals()["flow_lane_calls_after_prefix"] == 2
    # A call that fails unpins what it pinned.
    monkeypatch.setattr(token2wav.vocoder, "vocode", lambda *_: (_ for _ in ()).throw(RuntimeError("vocoder failed")))
    pins.clear()
    with pytest.raises(RuntimeError, match="vocoder failed"):
        token2wav.launch([chunk_after(token2wav, prompt, tokens, 0) for _ in range(2)], cases[0][0])
    assert pins == [{0: 2}] and not token2wav.prefixes._pins
    with pytest.raises(RuntimeError, match="inside launch"):  # pinned outside launch, nothing would unpin them
        token2wav._flows([chunk_after(token2wav, prompt, tokens, 0) for _ in range(2)], cases[0][0])


def test_the_prefix_cache_gives_no_pinned_slot_away_and_takes_a_calls_slots_at_once(models, voice):
    """A voice new to the bank takes the least recently used slot that is neither pinned nor
    one of its call's voices; where only pins stand in the way the call waits for them to go
    (and no new pin is given meanwhile). ``pin`` serves only voices the bank holds, of a bank
    of fixed width, which is then never replaced."""
    token2wav = make_runner(models, scale=1, incremental=False, prefix_voices=2)
    a, b, c, d = (VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding) for _ in range(4))
    cache = token2wav.prefixes
    cache.make_room(token2wav.flow.voice_prefix_frames(a.tokens), voice.speech_feat)
    assert cache.slots([a, b]) == [0, 1] and cache.pin([a]) is None  # width not fixed yet
    token2wav.prepare_voices([a, b], a.tokens)
    assert cache.slots([a, b, c]) is None  # more voices than slots
    assert cache.slots([a, b]) == [0, 1]  # touched in the call's order: a is the least recently used
    assert cache.pin([c]) is None and cache.pin([a, a]) == [0, 0]
    assert cache.slots([c]) == [1]  # b's slot: a's is pinned
    taken = []
    # two new voices, one slot free
    waiting = threading.Thread(target=lambda: taken.append(cache.slots([b, d])), daemon=True)
    waiting.start()
    deadline = time.monotonic() + 10
    while not cache._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cache._waiting
    assert cache.pin([c]) is None  # no new pin while the engine waits
    cache.unpin([0])
    time.sleep(0.05)
    assert waiting.is_alive()  # a is still pinned once
    cache.unpin([0])
    waiting.join(timeout=10)
    assert taken and sorted(taken[0]) == [0, 1] and not cache._waiting
    assert cache.pin([d]) is not None
    cache._fixed = False  # (only an unfixed bank is ever replaced)
    with pytest.raises(RuntimeError, match="while another thread reads it"):
        cache.make_room(cache.bank.frames + 50, voice.speech_feat)


def test_a_lanes_token_encoder_programs_give_its_chunks_the_eager_mel(models, voice, tokens, monkeypatch):
    """A lane with token-encoder programs of its first chunks' shape (run eagerly here, replayed
    on a GPU) encodes its calls by them, one row or several, and each chunk's mel is the one
    the eager encoder gives it."""
    token2wav = make_runner(models, scale=1, incremental=False, prefix_voices=0)
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    jobs = [chunk_after(token2wav, prompt, order, 0) for order in (tokens, tokens[::-1], tokens[1:] + tokens[:1])]
    plain = token2wav._flows(jobs, Lane())
    widths = [w // token2wav.schedule.mel_ratio for w in token2wav.schedule.first_chunk_widths(prompt.tokens)]
    encoder_graphs = EncoderGraphs(token2wav.flow, batches=(1, 2, 4), widths=widths, graphs=False)
    served = []
    run = encoder_graphs.run
    monkeypatch.setattr(encoder_graphs, "run", lambda *a, **k: served.append(run(*a, **k)) or served[-1])
    lane = Lane(encoder_graphs=encoder_graphs)
    for together in (token2wav._flows(jobs, lane), [token2wav._flows([job], lane)[0] for job in jobs]):
        for a, b in zip(plain, together):
            assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-4
    assert served and None not in served  # every call by the programs
    assert token2wav.work_totals()["flow_encoder_graph_calls"] == len(served)


def test_graphs_set_on_a_cpu_runner_are_never_consulted(models, voice, tokens):
    """The flow's graphs serve CUDA calls only: set on a CPU runner (the engine thread's, and a
    lane's), they are never asked (every chunk, first to final, is the eager solve)."""

    class Untouchable:
        def run(self, *args):
            raise AssertionError("graphs consulted for a CPU call")

        run_after_prefix = run

        def has(self, *args):
            return False

    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    audio = {}
    for graphs in (None, Untouchable()):
        token2wav = make_runner(models, incremental=False, prefix_voices=1)
        token2wav.flow_graphs = graphs
        state = stream(token2wav, prompt, tokens[:90], done=True)
        torch.manual_seed(5)
        chunks = []
        while (job := token2wav.schedule.next_job(state)) is not None:
            chunks += token2wav.run([job], Lane(flow_graphs=graphs) if job.first else None)
        audio[graphs is None] = np.concatenate(chunks)
    assert np.array_equal(audio[True], audio[False])


def test_flow_work_totals_are_the_decoder_calls_made(models, voice, tokens, monkeypatch):
    """The flow-work totals (exported as metrics) book every decoder call: its rows x the
    frames each row needed, and the rows x frames it computed, by chunk kind."""
    token2wav = make_runner(models, scale=1, incremental=False, prefix_voices=1)
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    solves = []  # (rows x frames computed, frames needed) of each decoder call

    def recording(_original, _mask_at):
        def record(*args, **kwargs):
            mask = args[_mask_at]
            solves.append((mask.shape[0] * mask.shape[2], int(mask.sum())))
            return _original(*args, **kwargs)
        return record

    decoder = token2wav.flow.decoder
    monkeypatch.setattr(decoder, "forward", recording(decoder.forward, 1))  # the whole solve
    # After the voice prefixes: (cfm, bank, slots, mu, mask, ...).
    monkeypatch.setattr(runner_module, "solve_after_prefix", recording(runner_module.solve_after_prefix, 4))

    states = []
    for n in (137, 90):
        state = stream(token2wav, prompt, list(tokens[:n]), done=True)
        states.append(state)
    launched = []  # each call's own count of the same work (LaunchedCall)

    def run(jobs):
        before = token2wav.work_totals()
        launched.append(token2wav.launch(jobs))
        token2wav.finish(launched[-1])
        after, call = token2wav.work_totals(), launched[-1]
        change = {name.removeprefix("flow_"): value - before.get(name, 0) for name, value in after.items()
                  if name.startswith("flow_") and not name.startswith("flow_phase_")}
        assert {name: n for name, n in call.work.items() if n} == {name: n for name, n in change.items() if n}
        assert call.work["calls"] >= 1

    run([token2wav.schedule.next_job(states[0])])  # one stream a chunk ahead: rows of different widths
    while jobs := [job for state in states if (job := token2wav.schedule.next_job(state)) is not None]:
        run(jobs)

    work = token2wav.work_totals()
    needed = sum(call.work.get(f"row_frames_{kind}", 0) for call in launched for kind in ("first", "later", "final"))
    assert needed == sum(frames for _, frames in solves)
    assert sum(call.work["padded_row_frames"] for call in launched) == work["flow_padded_row_frames"]
    assert all(call.gpu_seconds is None and call.gpu_phase_seconds is None for call in launched)  # no GPU
    assert work["flow_calls"] == work["flow_eager_calls"] == len(solves)  # no graphs on a CPU
    assert work["flow_padded_row_frames"] == sum(computed for computed, _ in solves)
    needed = [work[f"flow_row_frames_{kind}"] for kind in ("first", "later", "final")]
    assert sum(needed) == sum(frames for _, frames in solves) and all(needed)
    # First chunks run after the voice prefix: each needs the frames past it.
    prefix = token2wav.flow.voice_prefix_frames(prompt.tokens)
    first_width = token2wav.schedule.first_chunk_widths(prompt.tokens)[0] - prefix
    assert needed[0] == 2 * first_width and solves[0] == (first_width, first_width)
    # The streams are a chunk apart, so calls of both padded the shorter row.
    assert work["flow_padded_row_frames"] > sum(needed)

def test_voice_prefix_bank_slots(models, voice, tokens):
    """Voices take turns in the bank's slots (least recently used out), and a voice whose
    prefix is wider than a bank of fixed width runs without one; each chunk's mel stays
    what it is alone."""
    shorter = models.frontend.prepare(voiced(1.4, 24000), 24000, "Short.")
    wide, narrow = (VoicePrompt(v.speech_tokens, v.speech_feat, v.embedding) for v in (voice, shorter))
    plain = make_runner(models, scale=1, incremental=False)

    def first_job(prompt: VoicePrompt):
        state = stream(plain, prompt, list(tokens), done=True)
        return plain.schedule.next_job(state)

    def check(token2wav: Token2WavRunner, prompt: VoicePrompt) -> None:
        job = first_job(prompt)
        (mel,) = token2wav._flows([job])
        expected = plain._flow(job)
        assert mel.shape == expected.shape and float((mel - expected).abs().max()) <= 1e-4

    one_slot = make_runner(models, scale=1, incremental=False, prefix_voices=1)
    one_slot.prepare_voices([narrow], widest_prompt_tokens=wide.tokens)
    assert one_slot.prefixes.bank.frames == 100 and [p for p, _ in one_slot.prefixes._slots.values()] == [narrow]
    for prompt in (wide, narrow, wide):
        check(one_slot, prompt)
        assert [p for p, _ in one_slot.prefixes._slots.values()] == [prompt]

    too_narrow = make_runner(models, scale=1, incremental=False, prefix_voices=2)
    too_narrow.prepare_voices([narrow], widest_prompt_tokens=narrow.tokens)
    check(too_narrow, wide)
    assert too_narrow.prefixes.bank.frames == 50 and too_narrow.prefixes.slot(wide) is None
    assert [p for p, _ in too_narrow.prefixes._slots.values()] == [narrow]


def test_final_chunks_of_several_utterances_batch_exactly(models, voice, tokens):
    """Final chunks (full attention over prompt + all tokens) of different utterances in one
    flow call give each utterance the mel it gets alone."""
    token2wav = make_runner(models, scale=1, incremental=False)

    def final_jobs():
        jobs = []
        for n in (137, 61, 100):
            state = stream(token2wav, VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding), list(tokens[:n]), done=True)
            while not (job := token2wav.schedule.next_job(state)).finalize:
                token2wav.run([job])
            jobs.append(job)
        return jobs

    alone = [token2wav._flow(job) for job in final_jobs()]
    together = token2wav._flows(final_jobs())
    for a, b in zip(alone, together):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-4


def assert_mels_as_alone(together, apart: Token2WavRunner, jobs_of) -> None:
    """Each chunk's mel from a shared call (``together``) is the one it gets in a call of its
    own: the same chunks (``jobs_of``) made and run one by one on a fresh runner (``apart``)."""
    alone = [apart._flows([job])[0] for job in jobs_of(apart)]
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-4


def test_a_last_chunk_shares_the_later_chunks_call_after_stored_frames(models, voice, tokens):
    """With a turn-state pool and chunk-causal last chunks, one turn's last chunk and another
    turn's later chunk are planned into one flow call (the recompute path keeps them apart), and
    each gets the mel it gets in a call of its own."""

    def jobs_of(token2wav):
        prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
        ending, going = stream(token2wav, prompt, tokens[:61], done=True), stream(token2wav, prompt, tokens)
        jobs = []
        for state, last in ((ending, True), (going, False)):
            token2wav.run([token2wav.schedule.next_job(state)])  # the first chunk, into the pool
            job = token2wav.schedule.next_job(state)
            while job.finalize != last:
                token2wav.run([job])
                job = token2wav.schedule.next_job(state)
            jobs.append(job)
        return jobs

    page = TurnStatePool.page_bytes(models.flow.decoder, torch.float32)
    paged = dict(incremental=False, prefix_voices=2, final_attention="chunk", turn_state_bytes=65 * page)
    token2wav = make_runner(models, **paged)
    jobs = jobs_of(token2wav)
    assert [len(group) for group in token2wav.plan(jobs)] == [2]
    assert_mels_as_alone(token2wav._flows(jobs), make_runner(models, **paged), jobs_of)
    recompute = make_runner(models, incremental=False, prefix_voices=2, final_attention="chunk")
    assert sorted(len(group) for group in recompute.plan(jobs_of(recompute))) == [1, 1]


@pytest.mark.parametrize("later_with_first, calls", [(False, [1, 1]), (True, [2])])
def test_a_later_chunk_no_wider_than_the_first_chunks_may_share_their_call(models, voice, tokens, later_with_first,
                                                                          calls):
    """After stored frames a later chunk computes only its own frames: no wider than a new
    turn's first chunk. With ``later_with_first`` it is one more row of the first chunks' call
    (which runs first); without, the two kinds run apart. Each chunk gets the mel it gets alone."""

    def jobs_of(token2wav):
        prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
        new, going = stream(token2wav, prompt, tokens), stream(token2wav, prompt, tokens)
        token2wav.run([token2wav.schedule.next_job(going)])  # its first chunk, into the pool
        return [token2wav.schedule.next_job(new), token2wav.schedule.next_job(going)]

    page = TurnStatePool.page_bytes(models.flow.decoder, torch.float32)
    paged = dict(incremental=False, prefix_voices=2, final_attention="chunk", turn_state_bytes=65 * page)
    token2wav = make_runner(models, later_with_first=later_with_first, **paged)
    jobs = jobs_of(token2wav)
    assert [job.first for job in jobs] == [True, False]
    planned = token2wav.plan(jobs)
    assert [len(group) for group in planned] == calls and 0 in planned[0]
    assert_mels_as_alone(token2wav._flows(jobs), make_runner(models, **paged), jobs_of)


def test_a_later_chunk_wider_than_the_first_chunks_keeps_a_call_of_its_own(models, voice, tokens):
    """later_with_first takes only later chunks that add no width: without stored frames (the
    recompute path) a turn's second chunk spans its first too, and is planned apart."""
    token2wav = make_runner(models, incremental=False, later_with_first=True)
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    jobs = [chunk_after(token2wav, prompt, tokens, 0), chunk_after(token2wav, prompt, tokens, 1)]
    assert [job.first for job in jobs] == [True, False]
    assert token2wav.schedule.job_frames(jobs[1]) > token2wav.schedule.job_frames(jobs[0])
    assert sorted(len(group) for group in token2wav.plan(jobs)) == [1, 1]


def test_a_call_that_mixes_last_chunks_is_booked_by_its_other_chunks():
    """Calls of one kind of chunk are booked as that kind; a paged call that carries last chunks
    beside others is a call of first chunks when all its chunks are first (one-chunk turns
    among them), else of later chunks."""
    first, later, last, only = (SimpleNamespace(first=f, finalize=z) for f, z in
                                ((True, False), (False, False), (False, True), (True, True)))
    assert [call_kind(jobs) for jobs in ([first], [later], [last], [only], [first, only], [later, last])] == [
        "first", "later", "final", "final", "first", "later"
    ]


class RecordingGraphs:
    """Stands in for the vocoder's CUDA graphs: records the shapes streaming asks for, runs nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def run(self, mel, cache_source):
        self.calls.append((mel.shape[2], cache_source.shape[2]))
        return None  # eager


@pytest.mark.parametrize("first_hop_len, scale", [(25, 1), (5, 1), (5, 2)])
def test_chunk_shapes_are_what_streaming_gives_the_vocoder(models, voice, tokens, first_hop_len, scale):
    """The vocoder graphs are captured for ChunkSchedule.chunk_shapes: every non-final chunk of a
    stream must have one of those shapes, and the final chunk is left to eager mode."""
    token2wav = make_runner(models, scale=scale, max_hop_len=50, first_hop_len=first_hop_len)
    token2wav.hift_graphs = recorder = RecordingGraphs()
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    state = stream(token2wav, prompt, list(tokens) * 2, done=True)
    finals = 0
    while (job := token2wav.schedule.next_job(state)) is not None:
        token2wav.run([job])
        finals += job.finalize
    shapes = token2wav.schedule.chunk_shapes(prompt.tokens)
    *streamed, final = recorder.calls
    assert finals == 1 and len(streamed) >= 3
    assert set(streamed) <= set(shapes), (streamed, shapes)
    assert streamed[0] == shapes[0] and streamed[0][1] == 0  # the first chunk has no cached excitation
    assert final[1] == 8 * 480  # the final chunk comes behind the cache (its length varies: eager)
    assert token2wav.work_totals()["flow_vocoder_eager_calls"] == len(recorder.calls)  # no graph held any


@pytest.mark.parametrize("first_hop_len, scale", [(25, 1), (5, 2)])
def test_every_chunk_the_vocoder_gets_has_a_shape_its_graphs_may_be_captured_for(
    models, voice, tokens, first_hop_len, scale
):
    """chunk_shapes and tail_shapes (hift_graphs_all_lengths) together hold every shape streams
    give the vocoder: regular, early and last chunks of turns of every length, a turn's only
    chunk too; tail_shapes holds none of chunk_shapes."""
    token2wav = make_runner(models, scale=scale, max_hop_len=50, first_hop_len=first_hop_len)
    token2wav.hift_graphs = recorder = RecordingGraphs()
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    for length in (1, 3, 7, 30, 61, 137, 200):
        state = stream(token2wav, prompt, [], done=False)
        for count in range(1, length + 1):
            state.tokens = (list(tokens) * 2)[:count]
            if count % 9 == 0 and (job := token2wav.schedule.next_job(state, early=True)) is not None:
                token2wav.run([job])
        state.status = RequestStatus.TOKENS_DONE
        while (job := token2wav.schedule.next_job(state)) is not None:
            token2wav.run([job])
    regular, tail = token2wav.schedule.chunk_shapes(prompt.tokens), token2wav.schedule.tail_shapes(prompt.tokens)
    assert not set(regular) & set(tail)
    assert set(recorder.calls) <= set(regular) | set(tail), set(recorder.calls) - set(regular) - set(tail)
    assert len(set(recorder.calls) & set(tail)) >= 5  # last and early chunks of several lengths were made
    assert any(cached == 0 for _, cached in set(recorder.calls) & set(tail))  # a turn's only chunk


def test_a_vocoder_call_of_a_length_allowed_row_by_row_replays_its_one_row_graph_for_each_row(models):
    """``HiftGraphs.run`` for a shape allowed row by row: its one-row graph replayed once per row
    (a stand-in replays the vocoder eagerly on the graph's static tensors: no CUDA here), each
    row the audio it gets alone with the same random draws; without that graph, eager (None)."""
    from tts_gateway.engine.cosyvoice2.serving.hift_graphs import HiftGraphs, HiftKey, _CapturedVocoder

    hift = models.hift
    graphs = object.__new__(HiftGraphs)  # its constructor needs a CUDA device
    graphs.hift, graphs.dtype, graphs.shapes, graphs.row_shapes, graphs.graphs = hift, torch.float32, set(), set(), {}
    graphs.allow_row_by_row(20, 3840)
    mel, cache = torch.randn(3, 80, 20), 0.1 * torch.randn(3, 1, 3840)
    assert graphs.run(mel, cache) is None  # no graph captured for it: eager
    replays = []

    class Replay:  # the graph's program on its static tensors, as a replay runs it
        def replay(self):
            replays.append(1)
            wav, source = hift(captured.mel, captured.cache)
            captured.wav.copy_(wav), captured.source.copy_(source)

    torch.manual_seed(3)
    wav, source = hift(mel[:1], cache[:1])
    captured = _CapturedVocoder(Replay(), mel[:1].clone(), cache[:1].clone(), wav, source)
    graphs.graphs[HiftKey(1, 20, 3840)] = captured
    torch.manual_seed(5)
    with torch.inference_mode():
        replayed, replayed_source = graphs.run(mel, cache)
    torch.manual_seed(5)
    alone = [hift(mel[i : i + 1], cache[i : i + 1]) for i in range(3)]
    assert len(replays) == 3 and replayed.shape[0] == replayed_source.shape[0] == 3
    assert torch.equal(replayed, torch.cat([w for w, _ in alone]))
    assert torch.equal(replayed_source, torch.cat([s for _, s in alone]))


def test_one_row_vocoder_graphs_report_their_own_replay_error_and_a_failing_length_stays_eager():
    """``capture_rows``: how many one-row graphs it captured and their largest |replay - eager|,
    apart from the other graphs' (``max_error`` covers all); a length whose capture fails leaves
    the row-by-row shapes; an unchecked graph (nan) makes ``max_error`` nan."""
    from tts_gateway.engine.cosyvoice2.serving.hift_graphs import HiftGraphs, HiftKey, _CapturedVocoder

    graphs = object.__new__(HiftGraphs)  # its constructor needs a CUDA device
    graphs.shapes, graphs.row_shapes, graphs.graphs = {(58, 3840)}, set(), {}
    batched = _CapturedVocoder(None, *(torch.zeros(1),) * 4)
    batched.error = 3e-4
    graphs.graphs[HiftKey(4, 58, 3840)] = batched
    for frames in (20, 22, 24):
        graphs.allow_row_by_row(frames, 3840)

    def capture(key):
        if key.frames == 22:
            raise RuntimeError("out of memory")
        captured = _CapturedVocoder(None, *(torch.zeros(1),) * 4)
        captured.error = 1e-5 * key.frames
        graphs.graphs[key] = captured
        return captured

    graphs._capture = capture
    count, rows_error = graphs.capture_rows()
    assert (count, rows_error) == (2, 1e-5 * 24)
    assert graphs.row_shapes == {(20, 3840), (24, 3840)} and graphs.max_error == 3e-4
    graphs.graphs[HiftKey(1, 24, 3840)].error = float("nan")
    assert math.isnan(graphs.max_error)


def test_hift_graph_keys():
    from tts_gateway.engine.cosyvoice2.serving.hift_graphs import HiftKey, batch_buckets, graph_key

    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64) and batch_buckets(12) == (1, 2, 4, 8, 12)
    shapes = {(58, 3840), (20, 0)}
    buckets = batch_buckets(12)
    assert graph_key(buckets, shapes, 3, 58, 3840) == HiftKey(4, 58, 3840)
    assert graph_key(buckets, shapes, 12, 20, 0) == HiftKey(12, 20, 0)
    assert graph_key(buckets, shapes, 13, 58, 3840) is None  # over the largest bucket: eager
    assert graph_key(buckets, shapes, 1, 57, 3840) is None  # a final chunk's length: eager
    assert graph_key(buckets, shapes, 1, 58, 0) is None


def test_vocoder_graphs_cover_rows_within_a_frame_budget():
    """A vocoder graph's memory grows with rows x frames: a shape's graphs go up to the largest
    bucket within GRAPH_ROW_FRAMES, and a call of more rows replays in parts of that many."""
    from tts_gateway.engine.cosyvoice2.serving.hift_graphs import GRAPH_ROW_FRAMES, batch_buckets, rows_per_replay

    buckets = batch_buckets(64)
    assert GRAPH_ROW_FRAMES == 4096
    assert rows_per_replay(buckets, 58) == 64  # steady chunks of the official hop: every bucket
    assert rows_per_replay(buckets, 108) == 32 and rows_per_replay(buckets, 408) == 8
    assert rows_per_replay(buckets, 5000) == 1  # longer than the budget: one row a replay


def test_vocoder_rows_are_independent_under_padding(models):
    """Graph batches are padded with copies of row 0: a real row's audio must not depend on
    the rows beside it (same per-row random draws)."""
    from tts_gateway.engine.cosyvoice2.serving.hift_graphs import pad_rows

    hift = models.hift
    mel = torch.randn(2, hift.config.in_channels, 30, generator=torch.Generator().manual_seed(3))
    cache = 0.1 * torch.randn(2, 1, 8 * 480, generator=torch.Generator().manual_seed(4))

    def generators(n: int) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in range(n)]

    alone, alone_source = hift(mel, cache, generators(2))
    padded, padded_source = hift(pad_rows(mel, 5), pad_rows(cache, 5), generators(5))
    assert padded.shape[0] == 5
    assert float((padded[:2] - alone).abs().max()) <= 1e-5
    assert float((padded_source[:2] - alone_source).abs().max()) <= 1e-6
    assert torch.equal(pad_rows(mel, 5)[4], mel[0])


@pytest.mark.parametrize("first_hop_len", [25, 5])
def test_hops_grow_as_upstream_after_a_first_chunk_of_a_whole_hop(models, voice, first_hop_len):
    """With the official first chunk (a whole hop, padded to the boundary) the hop grows after
    every chunk, as upstream's stream_scale_factor. A shorter first chunk is one more chunk in
    front of that schedule: a whole hop follows it, so that its listener, holding a fraction of
    a second of audio, waits for 25 tokens and not 50."""
    token2wav = make_runner(models, scale=2, max_hop_len=200, first_hop_len=first_hop_len)
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    state = stream(token2wav, prompt)
    first = token2wav.schedule.first_hop(prompt.tokens)
    state.tokens = [1] * (first + 25 + 50 + 100 + 200 + 200 + token2wav.schedule.lookahead)
    hops = []
    while (job := token2wav.schedule.next_job(state)) is not None:
        hops.append(job.advance)
        token2wav._emit(job, torch.zeros(1, 80, 2 * job.advance), torch.zeros(1, 480 * 2 * job.advance),
                        torch.zeros(1, 1, 480 * 2 * job.advance))
    if first >= 25:
        assert hops[:4] == [first, 50, 100, 200]
    else:
        assert hops[:6] == [first, 25, 50, 100, 200, 200]


@pytest.mark.parametrize(("first_hop_len", "second_on_lane"), [(25, True), (5, True), (5, False)])
def test_the_lane_runs_a_turns_opening_chunks_at_the_widths_and_shapes_it_has_graphs_for(
    models, voice, tokens, first_hop_len, second_on_lane, monkeypatch
):
    """The first-chunk lane runs a turn's opening chunks: its first, and (second_on_lane) after
    a short first chunk the chunk after it (its listener holds a fraction of a second). Its
    graphs are captured at lane_widths and lane_shapes: the widths and vocoder shapes those
    chunks ask for."""
    token2wav = make_runner(models, first_hop_len=first_hop_len, second_on_lane=second_on_lane,
                          incremental=False)
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    state = stream(token2wav, prompt)
    state.tokens = list(tokens)
    vocoded = []
    vocode = token2wav.vocoder.vocode
    monkeypatch.setattr(token2wav.vocoder, "vocode", lambda mel, source, graphs: (
        vocoded.append((mel.shape[2], source.shape[2])), vocode(mel, source, graphs))[1])
    opening, widths = [], []
    for _ in range(3):
        job = token2wav.schedule.next_job(state)
        assert job is not None and not job.finalize
        opening.append(token2wav.schedule.opens_turn(job))
        widths.append(token2wav.planner.decoder_width(token2wav.schedule.job_frames(job), False))
        token2wav.run([job], Lane())
    count = 2 if second_on_lane and token2wav.schedule.first_hop(prompt.tokens) < 25 else 1
    assert opening == [True] * count + [False] * (3 - count)
    assert token2wav.schedule.lane_widths(prompt.tokens) == widths[:count]
    assert token2wav.schedule.lane_shapes(prompt.tokens) == vocoded[:count]
    # A lane without graphs runs opening chunks only; the final chunk is the main thread's.
    state.status = RequestStatus.TOKENS_DONE
    while not (job := token2wav.schedule.next_job(state)).finalize:
        token2wav.run([job])
    assert not token2wav.lane_serves(job, Lane())


def test_a_short_first_chunk_lengthened_to_the_official_one(models, voice, tokens):
    """first_by_load: both first chunks get their shapes; a stream that has not spoken yet can
    start with the official first chunk instead, and its hops then grow as upstream's."""
    token2wav = make_runner(models, scale=2, max_hop_len=200, first_hop_len=5, first_by_load=True)
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    short, official = token2wav.schedule.first_hop(prompt.tokens), token2wav.schedule.first_hop(prompt.tokens, 25)
    assert short < 25 <= official and token2wav.schedule.first_hops(prompt.tokens) == [short, official]
    assert token2wav.schedule.first_chunk_shapes(prompt.tokens) == [(2 * short, 0), (2 * official, 0)]
    assert token2wav.schedule.chunk_shapes(prompt.tokens)[:2] == token2wav.schedule.first_chunk_shapes(prompt.tokens)
    assert token2wav.schedule.first_chunk_playable_s(stream(token2wav, prompt)) == pytest.approx(
        (short * 2 * 480 - 8 * 480) / 24000)
    state = stream(token2wav, prompt)
    state.tokens = [1] * (short + token2wav.schedule.lookahead)
    assert token2wav.schedule.next_job(state).advance == short
    assert token2wav.schedule.lengthen_first_chunk(state) and not token2wav.schedule.lengthen_first_chunk(state)
    assert token2wav.schedule.next_job(state) is None  # waits for the official chunk's tokens
    state.tokens = [1] * (official + 25 + 50 + 100 + token2wav.schedule.lookahead)
    hops = []
    while (job := token2wav.schedule.next_job(state)) is not None:
        hops.append(job.advance)
        token2wav._emit(job, torch.zeros(1, 80, 2 * job.advance), torch.zeros(1, 480 * 2 * job.advance),
                        torch.zeros(1, 1, 480 * 2 * job.advance))
        assert not token2wav.schedule.lengthen_first_chunk(state)  # once speaking, never
    assert hops[:3] == [official, 50, 100]
    # Run for real, in both flow modes: every token is spoken once.
    for incremental in (True, False):
        runner = make_runner(models, first_hop_len=5, first_by_load=True, incremental=incremental)
        state = stream(runner, prompt, list(tokens), done=True)
        assert runner.schedule.lengthen_first_chunk(state)
        audio = []
        while (job := runner.schedule.next_job(state)) is not None:
            audio += runner.run([job])
        assert len(audio[0]) == (official * 2 - 8) * 480 and len(np.concatenate(audio)) == len(tokens) * 2 * 480
    # Without first_by_load, only the short first chunk has shapes.
    plain = make_runner(models, scale=2, max_hop_len=200, first_hop_len=5)
    assert plain.schedule.first_hops(prompt.tokens) == [short]


def test_early_chunks_speak_every_token_once_and_keep_the_regular_boundaries(models, voice, tokens):
    """A listener about to run dry gets the tokens there are; the regular chunk after it still
    ends where the schedule put it, and the audio covers every token exactly once."""
    token2wav = make_runner(models, scale=1, first_hop_len=5, incremental=False)
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    state = stream(token2wav, prompt)
    lookahead = token2wav.schedule.lookahead
    first = token2wav.schedule.first_hop(prompt.tokens)
    state.tokens = list(tokens[: first + lookahead])
    audio = token2wav.run([token2wav.schedule.next_job(state)])  # the first chunk
    assert token2wav.schedule.next_job(state, early=True) is None  # nothing new to speak yet
    state.tokens = list(tokens[: first + 9 + lookahead])  # 9 more: not a whole hop of 25
    assert token2wav.schedule.next_job(state) is None
    early = token2wav.schedule.next_job(state, early=True)
    assert early.early and early.advance == 9 and not early.finalize
    audio += token2wav.run([early])
    state.tokens = list(tokens[: first + 25 + lookahead])
    regular = token2wav.schedule.next_job(state)
    assert not regular.early and regular.advance == 25 - 9  # ends on the regular boundary
    audio += token2wav.run([regular])
    state.tokens = list(tokens[: first + 50 + lookahead])
    assert token2wav.schedule.next_job(state).advance == 25  # and the hops after it are whole again
    state.tokens, state.status = list(tokens), RequestStatus.TOKENS_DONE
    while (job := token2wav.schedule.next_job(state)) is not None:
        audio += token2wav.run([job])
    samples = np.concatenate(audio)
    assert len(samples) == len(tokens) * 2 * 480
    assert np.isfinite(samples).all()


def test_without_look_ahead_the_held_back_tail_is_still_flushed():
    """A flow without look-ahead tokens lets a regular chunk speak every token; the final chunk
    then has no token left but still flushes the vocoder's held-back tail, and only after it is
    the utterance spoken."""
    schedule = ChunkSchedule(hop_len=25, max_hop_len=25, scale=1, first_hop_len=25, lookahead=0, chunk_tokens=25,
                             mel_ratio=2, samples_per_frame=480, sample_rate=24000)
    request = Request(VoicePrompt(torch.zeros(1, 50), None, None), StreamState(hop=25), None,
                      status=RequestStatus.TOKENS_DONE, tokens=[1] * 25)
    job = schedule.next_job(request)
    assert (job.advance, job.finalize) == (25, False)  # every token, as a regular chunk
    schedule.spoken(job)
    request.stream.hift_speech = torch.zeros(1, 8 * 480)  # what the runner holds back of it
    final = schedule.next_job(request)
    assert (final.advance, final.finalize) == (0, True)
    request.stream.hift_speech = None  # the final chunk flushed it
    assert schedule.next_job(request) is None


@pytest.mark.parametrize("paged", [True, False])
def test_engine_thread_calls_are_timed_phase_by_phase(models, voice, tokens, monkeypatch, paged):
    """Each call of the engine thread books its phases (phase_clock.py; exported as metrics):
    a paged call its token encoder and decoder, a recompute call its token encoder and its flow
    outside the pool, both
    their vocoder and output; the first-chunk lane's calls are booked apart. Each reading of the clock here
    is one second later than the last, so a phase's seconds count its laps."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(phase_clock, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    if paged:
        page = TurnStatePool.page_bytes(models.flow.decoder, torch.float32)
        token2wav = make_runner(
            models, incremental=False, prefix_voices=2, turn_state_bytes=65 * page, final_attention="chunk"
        )
    else:
        token2wav = make_runner(models, incremental=False, prefix_voices=1)
    state = stream(token2wav, VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding), tokens, done=True)
    token2wav.run([token2wav.schedule.next_job(state)], Lane())  # the first chunk on the lane: booked apart
    calls = 0
    while (job := token2wav.schedule.next_job(state)) is not None:
        token2wav.run([job])
        calls += 1
    work = token2wav.work_totals()
    booked = {name.removeprefix("flow_phase_thread_seconds_"): value
              for name, value in work.items() if name.startswith("flow_phase_thread_seconds_")}
    # Recompute: every call's token encoder is booked apart, after the voice prefix or whole (the last chunk).
    flow = {"encoder": calls, "decoder": calls, "flow_other": 2 * calls} if paged else {
        "encoder": calls, "unpaged": calls, "flow_other": 3 * calls}
    assert calls >= 3 and work["flow_phase_calls"] == calls
    assert booked == {**flow, "vocoder": calls, "output": calls, "wait": calls}
    assert not any("_gpu_seconds_" in name for name in work)  # no GPU timeline on a CPU
    assert work["flow_lane_phase_calls"] == 1 and work["flow_lane_phase_thread_seconds_output"] == 1
    # The lane runs the first chunk whole: its token encoder is booked apart from the rest of the flow.
    assert work["flow_lane_phase_thread_seconds_encoder"] == 1 and work["flow_lane_phase_thread_seconds_unpaged"] == 1


def test_a_phase_clock_knows_its_phases():
    clock = phase_clock.PhaseClock(None)
    clock.lap("vocoder")
    with pytest.raises(ValueError, match="unknown phase 'flow'"):
        clock.lap("flow")
    assert set(clock.close()) == {"thread_seconds_vocoder"}


def pool_for_one_other_turn(models, prompt: VoicePrompt, other_tokens: list[int]) -> Token2WavRunner:
    """A paged runner whose pool holds the voice prefix and one turn of ``other_tokens`` at its
    peak, a page to spare: while that turn is in it, no other turn is admitted."""
    page = TurnStatePool.page_bytes(models.flow.decoder, torch.float32)

    def runner(pages: int) -> Token2WavRunner:
        return make_runner(
            models, incremental=False, prefix_voices=2, final_attention="chunk", turn_state_bytes=(pages + 1) * page
        )

    roomy = runner(64)
    other = stream(roomy, prompt, other_tokens, done=True)
    while (job := roomy.schedule.next_job(other)) is not None:
        roomy.run([job])
    prefix_pages = -(-roomy.prefixes.bank.frames // roomy.turn_pool.page_frames)
    return runner(prefix_pages + roomy.turn_pool.peak_pages + 1)


def test_a_turn_that_fell_back_comes_back_when_the_pool_has_room(official_chunks, models, voice, tokens):
    """A turn that found the pool full (another turn held it) goes on by recompute, and comes
    back to the pool once the other turn has ended: its later chunks start after its stored
    frames again, until it outgrows the pool. Every chunk still equals the official streaming
    flow's."""
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    token2wav = pool_for_one_other_turn(models, prompt, tokens[:110])
    pool = token2wav.turn_pool

    def run_other(job) -> None:  # its vocoder's random draws apart from ours (as in the reference)
        with torch.random.fork_rng():
            token2wav.run([job])

    other = stream(token2wav, prompt, tokens[:110], done=True)
    for _ in range(3):  # most of the other turn, into the pool
        run_other(token2wav.schedule.next_job(other))
    ours = stream(token2wav, prompt, tokens, done=True)
    torch.manual_seed(1234)
    chunks = [token2wav.run([token2wav.schedule.next_job(ours)])[0]]
    assert ours.stream.turn.fell_back and pool.fallbacks == 1 and pool.returns == 0
    while (job := token2wav.schedule.next_job(other)) is not None:  # the other turn ends
        run_other(job)
    stored = []
    while (job := token2wav.schedule.next_job(ours)) is not None:
        chunks.append(token2wav.run([job])[0])
        stored.append(ours.stream.turn.frames if ours.stream.turn is not None else 0)
    # Back in the pool at its next chunk, stored on from there; its last chunk outgrew the pool.
    assert stored == [150, 200, 250, 0] and pool.returns == 1 and pool.fallbacks == 2
    reference = official_chunks("chunk", N_TIMESTEPS)
    assert [len(c) for c in chunks] == [len(c) for c in reference]
    error = max(float(np.max(np.abs(a - b))) for a, b in zip(chunks, reference))
    assert error <= 1e-4, error
    assert pool.pages_in_use == 0


def test_turns_that_fell_back_come_back_one_a_call(models, voice, tokens):
    """Two turns that fell back, called together once the pool has room for one: one comes
    back, judged by the pool as the call before left it; the other stays on recompute."""
    prompt = VoicePrompt(voice.speech_tokens, voice.speech_feat, voice.embedding)
    token2wav = pool_for_one_other_turn(models, prompt, tokens[:110])
    pool = token2wav.turn_pool
    other = stream(token2wav, prompt, tokens[:110], done=True)
    token2wav.run([token2wav.schedule.next_job(other)])
    fallen = [stream(token2wav, prompt, tokens, done=True) for _ in range(2)]
    token2wav.run([token2wav.schedule.next_job(state) for state in fallen])
    assert all(state.stream.turn.fell_back for state in fallen) and pool.fallbacks == 2
    while (job := token2wav.schedule.next_job(other)) is not None:
        token2wav.run([job])
    token2wav.run([token2wav.schedule.next_job(state) for state in fallen])
    assert sorted(state.stream.turn.fell_back for state in fallen) == [False, True]
    assert pool.returns == 1 and pool.fallbacks == 2
