"""Load an official CosyVoice2 model directory into our modules.

The directory is what users bring (or what ``tts-gateway make-checkpoint`` writes), laid
out as :mod:`tts_gateway.engine.cosyvoice2.modeldir.layout` says. Every state dict loads strictly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tts_gateway.engine.cosyvoice2.model.flow import Flow
from tts_gateway.engine.cosyvoice2.frontend.prompt import CosyVoice2Frontend
from tts_gateway.engine.cosyvoice2.model.hift import HiFT
from tts_gateway.engine.cosyvoice2.model.llm import CosyVoice2LM
from tts_gateway.engine.cosyvoice2.modeldir.layout import ModelDirError, missing_files
from tts_gateway.engine.cosyvoice2.modeldir.reading import ModelConfigs, load_model_configs


# Precisions a user can ask for by name (config, benchmarks).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CosyVoice2Models:
    configs: ModelConfigs
    llm: CosyVoice2LM
    flow: Flow
    hift: HiFT
    frontend: CosyVoice2Frontend


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def load_models(
    model_dir: str | Path,
    *,
    device: torch.device | str = "cpu",
    llm_dtype: torch.dtype = torch.float32,
    flow_dtype: torch.dtype = torch.float32,
    load_llm: bool = True,
) -> CosyVoice2Models:
    """All stages of one model directory, on ``device``, in eval mode.

    HiFT stays in float32 (its source excitation integrates phase over thousands of
    samples, where half precision drifts audibly). ``load_llm=False`` skips the
    plain-torch LLM when another backend serves that stage.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelDirError(f"model directory not found: {root}")
    missing = missing_files(root)
    if missing:
        raise ModelDirError(f"model directory {root} is incomplete; missing: {', '.join(missing)}")
    configs = load_model_configs(root)
    llm = (
        CosyVoice2LM.from_state_dict(configs.llm, _state_dict(root / "llm.pt"), device=device, dtype=llm_dtype)
        if load_llm
        else None
    )
    flow = Flow(configs.flow)
    flow.load_state_dict(_state_dict(root / "flow.pt"), strict=True)
    flow.to(device=device, dtype=flow_dtype).eval()
    hift = HiFT(configs.hift)
    hift.load_hift_state_dict(_state_dict(root / "hift.pt"))
    hift.to(device=device).eval()
    return CosyVoice2Models(configs, llm, flow, hift, CosyVoice2Frontend(root, configs))
