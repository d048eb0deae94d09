"""The Piper voice as the gateway sees it, without importing the engine."""

from __future__ import annotations

from tts_gateway.engine.descriptor import EngineDescriptor
from tts_gateway.engine.piper.settings import PiperSettings

PIPER = EngineDescriptor(
    name="piper",
    settings=PiperSettings,
    factory="tts_gateway.engine.piper.engine:PiperEngine",
)
