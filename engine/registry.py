"""Engines by name: the gateway knows engines only through this module.

Every engine's descriptor (:mod:`tts_gateway.engine.descriptor`) is listed here. Descriptors are cheap
and torch-free, so this module imports them all; the code they point at is imported only
when it is used, so a CPU machine without torch runs the Piper voice, and naming an engine
that is not installed fails with a clear message. The types engines and the gateway share
(a doctor Finding, a CLI verb, ...) are re-exported here: the gateway imports nothing else
of engine/ but tts_gateway.engine.base and tts_gateway.engine.text.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tts_gateway.engine.cosyvoice2.descriptor import COSYVOICE2
from tts_gateway.engine.descriptor import Checkup, CliVerb, CommandError, EngineDescriptor, Finding, TorchNeed
from tts_gateway.engine.piper.descriptor import PIPER

if TYPE_CHECKING:
    from tts_gateway.engine.base import Engine

# In this order: the config's sections, doctor's checks, the CLI's commands.
ENGINES: dict[str, EngineDescriptor] = {engine.name: engine for engine in (PIPER, COSYVOICE2)}
# What a config that names no engine runs: the CPU voice, which runs on any machine.
DEFAULT_ENGINE = PIPER.name

__all__ = [
    "DEFAULT_ENGINE", "ENGINES", "Checkup", "CliVerb", "CommandError", "EngineDescriptor", "Finding", "TorchNeed",
    "create_engine", "resolve",
]


def resolve(target: str) -> Any:
    """What a ``"module:attribute"`` string of a descriptor names, importing its module now."""
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def create_engine(name: str, settings: Any) -> Engine:
    # tts_gateway.engine.base needs numpy, which the config (and the CLI on the light install) go without.
    from tts_gateway.engine.base import EngineError

    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}; available: {', '.join(sorted(ENGINES))}")
    try:
        factory = resolve(ENGINES[name].factory)
    except ImportError as exc:
        raise EngineError(f"engine {name!r} cannot be loaded: {exc}") from exc
    return factory(settings)
