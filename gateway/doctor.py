"""``tts-gateway doctor``: check this machine and config for the traps of CosyVoice2 on vLLM.

Each check returns a :class:`Finding` (ok, warn, fail or skip) with what it saw and,
when something is wrong, the fix. Checks that need a GPU are ``skip`` on a machine
without one, saying what is missing. A missing optional package (torch, vllm,
nvidia-ml-py) is a finding, never a crash. Something only the ``vllm`` LLM backend
needs is a ``fail`` when that backend is configured and a ``warn`` otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cosyvoice2.modeldir.layout import MODEL_FILES, TOKENIZER_DIR, VOICE_MANIFEST, missing_files
from gateway.config import Config
from gateway.gpu_metrics import load_nvml

log = logging.getLogger("tts_gateway.doctor")

NO_GPU = "no CUDA GPU visible: the vllm backend cannot run here; the piper engine and llm_backend=torch work"
MIN_PYTHON = (3, 11)
# token2wav_memory_gb is read as GiB, the unit vLLM and nvidia-smi report in (and the
# larger reading, so the check errs on the safe side).
GIB = 2**30
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "cosyvoice2"
# Where CUDA clients look for the MPS control daemon when CUDA_MPS_PIPE_DIRECTORY is not set.
MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"
NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3  # nvmlComputeMode_t
# The CUDA release that first compiles for an architecture, for the fix text.
MIN_CUDA_FOR_ARCH = {(12, 0): "12.8", (10, 0): "12.8", (9, 0): "11.8", (8, 9): "11.8"}


@dataclass(frozen=True)
class Finding:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str = ""


@dataclass
class Probe:
    """The optional modules doctor found: checks read them here, so tests can hand in fakes."""

    torch: Any | None
    torch_error: str
    nvml: Any | None  # pynvml, initialised, with at least one GPU
    nvml_error: str

    @classmethod
    def load(cls) -> Probe:
        try:
            import torch
        except Exception as exc:  # ImportError, or a broken install (missing libs): both are findings
            torch, torch_error = None, f"{type(exc).__name__}: {exc}"
        else:
            torch_error = ""
        nvml, nvml_error = load_nvml()
        return cls(torch, torch_error, nvml, nvml_error)

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.nvmlShutdown()


# ---------------------------------------------------------------- checks


def check_python(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> Finding:
    shown = ".".join(map(str, version))
    if version[:2] >= MIN_PYTHON:
        return Finding("python", "ok", f"Python {shown}")
    return Finding("python", "fail", f"Python {shown}; the gateway needs 3.11 or newer", "use Python 3.11+")


def check_torch(probe: Probe, config: Config) -> Finding:
    torch = probe.torch
    if torch is None:
        status = "fail" if _cosyvoice2_selected(config) else "warn"
        return Finding("torch", status, f"torch does not import ({probe.torch_error}); the cosyvoice2 engine needs it",
                       "pip install -e '.[cosyvoice2]' (on a CPU machine first: pip install torch==2.13.0)")
    if torch.version.cuda is None:
        if _vllm_selected(config):
            return Finding("torch", "fail",
                           f"torch {torch.__version__} is a CPU-only build; llm_backend = vllm needs CUDA",
                           "install a CUDA build of torch, the version vllm pins (pip install -e '.[vllm]')")
        return Finding("torch", "ok", f"torch {torch.__version__}, CPU-only build")
    return Finding("torch", "ok", f"torch {torch.__version__}, built for CUDA {torch.version.cuda}")


def check_gpus(probe: Probe) -> Finding:
    """Every visible GPU's architecture must be one this torch has kernels for."""
    missing = _no_gpu(probe)
    if missing:
        return Finding("gpu", "skip", missing)
    cuda = probe.torch.cuda
    arch_list = cuda.get_arch_list()
    seen, broken = [], []
    for index in range(cuda.device_count()):
        capability = tuple(cuda.get_device_capability(index))
        arch = "sm_{}{}".format(*capability)
        seen.append(f"{index}: {cuda.get_device_name(index)} ({arch})")
        if not _runs_on(capability, arch_list):
            broken.append((arch, capability))
    if not broken:
        return Finding("gpu", "ok", "; ".join(seen))
    arch, capability = broken[0]
    cuda_min = MIN_CUDA_FOR_ARCH.get(capability)
    build = f"a torch built for CUDA {cuda_min}+ whose arch list includes {arch}" if cuda_min else (
        f"a torch build whose arch list includes {arch}")
    return Finding(
        "gpu", "fail",
        f"{'; '.join(seen)}. torch {probe.torch.__version__} has kernels for {', '.join(arch_list) or 'no GPU'}, "
        f"not {arch}: CUDA calls fail with 'no kernel image is available'",
        f"install {build} (torch.cuda.get_arch_list() must list {arch}), and the vllm release built for it",
    )


def check_driver(probe: Probe) -> Finding:
    """The driver's CUDA version must be at least the CUDA runtime torch was built with."""
    missing = _no_gpu(probe)
    if missing:
        return Finding("driver", "skip", missing)
    nvml = probe.nvml
    if nvml is None:
        return Finding("driver", "warn", f"cannot read the driver version: {probe.nvml_error}",
                       "pip install 'tts-gateway[gpu]' (nvidia-ml-py)")
    driver = _text(nvml.nvmlSystemGetDriverVersion())
    supported = _cuda_from_int(nvml.nvmlSystemGetCudaDriverVersion())
    runtime = tuple(int(part) for part in probe.torch.version.cuda.split(".")[:2])
    shown = f"driver {driver} supports CUDA {_dotted(supported)}; torch's runtime is CUDA {_dotted(runtime)}"
    if supported >= runtime:
        return Finding("driver", "ok", shown)
    return Finding("driver", "fail", shown + ": CUDA calls fail ('driver version is insufficient')",
                   f"upgrade the NVIDIA driver to one for CUDA {_dotted(runtime)}+, "
                   f"or install a torch built for CUDA {_dotted(supported)} or older")


def check_vllm(config: Config) -> Finding:
    status = "fail" if _vllm_selected(config) else "warn"
    if importlib.util.find_spec("vllm") is None:
        return Finding("vllm", status, "vllm is not installed; llm_backend = vllm needs it",
                       "on a machine with an NVIDIA GPU: pip install -e '.[vllm]' (vllm 0.26 pins torch 2.11)")
    try:
        vllm = importlib.import_module("vllm")
    except Exception as exc:  # a broken install raises anything from ImportError to RuntimeError: report it
        return Finding("vllm", status, f"vllm is installed but does not import: {type(exc).__name__}: {exc}",
                       "reinstall it with the torch it pins: pip install --force-reinstall -e '.[vllm]'")
    return Finding("vllm", "ok", f"vllm {vllm.__version__}")


def check_vllm_torch(config: Config) -> Finding:
    """vLLM's compiled kernels work only with the torch release it was built against."""
    try:
        requires = importlib.metadata.requires("vllm") or []
        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return Finding("vllm_torch", "skip", "vllm is not installed")
    from packaging.requirements import Requirement  # vllm depends on packaging

    pins = [r for r in map(Requirement, requires)
            if r.name == "torch" and (r.marker is None or r.marker.evaluate({"extra": ""}))]
    if not pins:
        return Finding("vllm_torch", "ok", f"vllm {vllm_version} names no torch version")
    wanted = ",".join(str(r.specifier) for r in pins)
    status = "fail" if _vllm_selected(config) else "warn"
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return Finding("vllm_torch", status, f"vllm {vllm_version} needs torch{wanted}; torch is not installed",
                       f"pip install 'torch{wanted}'")
    if all(r.specifier.contains(torch_version, prereleases=True) for r in pins):
        return Finding("vllm_torch", "ok",
                       f"vllm {vllm_version} wants torch{wanted}; torch {torch_version} is installed")
    return Finding("vllm_torch", status,
                   f"vllm {vllm_version} was built against torch{wanted} but torch {torch_version} is installed: "
                   "its kernels fail to load (undefined symbol) or crash",
                   f"pip install 'torch{wanted}' (the CUDA build), or the vllm release built for torch {torch_version}")


def check_vllm_plugin(config: Config) -> Finding:
    found = [ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if found:
        return Finding("vllm_plugin", "ok", f"{PLUGIN_GROUP}: {PLUGIN_NAME} = {found[0].value}")
    return Finding("vllm_plugin", "fail" if _vllm_selected(config) else "warn",
                   f"the gateway's vLLM plugin ({PLUGIN_GROUP}: {PLUGIN_NAME}) is not installed: "
                   "vLLM will not know the CosyVoice2 LM",
                   "pip install -e . in the tts-gateway checkout (entry points are registered at install time)")


def check_model_dir(config: Config) -> Finding:
    settings = config.engine.cosyvoice2
    if not settings.model_dir:
        if _cosyvoice2_selected(config):
            return Finding("model_dir", "fail", "engine.cosyvoice2.model_dir is not set",
                           "set it to the CosyVoice2-0.5B directory (config.toml or "
                           "TTS_GATEWAY__ENGINE__COSYVOICE2__MODEL_DIR)")
        return Finding("model_dir", "skip",
                       "engine.cosyvoice2.model_dir is not set (the cosyvoice2 engine is not selected)")
    root = Path(settings.model_dir)
    fix = f"put the complete official CosyVoice2-0.5B directory at {root}, or point engine.cosyvoice2.model_dir at it"
    if not root.is_dir():
        return Finding("model_dir", "fail", f"{root} is not a directory", fix)
    missing = missing_files(root)
    if missing:
        return Finding("model_dir", "fail", f"{root} is incomplete; missing: {', '.join(missing)}", fix)
    return Finding("model_dir", "ok", f"{root} has {', '.join(MODEL_FILES)} and {TOKENIZER_DIR}/")


def check_voices(config: Config) -> Finding:
    settings = config.engine.cosyvoice2
    if not (settings.voices_dir or settings.model_dir):
        return Finding("voices", "skip", "neither engine.cosyvoice2.voices_dir nor model_dir is set")
    directory = settings.voices_path
    names, unreadable = [], []
    manifests = sorted(directory.glob(f"[!.]*/{VOICE_MANIFEST}")) if directory.is_dir() else []  # "." = staging
    for manifest in manifests:
        try:
            names.append(str(json.loads(manifest.read_text(encoding="utf-8"))["name"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            unreadable.append(f"{manifest.parent.name} ({type(exc).__name__}: {exc})")
    note = ""
    if unreadable:  # the engine skips these voices too
        log.warning("unreadable voice manifests in %s: %s", directory, "; ".join(unreadable))
        note = f"; unreadable: {', '.join(unreadable)}"
    if names:
        return Finding("voices", "ok", f"{len(names)} voice(s) in {directory}: {', '.join(names)}{note}")
    return Finding("voices", "fail" if _cosyvoice2_selected(config) else "warn",
                   f"no voices registered in {directory}{note}",
                   "tts-gateway voice add NAME --wav PROMPT.wav --text TRANSCRIPT")


def check_vram(probe: Probe, config: Config) -> Finding:
    """vLLM takes gpu_memory_utilization of the whole card at start; token2wav needs its share beside it."""
    missing = _no_gpu(probe)
    if missing:
        return Finding("vram", "skip", missing)
    settings = config.engine.cosyvoice2
    index = _gpu_index(config)
    count = probe.torch.cuda.device_count()
    if index >= count:
        return Finding("vram", "fail" if _cosyvoice2_selected(config) else "warn",
                       f"engine.cosyvoice2.device is {settings.device} but {count} GPU(s) are visible",
                       f"set engine.cosyvoice2.device to cuda:0..cuda:{count - 1} (or check CUDA_VISIBLE_DEVICES)")
    free, total = probe.torch.cuda.mem_get_info(index)
    vllm = settings.vllm
    needed = vllm.gpu_memory_utilization * total + vllm.token2wav_memory_gb * GIB
    shown = (f"GPU {index}: {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB; "
             f"the vllm backend needs {needed / GIB:.1f} GiB (gpu_memory_utilization "
             f"{vllm.gpu_memory_utilization} x {total / GIB:.1f} GiB + token2wav_memory_gb {vllm.token2wav_memory_gb})")
    if free >= needed:
        return Finding("vram", "ok", shown)
    return Finding("vram", "fail" if _vllm_selected(config) else "warn", shown,
                   "lower [engine.cosyvoice2.vllm] gpu_memory_utilization, or token2wav_memory_gb together with "
                   "max_batch, or stop the other processes on the GPU (nvidia-smi lists them)")


def check_mps(probe: Probe, config: Config, environ=os.environ) -> Finding:
    """The vllm backend is two GPU processes: vLLM's engine core (the LLM stage) and the
    gateway (token2wav). Without CUDA MPS the GPU runs one process's kernels at a time, so
    each stage waits for the other's; an MPS daemon lets them run side by side."""
    missing = _no_gpu(probe)
    if missing:
        return Finding("mps", "skip", missing)
    if not _vllm_selected(config):
        return Finding("mps", "skip", "only the vllm backend runs two GPU processes")
    pipe = Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE)
    if (pipe / "control").exists():
        return Finding("mps", "ok", f"an MPS control daemon listens in {pipe}: the LLM stage and token2wav share the "
                       "GPU side by side")
    fix = ("start the MPS control daemon before the gateway, as the user that runs it: nvidia-cuda-mps-control -d "
           "(with the same CUDA_MPS_PIPE_DIRECTORY for both if not the default); see docs/cosyvoice2.md, CUDA MPS")
    index = _gpu_index(config)
    if probe.nvml is not None:
        handle = probe.nvml.nvmlDeviceGetHandleByIndex(index)
        if probe.nvml.nvmlDeviceGetComputeMode(handle) == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
            return Finding("mps", "fail", f"GPU {index} is in EXCLUSIVE_PROCESS compute mode and no MPS daemon listens "
                           f"in {pipe}: vLLM's engine core and the gateway cannot both use it", fix)
    return Finding("mps", "warn", f"no MPS control daemon in {pipe}: the LLM stage and token2wav take turns on "
                   "the GPU", fix)


def check_nvml(probe: Probe) -> Finding:
    if probe.nvml is not None:
        return Finding("nvml", "ok", f"NVML sees {probe.nvml.nvmlDeviceGetCount()} GPU(s): GPU metrics are exported")
    if _no_gpu(probe):
        return Finding("nvml", "skip", f"no GPU metrics: {probe.nvml_error}; they matter only on a GPU machine")
    return Finding("nvml", "warn", f"no GPU metrics on /metrics: {probe.nvml_error}",
                   "pip install 'tts-gateway[gpu]' (nvidia-ml-py)")


def run_checks(config: Config, probe: Probe) -> list[Finding]:
    return [
        check_python(),
        check_torch(probe, config),
        check_gpus(probe),
        check_driver(probe),
        check_vllm(config),
        check_vllm_torch(config),
        check_vllm_plugin(config),
        check_model_dir(config),
        check_voices(config),
        check_vram(probe, config),
        check_mps(probe, config),
        check_nvml(probe),
    ]


# ---------------------------------------------------------------- output


def format_table(findings: list[Finding]) -> str:
    width = max(len(f.name) for f in findings)
    lines = []
    for finding in findings:
        lines.append(f"{finding.status:<4}  {finding.name:<{width}}  {finding.detail}")
        if finding.fix and finding.status in ("warn", "fail"):
            lines.append(f"{'':<4}  {'':<{width}}  fix: {finding.fix}")
    counts = {status: sum(f.status == status for f in findings) for status in ("ok", "warn", "fail", "skip")}
    lines.append(", ".join(f"{n} {status}" for status, n in counts.items()))
    return "\n".join(lines)


def run_doctor(config: Config, *, as_json: bool = False) -> int:
    """Print the findings; 1 if any failed, else 0."""
    probe = Probe.load()
    try:
        findings = run_checks(config, probe)
    finally:
        probe.close()
    failed = any(f.status == "fail" for f in findings)
    if as_json:
        print(json.dumps({"ok": not failed, "findings": [dataclasses.asdict(f) for f in findings]}, indent=2))
    else:
        print(format_table(findings))
    return 1 if failed else 0


# ---------------------------------------------------------------- helpers


def _cosyvoice2_selected(config: Config) -> bool:
    return config.engine.name == "cosyvoice2"


def _vllm_selected(config: Config) -> bool:
    return _cosyvoice2_selected(config) and config.engine.cosyvoice2.llm_backend == "vllm"


def _gpu_index(config: Config) -> int:
    """The engine's GPU: auto, cuda -> 0; cuda:N -> N."""
    return int(config.engine.cosyvoice2.device.partition(":")[2] or 0)


def _no_gpu(probe: Probe) -> str:
    """Why GPU checks cannot run here, or "" when a CUDA GPU is visible."""
    torch = probe.torch
    if torch is None:
        return f"torch is not installed, so no GPU can be used: {NO_GPU}"
    if torch.version.cuda is None:
        return f"{NO_GPU} (torch {torch.__version__} is a CPU-only build)"
    if not torch.cuda.is_available():
        return f"{NO_GPU} (torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no device: " \
               "no NVIDIA driver loaded, or CUDA_VISIBLE_DEVICES hides them)"
    return ""


def _runs_on(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a cubin in ``arch_list`` runs on ``capability``: same major, minor not above
    (sm_80 code runs on sm_86, not the reverse; nothing crosses majors, so sm_90 does not
    run on sm_120). Arch-specific builds (sm_90a) count as their base architecture."""
    for arch in arch_list:
        if not arch.startswith("sm_"):
            continue
        digits = arch[3:].rstrip("abcdefghijklmnopqrstuvwxyz")
        major, minor = int(digits[:-1]), int(digits[-1])
        if major == capability[0] and minor <= capability[1]:
            return True
    return False


def _cuda_from_int(version: int) -> tuple[int, int]:
    """NVML's CUDA version, 12080, as (12, 8)."""
    return version // 1000, version % 1000 // 10


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def _text(value: str | bytes) -> str:
    """Old nvidia-ml-py releases return bytes."""
    return value.decode() if isinstance(value, bytes) else value
