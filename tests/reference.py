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
