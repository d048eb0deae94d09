"""CosyVoice2's ``tts-gateway doctor`` checks: vLLM and its torch, the vLLM plugin, the model
directory, the voices, GPU memory and CUDA MPS.

Each check takes a :class:`Checkup` and returns a :class:`Finding`. A missing optional
package (vllm) is a finding, never a crash; torch is not imported here (the checkup carries
it), so the checks run where it is missing. They run when CosyVoice2 is the configured
engine; a problem is ``fail`` when it stops the engine as configured (for what only the vLLM
backend needs, when that backend is configured), else ``warn``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import logging
from pathlib import Path

from tts_gateway.engine.cosyvoice2.modeldir.layout import MODEL_FILES, TOKENIZER_DIR, VOICE_MANIFEST, missing_files
from tts_gateway.engine.cosyvoice2.settings import CosyVoice2Settings
from tts_gateway.engine.descriptor import Checkup, Finding

log = logging.getLogger(__name__)

# token2wav_memory_gb is read as GiB, the unit vLLM and nvidia-smi report in (and the
# larger reading, so the check errs on the safe side).
GIB = 2**30
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "cosyvoice2"
# Where CUDA clients look for the MPS control daemon when CUDA_MPS_PIPE_DIRECTORY is not set.
MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"
NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3  # nvmlComputeMode_t


def run_checks(checkup: Checkup) -> list[Finding]:
    return [
        check_vllm(checkup),
        check_vllm_torch(checkup),
        check_vllm_plugin(checkup),
        check_model_dir(checkup),
        check_voices(checkup),
        check_vram(checkup),
        check_mps(checkup),
    ]


def check_vllm(checkup: Checkup) -> Finding:
    status = checkup.problem(_uses_vllm(checkup))
    if importlib.util.find_spec("vllm") is None:
        return Finding("vllm", status, "vllm is not installed; llm_backend = vllm needs it",
                       "on a machine with an NVIDIA GPU: pip install -e '.[vllm]' (vllm 0.26 pins torch 2.11)")
    try:
        vllm = importlib.import_module("vllm")
    except Exception as exc:  # a broken install raises anything from ImportError to RuntimeError: report it
        return Finding("vllm", status, f"vllm is installed but does not import: {type(exc).__name__}: {exc}",
                       "reinstall it with the torch it pins: pip install --force-reinstall -e '.[vllm]'")
    return Finding("vllm", "ok", f"vllm {vllm.__version__}")


def check_vllm_torch(checkup: Checkup) -> Finding:
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
    status = checkup.problem(_uses_vllm(checkup))
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


def check_vllm_plugin(checkup: Checkup) -> Finding:
    found = [ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if found:
        return Finding("vllm_plugin", "ok", f"{PLUGIN_GROUP}: {PLUGIN_NAME} = {found[0].value}")
    return Finding("vllm_plugin", checkup.problem(_uses_vllm(checkup)),
                   f"the gateway's vLLM plugin ({PLUGIN_GROUP}: {PLUGIN_NAME}) is not installed: "
                   "vLLM will not know the CosyVoice2 LM",
                   "pip install -e . in the tts-gateway checkout (entry points are registered at install time)")


def check_model_dir(checkup: Checkup) -> Finding:
    settings: CosyVoice2Settings = checkup.settings
    if not settings.model_dir:
        return Finding("model_dir", "fail", "engine.cosyvoice2.model_dir is not set",
                       "set it to the CosyVoice2-0.5B directory (config.toml or "
                       "TTS_GATEWAY__ENGINE__COSYVOICE2__MODEL_DIR)")
    root = Path(settings.model_dir)
    fix = f"put the complete official CosyVoice2-0.5B directory at {root}, or point engine.cosyvoice2.model_dir at it"
    if not root.is_dir():
        return Finding("model_dir", "fail", f"{root} is not a directory", fix)
    missing = missing_files(root)
    if missing:
        return Finding("model_dir", "fail", f"{root} is incomplete; missing: {', '.join(missing)}", fix)
    return Finding("model_dir", "ok", f"{root} has {', '.join(MODEL_FILES)} and {TOKENIZER_DIR}/")


def check_voices(checkup: Checkup) -> Finding:
    settings: CosyVoice2Settings = checkup.settings
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
    return Finding("voices", checkup.problem(), f"no voices registered in {directory}{note}",
                   "tts-gateway voice add NAME --wav PROMPT.wav --text TRANSCRIPT")


def check_vram(checkup: Checkup) -> Finding:
    """vLLM takes gpu_memory_utilization of the whole card at start; token2wav needs its share beside it."""
    if checkup.no_gpu:
        return Finding("vram", "skip", checkup.no_gpu)
    settings: CosyVoice2Settings = checkup.settings
    cuda = checkup.torch.cuda
    index = _gpu_index(settings)
    count = cuda.device_count()
    if index >= count:
        return Finding("vram", checkup.problem(),
                       f"engine.cosyvoice2.device is {settings.device} but {count} GPU(s) are visible",
                       f"set engine.cosyvoice2.device to cuda:0..cuda:{count - 1} (or check CUDA_VISIBLE_DEVICES)")
    free, total = cuda.mem_get_info(index)
    vllm = settings.vllm
    needed = vllm.gpu_memory_utilization * total + vllm.token2wav_memory_gb * GIB
    shown = (f"GPU {index}: {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB; "
             f"the vllm backend needs {needed / GIB:.1f} GiB (gpu_memory_utilization "
             f"{vllm.gpu_memory_utilization} x {total / GIB:.1f} GiB + token2wav_memory_gb {vllm.token2wav_memory_gb})")
    if free >= needed:
        return Finding("vram", "ok", shown)
    return Finding("vram", checkup.problem(_uses_vllm(checkup)), shown,
                   "lower [engine.cosyvoice2.vllm] gpu_memory_utilization, or token2wav_memory_gb together with "
                   "max_batch, or stop the other processes on the GPU (nvidia-smi lists them)")


def check_mps(checkup: Checkup) -> Finding:
    """The vllm backend is two GPU processes: vLLM's engine core (the LLM stage) and the
    gateway (token2wav). Without CUDA MPS the GPU runs one process's kernels at a time, so
    each stage waits for the other's; an MPS daemon lets them run side by side."""
    if checkup.no_gpu:
        return Finding("mps", "skip", checkup.no_gpu)
    if not _uses_vllm(checkup):
        return Finding("mps", "skip", "only the vllm backend runs two GPU processes")
    pipe = Path(checkup.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE)
    if (pipe / "control").exists():
        return Finding("mps", "ok", f"an MPS control daemon listens in {pipe}: the LLM stage and token2wav share the "
                       "GPU side by side")
    fix = ("start the MPS control daemon before the gateway, as the user that runs it: nvidia-cuda-mps-control -d "
           "(with the same CUDA_MPS_PIPE_DIRECTORY for both if not the default); see docs/cosyvoice2.md, CUDA MPS")
    index = _gpu_index(checkup.settings)
    nvml = checkup.nvml
    if nvml is not None:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        if nvml.nvmlDeviceGetComputeMode(handle) == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
            return Finding("mps", "fail", f"GPU {index} is in EXCLUSIVE_PROCESS compute mode and no MPS daemon listens "
                           f"in {pipe}: vLLM's engine core and the gateway cannot both use it", fix)
    return Finding("mps", "warn", f"no MPS control daemon in {pipe}: the LLM stage and token2wav take turns on "
                   "the GPU", fix)


def _uses_vllm(checkup: Checkup) -> bool:
    return checkup.settings.llm_backend == "vllm"


def _gpu_index(settings: CosyVoice2Settings) -> int:
    """The engine's GPU: auto, cuda -> 0; cuda:N -> N."""
    return int(settings.device.partition(":")[2] or 0)
