"""``tts-gateway doctor``: check this machine and config for what would stop the gateway.

Each check returns a :class:`Finding` (ok, warn, fail or skip) with what it saw and,
when something is wrong, the fix. Only what the configured engine needs is checked: Python
always; torch, the GPUs, their driver and NVML for an engine that runs on torch; and the
engine's own checks through its descriptor (CosyVoice2: vLLM, the model directory, voices,
GPU memory, CUDA MPS), run between the driver and NVML. So a CPU-only Piper setup hears
nothing of torch or vLLM. Checks that need a GPU are ``skip`` on a machine without one,
saying what is missing. A missing optional package (torch, nvidia-ml-py) is a finding, never
a crash. A problem is a ``fail`` when the configured engine (or backend) needs what is
missing, else a ``warn``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tts_gateway.engine.registry import ENGINES, Checkup, Finding, resolve
from tts_gateway.gateway.config import Config
from tts_gateway.gateway.gpu_metrics import load_nvml

NO_GPU = "no CUDA GPU visible: the vllm backend cannot run here; the piper engine and llm_backend=torch work"
MIN_PYTHON = (3, 11)
# The CUDA release that first compiles for an architecture, for the fix text.
MIN_CUDA_FOR_ARCH = {(12, 0): "12.8", (10, 0): "12.8", (9, 0): "11.8", (8, 9): "11.8"}


@dataclass
class Probe:
    """The optional modules doctor found: checks read them here, so tests can hand in fakes."""

    torch: Any | None
    torch_error: str
    nvml: Any | None  # pynvml, initialised, with at least one GPU
    nvml_error: str

    @classmethod
    def load(cls, uses_torch: bool = True) -> Probe:
        """What is installed; without ``uses_torch`` (an engine that runs without torch), neither
        torch nor NVML is loaded: nothing would read them."""
        if not uses_torch:
            return cls(None, "the configured engine does not use torch", None, "the configured engine uses no GPU")
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
    """Torch is there, as the configured engine needs it (its descriptor says what it needs)."""
    torch = probe.torch
    need = ENGINES[config.engine.name].torch_need(config.engine.selected)
    if torch is None:
        return Finding("torch", "fail", f"torch does not import ({probe.torch_error}); the {config.engine.name} "
                       "engine needs it", need.install)
    if torch.version.cuda is None:
        if need.cuda_for:
            return Finding("torch", "fail",
                           f"torch {torch.__version__} is a CPU-only build; {need.cuda_for} needs CUDA",
                           need.cuda_install)
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


def check_nvml(probe: Probe) -> Finding:
    if probe.nvml is not None:
        return Finding("nvml", "ok", f"NVML sees {probe.nvml.nvmlDeviceGetCount()} GPU(s): GPU metrics are exported")
    if _no_gpu(probe):
        return Finding("nvml", "skip", f"no GPU metrics: {probe.nvml_error}; they matter only on a GPU machine")
    return Finding("nvml", "warn", f"no GPU metrics on /metrics: {probe.nvml_error}",
                   "pip install 'tts-gateway[gpu]' (nvidia-ml-py)")


def uses_torch(config: Config) -> bool:
    return ENGINES[config.engine.name].torch_need is not None


def run_checks(config: Config, probe: Probe, environ: Mapping[str, str] = os.environ) -> list[Finding]:
    """The checks of what the configured engine needs, and of nothing else."""
    engine = ENGINES[config.engine.name]
    on_torch = uses_torch(config)
    findings = [check_python()]
    if on_torch:
        findings += [check_torch(probe, config), check_gpus(probe), check_driver(probe)]
    if engine.doctor:
        findings += resolve(engine.doctor)(engine_checkup(engine.name, config, probe, environ))
    if on_torch:
        findings.append(check_nvml(probe))
    return findings


def engine_checkup(name: str, config: Config, probe: Probe, environ: Mapping[str, str] = os.environ) -> Checkup:
    """What the checks of engine ``name`` see: its settings and the machine."""
    return Checkup(settings=getattr(config.engine, name),
                   torch=probe.torch, nvml=probe.nvml, no_gpu=_no_gpu(probe), environ=environ)


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
    probe = Probe.load(uses_torch(config))
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
