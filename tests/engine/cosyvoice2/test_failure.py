"""Fault injection on the CosyVoice2 engine (tiny checkpoint, CPU): a token2wav worker that
raises outside a request, an LM backend that dies, a stage that hangs. Each must end every
open utterance with an error within about a second of the fault (the watchdog), report the
engine failed, refuse new utterances, and through the gateway end the sessions' contexts with
an error frame and turn /readyz to 503."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import orjson
import pytest
import pytest_asyncio
import torch
from websockets.asyncio.client import connect

from tts_gateway.engine.base import EngineError, UtteranceOptions
from tts_gateway.engine.cosyvoice2.engine import CosyVoice2Engine
from tts_gateway.engine.cosyvoice2.serving.lm.stage import LMStream
from tts_gateway.engine.cosyvoice2.settings import CosyVoice2Settings
from tts_gateway.testkit.checkpoint import make_checkpoint

from tests.conftest import make_config, running_gateway, until, ws_url
from tests.engine.cosyvoice2.test_engine import PROMPT_TEXT, prompt_wav
from tests.gateway.test_server import http_get, recv_json

STALL_TIMEOUT_S = 0.5
TEXT = "Hello there, this is a turn long enough for a few chunks of audio."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tts_gateway.engine.cosyvoice2.frontend.prompt import CosyVoice2Frontend
    from tts_gateway.engine.cosyvoice2.frontend.voices import VoiceStore

    model_dir = make_checkpoint(tmp_path_factory.mktemp("cv2") / "model", "tiny", seed=0)
    settings = CosyVoice2Settings(model_dir=str(model_dir), device="cpu")
    VoiceStore(settings.voices_path, CosyVoice2Frontend(model_dir)).add("narrator", prompt_wav(), PROMPT_TEXT)
    return model_dir


@pytest_asyncio.fixture(loop_scope="session")
async def engine(model_dir) -> AsyncIterator[CosyVoice2Engine]:
    """A fresh engine per test: a failed engine stays failed."""
    engine = CosyVoice2Engine(
        CosyVoice2Settings(model_dir=str(model_dir), device="cpu", stall_timeout_s=STALL_TIMEOUT_S)
    )
    torch.backends.cuda.enable_cudnn_sdp(False)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
def hung_call(engine, monkeypatch):
    """token2wav's next call never finishes (until the test ends): its wait for the GPU hangs."""
    release = threading.Event()

    def hang(launched):
        release.wait()
        raise RuntimeError("the test ended")

    monkeypatch.setattr(engine.runner, "finish", hang)
    yield
    release.set()


class SilentLMStream(LMStream):
    """An LM stream whose backend answers nothing: a dead vLLM engine core, or a stuck one."""

    def push_text_ids(self, ids):
        pass

    def end_text(self):
        pass

    def cancel(self):
        pass


def silence_the_lm(engine, monkeypatch) -> list[str]:
    """The LM answers nothing from now on; what the test appends to the list is why it died."""
    died: list[str] = []
    monkeypatch.setattr(engine.lm, "open", lambda *args, **callbacks: SilentLMStream())
    monkeypatch.setattr(engine.lm, "failure", lambda: died[0] if died else None)
    return died


async def speak_until_failure(engine: CosyVoice2Engine, fault=lambda: None) -> EngineError:
    """Speak TEXT; ``fault()`` strikes once the utterance is open."""
    utterance = engine.open_utterance(UtteranceOptions(engine.default_voice))
    fault()
    utterance.push_text(TEXT)
    utterance.end_input()
    with pytest.raises(EngineError) as failed:
        async with asyncio.timeout(30):  # the tiny model's first chunk, then the fault
            async for _ in utterance:
                pass
    return failed.value


def assert_failed(engine: CosyVoice2Engine, fragment: str) -> None:
    assert fragment in (engine.failure() or "")
    with pytest.raises(EngineError, match="can serve no more"):
        engine.open_utterance(UtteranceOptions(engine.default_voice))


async def test_a_token2wav_worker_raising_outside_a_request_fails_the_engine(engine, monkeypatch):
    def broken_plan(*args, **kwargs):
        raise RuntimeError("the call planner broke")

    monkeypatch.setattr(engine.runner, "plan", broken_plan)
    error = await speak_until_failure(engine)
    assert "the call planner broke" in str(error)
    assert_failed(engine, "token2wav worker failed")


async def test_a_dead_lm_backend_fails_every_utterance(engine, monkeypatch):
    died = silence_the_lm(engine, monkeypatch)
    error = await speak_until_failure(engine, lambda: died.append("the vLLM engine process has died"))
    assert "died" in str(error)
    assert_failed(engine, "died")


async def test_a_hung_lm_stage_is_caught_by_the_watchdog(engine, monkeypatch):
    silence_the_lm(engine, monkeypatch)
    error = await speak_until_failure(engine)
    assert "no speech token" in str(error)
    assert_failed(engine, "no speech token")


async def test_a_hung_token2wav_call_is_caught_by_the_watchdog(engine, hung_call):
    error = await speak_until_failure(engine)
    assert "token2wav call has run for more than" in str(error)
    assert_failed(engine, "token2wav call")


async def test_through_the_gateway_a_hung_stage_ends_every_context_and_readyz_turns_503(engine, hung_call):
    async with running_gateway(make_config(engine={"name": "cosyvoice2"}), engine) as gw:
        async with connect(ws_url(gw)) as ws:
            await recv_json(ws)
            for context_id in ("a", "b"):
                await ws.send(orjson.dumps({"type": "text", "context_id": context_id, "text": TEXT}).decode())
                await ws.send(orjson.dumps({"type": "end", "context_id": context_id}).decode())
            ended = {}
            while len(ended) < 2:
                frame = await recv_json(ws, timeout=30)
                if frame["type"] == "error" and frame["context_id"]:
                    ended[frame["context_id"]] = frame["code"]
                assert frame["type"] in ("audio", "error"), frame
            # The utterance raises (internal) or the gateway sees the failure first (engine_failed).
            assert set(ended) == {"a", "b"} and set(ended.values()) <= {"internal", "engine_failed"}
        status, body, _ = await http_get(f"http://127.0.0.1:{gw.port}/readyz")
        assert status == 503 and b"token2wav call" in body
