"""What an engine tells the gateway about itself without being imported: its descriptor.

A descriptor names the engine and its settings (the ``[engine.<name>]`` section of the
config), and says where its code is as ``"module:attribute"`` strings, which the gateway
imports only when it needs them (:func:`engine.registry.resolve`). So a descriptor module is
cheap and torch-free: the gateway reads every engine's config on any machine, and a CPU
machine without torch runs the Piper voice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineDescriptor:
    name: str  # [engine] name = "<name>" picks it; its settings are [engine.<name>]
    # A frozen dataclass that checks its values in __post_init__ (ValueError: the config
    # loader names the key); its defaults are the engine's defaults.
    settings: type
    factory: str  # "module:Class", called with the settings: the engine.base.Engine
    # The engine's own series (EngineStats.extra and .totals), by name without the tts_
    # prefix (and without _total), with their help texts.
    gauges: Mapping[str, str] = field(default_factory=dict)
    totals: Mapping[str, str] = field(default_factory=dict)
