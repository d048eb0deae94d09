"""Engines by name. The gateway picks one from config and never imports it directly.

Concrete engines are imported lazily, so a CPU machine that has no torch can run the
Piper voice, and naming an engine that is not installed fails with a clear message.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.base import Engine, EngineError

# name -> "module:factory". A factory takes the engine's config section.
ENGINES: dict[str, str] = {
    "piper": "engine.piper.engine:PiperEngine",
    "cosyvoice2": "engine.cosyvoice2.engine:CosyVoice2Engine",
}


def create_engine(name: str, settings: Any) -> Engine:
    try:
        target = ENGINES[name]
    except KeyError:
        raise EngineError(f"unknown engine {name!r}; available: {', '.join(sorted(ENGINES))}") from None
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineError(f"engine {name!r} cannot be loaded: {exc}") from exc
    return getattr(module, attr)(settings)
