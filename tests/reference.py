"""Import the official CosyVoice2 implementation (PyPI cosyvoice-minicpmo, test-only).

The reference code is used unmodified. Two things make it importable on a CPU test
machine without its full training stack:
- its model modules import ``torchaudio`` only for file loading and training features
  the tests never call; torchaudio has no build for this torch, so a placeholder
  module stands in and fails loudly if anything touches it;
- ``matcha.utils``'s package init pulls in hydra, lightning, rich, gdown and wget;
  those are installed in the test environment (tests/requirements-reference.txt).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.machinery
import sys
import types


def _install_torchaudio_placeholder() -> None:
    if "torchaudio" in sys.modules:
        return
    try:
        importlib.import_module("torchaudio")
        return
    except ImportError:
        pass
    placeholder = types.ModuleType("torchaudio")
    placeholder.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)

    def missing(name: str):
        raise AttributeError(f"torchaudio.{name} is not available in the test environment")

    placeholder.__getattr__ = missing
    sys.modules["torchaudio"] = placeholder


def official(module: str) -> types.ModuleType:
    """``official("cosyvoice.hifigan.generator")`` -> the reference module."""
    _install_torchaudio_placeholder()
    return importlib.import_module(module)


def official_modules(llm_cfg, flow_cfg, hift_cfg):
    """The official modules, constructed from our configs' (= the yaml's) values."""
    import torch
    from omegaconf import DictConfig
    from transformers import Qwen2ForCausalLM

    from tts_gateway.engine.cosyvoice2.model.llm import qwen2_config

    llm_mod = official("cosyvoice.llm.llm")
    common = official("cosyvoice.utils.common")
    backbone = llm_mod.Qwen2Encoder.__new__(llm_mod.Qwen2Encoder)
    torch.nn.Module.__init__(backbone)  # from_pretrained would need blank weights on disk
    backbone.model = Qwen2ForCausalLM(qwen2_config(llm_cfg))
    sampling = functools.partial(common.ras_sampling, **dataclasses.asdict(llm_cfg.sampling))
    llm = llm_mod.Qwen2LM(llm_cfg.llm_input_size, llm_cfg.llm_output_size, llm_cfg.speech_token_size, backbone,
                          sampling, llm_cfg.length_normalized_loss, llm_cfg.lsm_weight, list(llm_cfg.mix_ratio))

    encoder = official("cosyvoice.transformer.upsample_encoder").UpsampleConformerEncoder(
        **dataclasses.asdict(flow_cfg.encoder))
    dec = flow_cfg.decoder
    estimator = official("cosyvoice.flow.decoder").CausalConditionalDecoder(**dataclasses.asdict(dec.estimator))
    cfm = official("cosyvoice.flow.flow_matching").CausalConditionalCFM(
        dec.in_channels, DictConfig(dataclasses.asdict(dec.cfm_params)), dec.n_spks, dec.spk_emb_dim, estimator)
    flow_kwargs = {f.name: getattr(flow_cfg, f.name) for f in dataclasses.fields(flow_cfg)}
    flow_kwargs.update(encoder=encoder, decoder=cfm)
    flow = official("cosyvoice.flow.flow").CausalMaskedDiffWithXvec(**flow_kwargs)

    hift_kwargs = {f.name: getattr(hift_cfg, f.name) for f in dataclasses.fields(hift_cfg)}
    hift_kwargs["f0_predictor"] = official("cosyvoice.hifigan.f0_predictor").ConvRNNF0Predictor(
        **dataclasses.asdict(hift_cfg.f0_predictor))
    hift = official("cosyvoice.hifigan.generator").HiFTGenerator(**hift_kwargs)
    return llm, flow, hift


def randomize(module, seed: int, spread: float):
    """Every parameter random and non-trivial, scaled so activations stay O(1): matrices
    ~ N(0, 1/fan_in), norm gains ~ 1 + N(0, spread^2), biases ~ N(0, spread^2). In eval mode.
    The values are loaded as a checkpoint's are (``load_state_dict``), so that what a module
    derives from its weights at load is derived from these."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, param in module.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if param.dim() >= 2:
            state[name] = noise / param[0].numel() ** 0.5
        elif name.endswith("weight"):
            state[name] = 1 + spread * noise
        else:
            state[name] = spread * noise
    unexpected = module.load_state_dict(state, strict=False).unexpected_keys
    assert not unexpected, unexpected
    return module.eval()


def randomize_lm(module, seed: int):
    """The CosyVoice2 LLM (ours or the official one) random at a scale where the context matters.

    HF's init (std 0.02) would leave the tiny backbone close to the identity, so that a
    wrong context (a missing or repeated position) could go unnoticed. Matrices get unit-
    variance outputs, norms gains near 1, embeddings unit variance. In eval mode.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():  # tied weights are listed once
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif "embed" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[1] ** -0.5)
    return module.eval()
