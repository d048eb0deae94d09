"""The Piper voice as the gateway sees it, without importing the engine."""

from __future__ import annotations

from engine.descriptor import EngineDescriptor
from engine.piper.settings import PiperSettings

PIPER = EngineDescriptor(
    name="piper",
    settings=PiperSettings,
    factory="engine.piper.engine:PiperEngine",
)
