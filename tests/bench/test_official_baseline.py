"""bench/official_baseline.py without upstream: its agents, timing and summary are the load
generator's (driven here by synthetic chunk timings), its run-time patches do what they say on
stand-ins shaped like upstream's, and the scripts around it pass ShellCheck.

The run on upstream itself (CPU, tiny checkpoint) needs upstream's source, which CI does not
have: it is a dev command in docs/benchmarks.md ("Against the official path")."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time

import pytest

import tts_gateway.gateway.loadgen as loadgen
from tests.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402
import official_baseline as official  # noqa: E402

SR = 24000


def _args(**overrides) -> argparse.Namespace:
    args = dict(levels=[1], duration=1.2, start_spread=0.0, turn_gap=(0.05, 0.1), lang="en", corpus=None,
                ttfa_p95_ms=400.0, sample_rate=SR, drain_timeout=5.0)
    args.update(overrides)
    return argparse.Namespace(**args)


def _scripted(chunks: list[tuple[float, float]]):
    """A speaker that yields each (wait s, audio ms) chunk after its wait."""
    def speak(text: str):
        for wait, audio_ms in chunks:
            time.sleep(wait)
            yield int(audio_ms * SR / 1000)
    return speak


def test_a_reply_is_timed_on_the_load_generators_playback_clock():
    """TTFA from the call to the first chunk, a late chunk a stall placed by the audio before it,
    an empty chunk ignored, and done with RTF: what loadgen.Playback makes of the same arrivals."""
    record = loadgen.Record(1, 0, "full", 10)
    heard_at = official.speak_timed(_scripted([(0.05, 100), (0.0, 0), (0.3, 500), (0.0, 400)]), "hi", record,
                                    time.perf_counter() + 10, SR)
    assert record.outcome == "done"
    assert record.ttfa_ms == pytest.approx(50, abs=30)
    assert record.stalls == 1 and record.stall_ms == pytest.approx(200, abs=40)
    assert record.stall_audio_ms == [100.0]
    assert record.audio_ms == pytest.approx(1000)
    assert len(record.slack_ms) == 2  # the empty chunk is no chunk
    assert record.rtf == pytest.approx(record.wall_ms / 1000)
    assert heard_at == pytest.approx(time.perf_counter() + 0.9, abs=0.1)


def test_a_chunk_after_the_deadline_is_not_heard_and_the_reply_stays_truncated():
    record = loadgen.Record(1, 0, "full", 10)
    closed = []

    def speak(text):
        try:
            yield 2400
            time.sleep(0.2)
            yield 2400
        finally:
            closed.append(True)

    official.speak_timed(speak, "hi", record, time.perf_counter() + 0.1, SR)
    assert record.outcome == "truncated" and record.audio_ms == pytest.approx(100)
    assert closed == [True]  # upstream's generator is closed, not left suspended


def test_agents_draw_what_gpu_checks_load_generators_draw():
    """Level 40: one group of 32 and one of 8, seeded as gpu_check seeds its processes."""
    seeds = official.agent_seeds(40)
    assert gpu_check.load_clients(40) == [(40000, 32), (40001, 8)]
    assert seeds[0] == (40000, 32, 0) and seeds[31] == (40000, 32, 31) and seeds[32] == (40001, 8, 0)
    assert len(seeds) == 40


def test_the_runners_result_is_the_load_generators_summary_of_its_records():
    """Two levels of agent threads on synthetic timings; the result is loadgen.ramp_result's,
    with each level's summary loadgen.summarize of exactly its records, and the replies the
    agents spoke are the ones loadgen's seeded draws give."""
    spoken: list[str] = []
    lock = threading.Lock()

    def speak(text):
        with lock:
            spoken.append(text)
        if "Boarding" in text:  # some replies fail outright: errors with no audio
            raise RuntimeError("boom")
        yield from _scripted([(0.02, 120), (0.25, 400)])(text)  # the second chunk 130 ms late

    written = []
    args = _args(levels=[1, 2])
    result = official.run(speak, args, {"arm": "fake"}, written.append)
    assert [lv["sessions"] for lv in result["levels"]] == [1, 2]
    assert len(written) == 2 and written[-1] is result
    assert set(result) == {"config", "summary", "levels", "stall_free_capacity", "records"}
    assert result["config"]["arm"] == "fake" and result["config"]["workload"] == "full"
    records = [loadgen.Record(**raw) for raw in result["records"]]
    for level in result["levels"]:
        mine = [r for r in records if r.sessions == level["sessions"]]
        assert level["summary"] == loadgen.summarize(mine)
        assert {"wall_s", "drain_s", "threads_left", "error_samples"} <= level.keys()
    assert result["summary"] == result["levels"][-1]["summary"]
    assert result["stall_free_capacity"] is None  # every spoken reply stalled
    summary = result["levels"][0]["summary"]
    assert summary["stalls"] >= 1 and summary["no_audio"] == summary["errors"]
    assert summary["truncated"] == summary["outcomes"].get("truncated", 0)
    json.dumps(result)  # JSON as it is
    # The first reply of each agent is loadgen's seeded draw after its start-spread draw.
    replies = loadgen.load_corpus("en")
    firsts = set()
    for seed in official.agent_seeds(1) + official.agent_seeds(2):
        rng = loadgen.agent_rng(*seed)
        rng.uniform(0, args.start_spread)
        firsts.add(rng.choice(replies))
    assert firsts <= set(spoken)


def test_the_hop_is_per_request_as_upstreams_fix_1849_makes_it():
    """A stand-in shaped like upstream's CosyVoice2Model.tts (grows self.token_hop_len after each
    chunk): unpatched, the second request starts at the grown hop; patched, every request and
    every thread starts at 25."""
    class Model:
        def __init__(self):
            self.token_hop_len, self.token_max_hop_len, self.stream_scale_factor = 25, 100, 2

        def tts(self, chunks=3):
            for _ in range(chunks):
                yield self.token_hop_len
                self.token_hop_len = min(self.token_max_hop_len, self.token_hop_len * self.stream_scale_factor)

    shared = Model()
    assert list(shared.tts()) == [25, 50, 100] and list(shared.tts()) == [100, 100, 100]  # the bug
    model, patches = Model(), []
    official.fix_shared_hop_len(model, patches)
    assert list(model.tts()) == [25, 50, 100] and list(model.tts()) == [25, 50, 100]
    assert "#1849" in patches[0] and type(model).__name__ == "Model"
    other = []
    first = model.tts()
    assert next(first) == 25
    thread = threading.Thread(target=lambda: other.extend(model.tts()))
    thread.start(), thread.join()
    assert other == [25, 50, 100] and list(first) == [50, 100]  # interleaved, each its own hop


def test_the_reply_length_bound_is_the_gateways():
    class LM:
        def inference(self, text, max_token_text_ratio: float = 20, **kwargs):
            return max_token_text_ratio

    lm, patches = LM(), []
    official.cap_reply_length(lm, 7.5, patches)
    assert lm.inference(text="x", uuid="u") == 7.5
    assert official.gateway_speech_cap() == gpu_check.argument_parser().get_default("speech_per_text_token")


def test_wav_loading_stands_in_for_torchaudio_load(tmp_path):
    import wave

    import numpy as np

    path = tmp_path / "a.wav"
    with wave.open(str(path), "wb") as out:
        out.setnchannels(2), out.setsampwidth(2), out.setframerate(16000)
        out.writeframes(np.array([[1000, -1000]] * 160, dtype=np.int16).tobytes())
    audio, rate = official._load_wav(path, backend="soundfile")
    assert rate == 16000 and tuple(audio.shape) == (2, 160)
    assert float(audio[0, 0]) == pytest.approx(1000 / 32768, rel=1e-3)


@pytest.mark.parametrize("script", sorted(path.name for path in (ROOT / "bench").glob("*.sh")))
def test_the_scripts_pass_shellcheck(script):
    """Every bench script (the GPU machine's are run there only), the scripts they source followed."""
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: scripts/test.sh installs it (apt-get install shellcheck)"
    result = subprocess.run([shellcheck, "-x", f"bench/{script}"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_warm_up_speaks_one_whole_reply_and_reports_its_first_chunk():
    spoken = []

    def speak(text):
        spoken.append(text)
        time.sleep(0.05)
        yield 480
        yield 960

    result = official.warm_up(speak)
    assert spoken == [official.WARM_UP_TEXT]
    assert result["samples"] == 1440 and 0.04 <= result["first_chunk_s"] <= result["seconds"]


def test_stage_times_observe_upstreams_lm_and_token2wav_without_changing_them():
    """A stand-in shaped like upstream's model (an LM generator, token2wav on the model): the
    wrapped calls return what they returned, the LM's first token is timed apart from the gaps
    after it, a failing token2wav is timed and still raises, and a level's run reports its own."""
    class LM:
        def inference(self, text, **kwargs):
            for token in (7, 8, 9):
                time.sleep(0.03 if token == 7 else 0.01)
                yield token

    class Model:
        def __init__(self):
            self.llm = LM()

        def token2wav(self, token, **kwargs):
            time.sleep(0.02)
            if token is None:
                raise ValueError("no tokens")
            return [token] * 2

    model, stages = Model(), official.StageTimes()
    stages.observe(model)
    assert list(model.llm.inference(text="x", uuid="u")) == [7, 8, 9]
    assert model.token2wav(token=5, uuid="u") == [5, 5]
    with pytest.raises(ValueError):
        model.token2wav(token=None)
    times = stages.summary()
    assert times["lm_first_token_ms"]["n"] == 1 and times["lm_first_token_ms"]["p50"] >= 25
    assert times["lm_token_gap_ms"]["n"] == 2 and 8 <= times["lm_token_gap_ms"]["p50"] < 25
    assert times["token2wav_ms"]["n"] == 2 and times["token2wav_ms"]["p50"] >= 15

    def speak(text):
        list(model.llm.inference(text=text))
        yield 480

    result = official.run(speak, _args(levels=[1, 2]), {"arm": "fake"}, stages=stages)
    per_level = [lv["upstream_stages"]["lm_token_gap_ms"]["n"] for lv in result["levels"]]
    replies = [lv["summary"]["contexts"] for lv in result["levels"]]
    assert per_level == [2 * n for n in replies]  # reset per level: each counts its own replies only


def test_vllm_shim_embeds_through_the_vllm_model_s_own_method(monkeypatch):
    """vLLM 0.26 embeds decoded tokens with ``embed_input_ids``; upstream's model class has only
    ``get_input_embeddings``, which calls a method vLLM 0.26's Qwen2 model lacks. The shim must
    reach the inner model's ``embed_input_ids`` (an alias of the old name failed at the first
    decoded token, and upstream's caller then waited forever)."""
    import types

    class InnerModel:  # vLLM 0.26's Qwen2Model: embed_input_ids, no get_input_embeddings
        def embed_input_ids(self, input_ids):
            return ("embedded", input_ids)

    class UpstreamModel:  # shaped like upstream's CosyVoice2ForCausalLM
        def __init__(self):
            self.model = InnerModel()

        def get_input_embeddings(self, input_ids):
            return self.model.get_input_embeddings(input_ids)

    registered = {}
    vllm = types.ModuleType("vllm")
    vllm.ModelRegistry = types.SimpleNamespace(register_model=lambda name, cls: registered.update({name: cls}))
    upstream = types.ModuleType("cosyvoice.vllm.cosyvoice2")
    upstream.CosyVoice2ForCausalLM = UpstreamModel
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "cosyvoice", types.ModuleType("cosyvoice"))
    monkeypatch.setitem(sys.modules, "cosyvoice.vllm", types.ModuleType("cosyvoice.vllm"))
    monkeypatch.setitem(sys.modules, "cosyvoice.vllm.cosyvoice2", upstream)
    import builtins
    import typing

    monkeypatch.setattr(builtins, "Union", typing.Union, raising=False)  # the shim's other name, undone after

    official.register_vllm_model()

    assert registered == {"CosyVoice2ForCausalLM": UpstreamModel}
    assert UpstreamModel().embed_input_ids([7, 8]) == ("embedded", [7, 8])
