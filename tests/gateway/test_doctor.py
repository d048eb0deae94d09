"""`tts-gateway doctor`: on this CPU machine through the CLI, and its GPU branches with a fake torch and NVML.

The gateway's own checks are in gateway/doctor.py, CosyVoice2's in engine/cosyvoice2/doctor.py
(run through its descriptor); both are tested here, as the one report a user reads."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tts_gateway.engine.cosyvoice2 import doctor as cv2_doctor
from tts_gateway.engine.descriptor import Checkup
from tts_gateway.gateway import doctor
from tts_gateway.gateway.config import load_config
from tts_gateway.gateway.doctor import Probe

CLI = [sys.executable, "-m", "tts_gateway.gateway"]
CHECKS = (
    "python", "torch", "gpu", "driver", "vllm", "vllm_torch", "vllm_plugin", "model_dir", "voices", "vram", "mps",
    "nvml",
)
GIB = 2**30


def run_doctor(cwd, *args: str, env: dict | None = None) -> tuple[int, dict]:
    result = subprocess.run(
        [*CLI, "doctor", "--json", *args], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})},
    )
    return result.returncode, json.loads(result.stdout)


def by_name(report: dict) -> dict[str, dict]:
    return {f["name"]: f for f in report["findings"]}


def config_with(**env: str):
    return load_config(None, env={f"TTS_GATEWAY__{key.upper()}": value for key, value in env.items()})


def checkup(config, machine: Probe | None = None, environ: dict | None = None) -> Checkup:
    """What CosyVoice2's checks see under ``config``, on ``machine`` (by default a faked GPU one)."""
    return doctor.engine_checkup("cosyvoice2", config, machine or probe(), environ or {})


# ---------------------------------------------------------------- this CPU machine, through the CLI


def test_a_cpu_piper_setup_is_checked_for_what_piper_needs_only(tmp_path):
    """The default config runs the Piper voice: no torch, vLLM or GPU check has anything to say."""
    code, report = run_doctor(tmp_path)
    assert code == 0 and report["ok"] is True
    assert [(f["name"], f["status"]) for f in report["findings"]] == [("python", "ok")]
    table = subprocess.run([*CLI, "doctor"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "torch" not in table.stdout.lower() and "vllm" not in table.stdout.lower(), table.stdout


COSYVOICE2_ON_TORCH = {"TTS_GATEWAY__ENGINE__NAME": "cosyvoice2"}


def test_cpu_machine_says_what_cosyvoice2_misses(tmp_path):
    code, report = run_doctor(tmp_path, env=COSYVOICE2_ON_TORCH)
    findings = by_name(report)
    assert tuple(findings) == CHECKS
    assert code == 1 and report["ok"] is False  # no model directory
    assert findings["python"]["status"] == "ok"
    assert findings["torch"]["status"] == "ok" and "CPU-only" in findings["torch"]["detail"]
    for name in ("gpu", "driver", "vram", "mps"):
        assert findings[name]["status"] == "skip"
        assert "no CUDA GPU visible" in findings[name]["detail"]
        assert "CPU-only build" in findings[name]["detail"]
    assert findings["nvml"]["status"] == "skip" and "nvidia-ml-py is not installed" in findings["nvml"]["detail"]
    # vllm is not installed here; the torch backend is configured, so that is a warning, with its fix.
    assert findings["vllm"]["status"] == "warn"
    assert "not installed" in findings["vllm"]["detail"] and "pip install -e '.[vllm]'" in findings["vllm"]["fix"]
    assert findings["vllm_torch"]["status"] == "skip"
    # The test command installs this checkout, which registers the plugin entry point.
    assert findings["vllm_plugin"]["status"] == "ok" and "vllm_plugin:register" in findings["vllm_plugin"]["detail"]
    assert findings["model_dir"]["status"] == "fail" and "model_dir is not set" in findings["model_dir"]["detail"]


def test_vllm_backend_configured_without_vllm_fails(tmp_path):
    env = {**COSYVOICE2_ON_TORCH, "TTS_GATEWAY__ENGINE__COSYVOICE2__LLM_BACKEND": "vllm"}
    code, report = run_doctor(tmp_path, env=env)
    findings = by_name(report)
    assert code == 1 and report["ok"] is False
    assert findings["vllm"]["status"] == "fail" and "pip install" in findings["vllm"]["fix"]
    assert findings["torch"]["status"] == "fail" and "CPU-only" in findings["torch"]["detail"]
    assert findings["model_dir"]["status"] == "fail"


def test_table_output_names_each_check_and_its_fix(tmp_path):
    result = subprocess.run([*CLI, "doctor"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, **COSYVOICE2_ON_TORCH})
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("warn") and "vllm " in line for line in lines)
    assert any("fix: on a machine with an NVIDIA GPU" in line for line in lines)
    assert any(line.startswith("fail") and "model_dir " in line for line in lines)
    assert lines[-1].endswith("skip")


# ---------------------------------------------------------------- model directory and voices


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tts_gateway.testkit.checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("doctor") / "model", "tiny", seed=0)


def test_model_dir_missing_llm_pt_fails_naming_it(tiny_model, tmp_path):
    broken = shutil.copytree(tiny_model, tmp_path / "model")
    (broken / "llm.pt").unlink()
    finding = cv2_doctor.check_model_dir(checkup(config_with(engine__cosyvoice2__model_dir=str(broken))))
    assert finding.status == "fail" and "missing: llm.pt" in finding.detail and str(broken) in finding.fix


def test_model_dir_without_tokenizer_files_fails(tiny_model, tmp_path):
    broken = shutil.copytree(tiny_model, tmp_path / "model")
    for name in ("tokenizer.json", "merges.txt"):
        (broken / "CosyVoice-BlankEN" / name).unlink()
    finding = cv2_doctor.check_model_dir(checkup(config_with(engine__cosyvoice2__model_dir=str(broken))))
    assert finding.status == "fail" and "CosyVoice-BlankEN/tokenizer.json" in finding.detail


def test_complete_model_dir_with_a_voice_is_ok(tiny_model, tmp_path):
    from tts_gateway.engine.cosyvoice2.frontend.prompt import CosyVoice2Frontend
    from tts_gateway.engine.cosyvoice2.frontend.voices import VoiceStore

    from tests.engine.cosyvoice2.test_engine import PROMPT_TEXT, prompt_wav

    voices = tmp_path / "voices"
    config_file = tmp_path / "config.toml"
    config_file.write_text(
        f'[engine]\nname = "cosyvoice2"\n[engine.cosyvoice2]\nmodel_dir = "{tiny_model}"\nvoices_dir = "{voices}"\n'
    )
    _, report = run_doctor(tmp_path, "--config", str(config_file))
    assert by_name(report)["voices"]["status"] == "fail"  # cosyvoice2 selected: it could not start
    assert "tts-gateway voice add" in by_name(report)["voices"]["fix"]

    VoiceStore(voices, CosyVoice2Frontend(tiny_model)).add("narrator", prompt_wav(), PROMPT_TEXT)
    code, report = run_doctor(tmp_path, "--config", str(config_file))
    findings = by_name(report)
    assert findings["model_dir"]["status"] == "ok"
    assert findings["voices"]["status"] == "ok" and "narrator" in findings["voices"]["detail"]
    assert code == 0


# ---------------------------------------------------------------- GPU branches, faked


def fake_torch(*, capability=(9, 0), arch_list=("sm_80", "sm_90"), cuda="12.8", free=100 * GIB, total=140 * GIB):
    return SimpleNamespace(
        __version__="2.11.0+cu128",
        version=SimpleNamespace(cuda=cuda),
        cuda=SimpleNamespace(
            is_available=lambda: True,
            device_count=lambda: 1,
            get_device_capability=lambda index: capability,
            get_device_name=lambda index: "NVIDIA GeForce RTX 5090",
            get_arch_list=lambda: list(arch_list),
            mem_get_info=lambda index: (free, total),
        ),
    )


def fake_nvml(*, cuda_driver=12080, driver="570.86.10", compute_mode=0):
    return SimpleNamespace(
        nvmlSystemGetDriverVersion=lambda: driver,
        nvmlSystemGetCudaDriverVersion=lambda: cuda_driver,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetComputeMode=lambda handle: compute_mode,
    )


def probe(torch=None, nvml=None) -> Probe:
    return Probe(torch or fake_torch(), "", nvml, "" if nvml else "nvidia-ml-py is not installed")


def test_gpu_architecture_missing_from_torch_fails_naming_sm_120():
    finding = doctor.check_gpus(probe(fake_torch(capability=(12, 0), arch_list=("sm_80", "sm_90", "sm_100"))))
    assert finding.status == "fail"
    assert "sm_120" in finding.detail and "RTX 5090" in finding.detail
    assert "sm_120" in finding.fix and "CUDA 12.8" in finding.fix


def test_gpu_architecture_in_the_arch_list_is_ok():
    assert doctor.check_gpus(probe(fake_torch(capability=(12, 0), arch_list=("sm_90", "sm_120")))).status == "ok"
    # Same major, newer minor runs older cubins (sm_86 runs sm_80 code); not the reverse.
    assert doctor.check_gpus(probe(fake_torch(capability=(8, 6), arch_list=("sm_80",)))).status == "ok"
    assert doctor.check_gpus(probe(fake_torch(capability=(8, 0), arch_list=("sm_86",)))).status == "fail"


def test_free_vram_below_the_budget_fails_with_the_vllm_backend():
    vllm = config_with(engine__name="cosyvoice2", engine__cosyvoice2__llm_backend="vllm",
                       engine__cosyvoice2__vllm__gpu_memory_utilization="0.5",
                       engine__cosyvoice2__vllm__token2wav_memory_gb="16")
    # needed: 0.5 * 32 GiB + 16 GiB = 32 GiB; 20 GiB free (another process holds the rest)
    small_card = fake_torch(free=20 * GIB, total=32 * GIB)
    finding = cv2_doctor.check_vram(checkup(vllm, probe(small_card)))
    assert finding.status == "fail" and "needs 32.0 GiB" in finding.detail
    assert "gpu_memory_utilization" in finding.fix
    assert cv2_doctor.check_vram(checkup(config_with(), probe(small_card))).status == "warn"  # the torch backend takes no vLLM share
    large_card = fake_torch(free=40 * GIB, total=141 * GIB)
    assert cv2_doctor.check_vram(checkup(config_with(), probe(large_card))).status == "warn"
    idle_card = fake_torch(free=140 * GIB, total=141 * GIB)
    assert cv2_doctor.check_vram(checkup(vllm, probe(idle_card))).status == "ok"


def test_device_index_beyond_the_visible_gpus_fails():
    config = config_with(engine__name="cosyvoice2", engine__cosyvoice2__device="cuda:3")
    finding = cv2_doctor.check_vram(checkup(config, probe()))
    assert finding.status == "fail" and "cuda:3" in finding.detail


def test_driver_older_than_the_cuda_runtime_fails():
    finding = doctor.check_driver(probe(fake_torch(cuda="12.8"), fake_nvml(cuda_driver=12040)))
    assert finding.status == "fail"
    assert "supports CUDA 12.4" in finding.detail and "CUDA 12.8" in finding.detail
    assert doctor.check_driver(probe(fake_torch(cuda="12.8"), fake_nvml(cuda_driver=12090))).status == "ok"
    no_nvml = doctor.check_driver(probe(fake_torch()))
    assert no_nvml.status == "warn" and "nvidia-ml-py" in no_nvml.fix
    assert doctor.check_nvml(probe(fake_torch())).status == "warn"


def test_vllm_built_for_another_torch_is_reported(monkeypatch):
    versions = {"vllm": "0.26.0", "torch": "2.13.0+cu128"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
    monkeypatch.setattr(importlib.metadata, "requires",
                        lambda name: ["torch==2.11.0", "numpy", 'torch==2.11.0; extra == "audio"'])
    with_vllm = config_with(engine__name="cosyvoice2", engine__cosyvoice2__llm_backend="vllm")
    finding = cv2_doctor.check_vllm_torch(checkup(with_vllm))
    assert finding.status == "fail"
    assert "torch==2.11.0" in finding.detail and "2.13.0+cu128" in finding.detail
    assert "pip install 'torch==2.11.0'" in finding.fix
    versions["torch"] = "2.11.0+cu128"
    assert cv2_doctor.check_vllm_torch(checkup(config_with())).status == "ok"


def test_vllm_plugin_entry_point_found(monkeypatch):
    plugin = importlib.metadata.EntryPoint("cosyvoice2", "tts_gateway.engine.cosyvoice2.serving.lm.vllm_plugin:register",
                                           cv2_doctor.PLUGIN_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [plugin] if group == cv2_doctor.PLUGIN_GROUP else [])
    finding = cv2_doctor.check_vllm_plugin(checkup(config_with()))
    assert finding.status == "ok" and "vllm_plugin:register" in finding.detail


def test_vllm_plugin_entry_point_missing(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    finding = cv2_doctor.check_vllm_plugin(checkup(config_with()))
    assert finding.status == "warn" and "pip install -e ." in finding.fix
    with_vllm = config_with(engine__name="cosyvoice2", engine__cosyvoice2__llm_backend="vllm")
    assert cv2_doctor.check_vllm_plugin(checkup(with_vllm)).status == "fail"


def test_without_torch_every_check_still_answers():
    no_torch = Probe(None, "ModuleNotFoundError: No module named 'torch'", None, "nvidia-ml-py is not installed")
    findings = {f.name: f for f in doctor.run_checks(config_with(engine__name="cosyvoice2"), no_torch)}
    assert tuple(findings) == CHECKS
    assert findings["torch"].status == "fail" and "pip install -e '.[cosyvoice2]'" in findings["torch"].fix
    for name in ("gpu", "driver", "vram", "mps"):
        assert findings[name].status == "skip" and "torch is not installed" in findings[name].detail
    assert findings["nvml"].status == "skip" and "nvidia-ml-py" in findings["nvml"].detail


def test_old_python_fails():
    assert doctor.check_python((3, 10, 12)).status == "fail"
    assert doctor.check_python((3, 13, 0)).status == "ok"


def test_mps_daemon_found_missing_or_required(tmp_path):
    """The vllm backend's two GPU processes take turns on the GPU without an MPS daemon (a
    warning with the command that starts one), and cannot share a GPU in EXCLUSIVE_PROCESS
    mode without it (a failure)."""
    vllm = config_with(engine__name="cosyvoice2", engine__cosyvoice2__llm_backend="vllm")
    environ = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    missing = cv2_doctor.check_mps(checkup(vllm, probe(nvml=fake_nvml()), environ))
    assert missing.status == "warn" and str(tmp_path) in missing.detail and "nvidia-cuda-mps-control -d" in missing.fix
    exclusive = cv2_doctor.check_mps(checkup(vllm, probe(nvml=fake_nvml(compute_mode=3)), environ))
    assert exclusive.status == "fail" and "EXCLUSIVE_PROCESS" in exclusive.detail
    (tmp_path / "control").touch()  # the control daemon's socket
    assert cv2_doctor.check_mps(checkup(vllm, probe(nvml=fake_nvml(compute_mode=3)), environ)).status == "ok"
    piper = config_with()
    assert cv2_doctor.check_mps(checkup(piper, probe(), environ)).status == "skip"  # piper: one GPU process at most
    assert cv2_doctor.MPS_DEFAULT_PIPE in cv2_doctor.check_mps(checkup(vllm, probe(), {})).detail
