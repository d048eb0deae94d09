"""CosyVoice2 as the gateway sees it, without importing torch or the engine."""

from __future__ import annotations

import argparse
from pathlib import Path

from tts_gateway.engine.cosyvoice2 import metrics
from tts_gateway.engine.cosyvoice2.settings import CosyVoice2Settings
from tts_gateway.engine.descriptor import CliVerb, EngineDescriptor, TorchNeed


def torch_need(settings: CosyVoice2Settings) -> TorchNeed:
    install = "pip install -e '.[cosyvoice2]' (on a CPU machine first: pip install torch==2.13.0)"
    if settings.llm_backend == "vllm":
        return TorchNeed(install, cuda_for="llm_backend = vllm",
                         cuda_install="install a CUDA build of torch, the version vllm pins (pip install -e '.[vllm]')")
    return TorchNeed(install)


def voice_add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="a name for the voice")
    parser.add_argument("--wav", required=True, type=Path, help="prompt recording (WAV, 3-30 s of clean speech)")
    parser.add_argument("--text", required=True, help="exactly what is said in the recording")


CLI = (
    CliVerb("make-checkpoint", "write a random-weight CosyVoice2 model directory (tests, benchmarks)",
            run="tts_gateway.testkit.checkpoint:main_make_checkpoint", extra="cosyvoice2", own_parser=True),
    CliVerb("voice", "manage CosyVoice2 zero-shot voices", verbs=(
        CliVerb("add", "register a voice from a prompt recording and its transcript",
                run="tts_gateway.engine.cosyvoice2.commands:voice_add", extra="cosyvoice2", arguments=voice_add_arguments),
        CliVerb("list", "list registered voices", run="tts_gateway.engine.cosyvoice2.commands:voice_list", extra="cosyvoice2"),
    )),
)

COSYVOICE2 = EngineDescriptor(
    name="cosyvoice2",
    settings=CosyVoice2Settings,
    factory="tts_gateway.engine.cosyvoice2.engine:CosyVoice2Engine",
    gauges=metrics.GAUGES,
    totals=metrics.TOTALS,
    doctor="tts_gateway.engine.cosyvoice2.doctor:run_checks",
    torch_need=torch_need,
    cli=CLI,
)
