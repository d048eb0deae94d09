"""CosyVoice2 as the gateway sees it, without importing torch or the engine."""

from __future__ import annotations

from engine.cosyvoice2 import metrics
from engine.cosyvoice2.settings import CosyVoice2Settings
from engine.descriptor import EngineDescriptor, TorchNeed


def torch_need(settings: CosyVoice2Settings) -> TorchNeed:
    install = "pip install -e '.[cosyvoice2]' (on a CPU machine first: pip install torch==2.13.0)"
    if settings.llm_backend == "vllm":
        return TorchNeed(install, cuda_for="llm_backend = vllm",
                         cuda_install="install a CUDA build of torch, the version vllm pins (pip install -e '.[vllm]')")
    return TorchNeed(install)


COSYVOICE2 = EngineDescriptor(
    name="cosyvoice2",
    settings=CosyVoice2Settings,
    factory="engine.cosyvoice2.engine:CosyVoice2Engine",
    gauges=metrics.GAUGES,
    totals=metrics.TOTALS,
    doctor="engine.cosyvoice2.doctor:run_checks",
    torch_need=torch_need,
)
