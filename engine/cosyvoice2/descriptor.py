"""CosyVoice2 as the gateway sees it, without importing torch or the engine."""

from __future__ import annotations

from engine.cosyvoice2 import metrics
from engine.cosyvoice2.settings import CosyVoice2Settings
from engine.descriptor import EngineDescriptor

COSYVOICE2 = EngineDescriptor(
    name="cosyvoice2",
    settings=CosyVoice2Settings,
    factory="engine.cosyvoice2.engine:CosyVoice2Engine",
    gauges=metrics.GAUGES,
    totals=metrics.TOTALS,
)
