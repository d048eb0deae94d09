"""config.gpu.toml, the GPU quick start: it loads and validates (with the model directory
given as the README says), runs CosyVoice2 on vLLM on the GPU, and holds the settings that
bench/gpu_check.py measures (docs/benchmarks.md), but for the few it sets on purpose otherwise."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from tts_gateway.gateway.config import load_config
from tests.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

GPU_CONFIG = ROOT / "config.gpu.toml"
MODEL_DIR = {"TTS_GATEWAY__ENGINE__COSYVOICE2__MODEL_DIR": "/models/CosyVoice2-0.5B"}
# Where the quick start parts from the benchmark's gateway.toml, and why.
NOT_AS_BENCHMARKED = {
    "model_dir": "the user's",
    # Random weights never sample eos, so the benchmark caps replies at a speaking rate; real
    # weights end their replies, and the official bound (20) only stops a runaway one.
    "max_speech_per_text_token": "the official bound",
    # docs/cosyvoice2.md's value for 80-141 GB cards, from the H200 runs of 2026-12-04.
    "first_chunk_by_load": "measured since",
}


def test_the_gpu_config_loads_with_a_model_dir_and_runs_cosyvoice2_on_vllm():
    config = load_config(GPU_CONFIG, env=MODEL_DIR)
    settings = config.engine.selected
    assert config.engine.name == "cosyvoice2" and settings.model_dir == "/models/CosyVoice2-0.5B"
    assert (settings.device, settings.llm_backend, settings.dtype, settings.flow_mode) == (
        "cuda", "vllm", "bfloat16", "paged")
    assert (settings.max_batch, settings.graph_max_batch, settings.vllm.enforce_eager) == (64, 64, False)


def test_the_gpu_config_holds_the_benchmarked_settings(tmp_path):
    benchmarked_file = tmp_path / "gateway.toml"
    gpu_check.write_config(benchmarked_file, tmp_path / "model", gpu_check.argument_parser().parse_args([]))
    benchmarked = load_config(benchmarked_file, env={}).engine.cosyvoice2
    quick_start = load_config(GPU_CONFIG, env=MODEL_DIR).engine.cosyvoice2

    def differences(a, b, prefix=""):
        found = {}
        for field in dataclasses.fields(a):
            mine, theirs = getattr(a, field.name), getattr(b, field.name)
            if dataclasses.is_dataclass(mine):
                found |= differences(mine, theirs, f"{field.name}.")
            elif mine != theirs:
                found[prefix + field.name] = (mine, theirs)
        return found

    parted = differences(quick_start, benchmarked)
    assert {name.rpartition(".")[2] for name in parted} == set(NOT_AS_BENCHMARKED), parted



def test_serve_sh_refuses_an_extra_pyproject_lacks():
    """A misspelt extra stops the quick start before anything is installed (pip would only warn)."""
    result = subprocess.run(["bash", str(ROOT / "scripts" / "serve.sh"), "--config", str(GPU_CONFIG)],
                            env={**os.environ, "EXTRAS": "vllm,gpus"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "EXTRAS names 'gpus', which pyproject.toml lacks" in result.stderr and " gpu " in result.stderr
