"""The Pipecat service against a Piper gateway, in a real Pipecat pipeline.

An LLM-like reply streams in as deltas: audio comes before the text has ended, Pipecat
gets word-timestamp frames with the agent's words, in order; an interruption mid-reply
stops the audio, and none of that turn comes after it.
"""

from __future__ import annotations

import asyncio
import time

from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.metrics.metrics import TTFBMetricsData
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from tts_gateway.integrations.pipecat import GatewayTTSService

from tests.conftest import eventually, ws_url

REPLY = (
    "Sure! The total comes to $3.50, and your order ships today. "
    "You can track it online, and our team will email you when it arrives. "
    "Is there anything else I can help you with this afternoon?"
)


def deltas(text: str, size: int = 6) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


class Recorder(FrameProcessor):
    """The pipeline's last stage: keeps every downstream frame with when it arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[tuple[float, Frame]] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        self.frames.append((time.monotonic(), frame))
        await self.push_frame(frame, direction)

    def of(self, kind: type) -> list[tuple[float, Frame]]:
        return [(at, frame) for at, frame in self.frames if isinstance(frame, kind)]


class Harness:
    def __init__(self, url: str) -> None:
        self.recorder = Recorder()
        self.tts = GatewayTTSService(url=url)
        params = PipelineParams(audio_out_sample_rate=16000, enable_metrics=True)
        self.worker = PipelineWorker(Pipeline([self.tts, self.recorder]), params=params, cancel_on_idle_timeout=False)
        self.started = asyncio.Event()

        @self.worker.event_handler("on_pipeline_started")
        async def started(worker, frame):
            self.started.set()

    async def __aenter__(self) -> Harness:
        self.runner = WorkerRunner()
        await self.runner.add_workers(self.worker)
        self.running = asyncio.create_task(self.runner.run())
        await asyncio.wait_for(self.started.wait(), 10)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.worker.queue_frame(EndFrame())
        await asyncio.wait_for(self.running, 20)

    async def stream(self, text: str, pause_s: float = 0.02) -> float:
        """Queue an LLM reply delta by delta; returns when its last delta was queued."""
        await self.worker.queue_frame(LLMFullResponseStartFrame())
        for delta in deltas(text):
            await self.worker.queue_frame(LLMTextFrame(delta))
            await asyncio.sleep(pause_s)
        last_text_at = time.monotonic()
        await self.worker.queue_frame(LLMFullResponseEndFrame())
        return last_text_at


async def test_a_streamed_reply_is_spoken_with_word_timestamps(gateway):
    async with Harness(ws_url(gateway)) as harness:
        last_text_at = await harness.stream(REPLY, pause_s=0.05)
        await eventually(lambda: harness.recorder.of(TTSStoppedFrame), timeout=30)
        audio = harness.recorder.of(TTSAudioRawFrame)
        words = [frame for _, frame in harness.recorder.of(TTSTextFrame)]
        ttfb = [
            data
            for _, frame in harness.recorder.of(MetricsFrame)
            for data in frame.data
            if isinstance(data, TTFBMetricsData)
        ]
    assert audio and audio[0][0] < last_text_at, "the first audio waited for the whole reply"
    assert all(frame.sample_rate == 16000 for _, frame in audio)
    assert " ".join(frame.text for frame in words) == REPLY
    timestamps = [frame.pts for frame in words]
    assert timestamps == sorted(timestamps)
    assert ttfb and ttfb[-1].value > 0  # the turn's, after the pipeline's initial empty one


async def test_an_interruption_stops_the_turn_and_no_audio_follows(gateway):
    async with Harness(ws_url(gateway)) as harness:
        streaming = asyncio.create_task(harness.stream(REPLY * 3, pause_s=0.01))
        await eventually(lambda: harness.recorder.of(TTSAudioRawFrame), timeout=30)
        streaming.cancel()  # the user speaks: the LLM stops, and the turn is interrupted
        await asyncio.gather(streaming, return_exceptions=True)
        await harness.worker.queue_frame(InterruptionFrame())
        await eventually(lambda: harness.recorder.of(InterruptionFrame), timeout=10)
        interrupted_at = harness.recorder.of(InterruptionFrame)[0][0]
        await asyncio.sleep(1.5)  # long enough for the rest of the reply to have been spoken
        after = [frame for at, frame in harness.recorder.of(TTSAudioRawFrame) if at > interrupted_at]
        spoken_words = [frame.text for _, frame in harness.recorder.of(TTSTextFrame)]
    assert after == []
    assert len(" ".join(spoken_words)) < len(REPLY * 3)
    # The interruption reached the gateway as a cancel: it stopped generating the turn.
    metrics = gateway.metrics.render().decode()
    assert 'tts_contexts_total{outcome="cancelled"} 1.0' in metrics, [
        line for line in metrics.splitlines() if line.startswith("tts_contexts_total")
    ]
