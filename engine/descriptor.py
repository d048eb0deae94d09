"""What an engine tells the gateway about itself without being imported: its descriptor.

A descriptor names the engine and its settings (the ``[engine.<name>]`` section of the
config), and says where its code is as ``"module:attribute"`` strings, which the gateway
imports only when it needs them (:func:`tts_gateway.engine.registry.resolve`). So a descriptor module is
cheap and torch-free: the gateway reads every engine's config on any machine, and a CPU
machine without torch runs the Piper voice.

The types an engine's doctor checks and CLI verbs use live here too, so that no engine
imports the gateway.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse


@dataclass(frozen=True)
class Finding:
    """One ``tts-gateway doctor`` check: what it saw and, when something is wrong, the fix."""

    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Checkup:
    """What an engine's doctor checks look at: its settings and the machine."""

    settings: Any  # the engine's [engine.<name>] section
    torch: Any | None  # the torch module; None where it does not import
    nvml: Any | None  # pynvml, initialised, with at least one GPU; None without
    no_gpu: str  # why no CUDA GPU can be used here; "" when one can
    environ: Mapping[str, str]

    def problem(self, needed: bool = True) -> str:
        """A problem's status: ``fail`` when the engine, as configured, ``needed`` what is wrong
        (a backend's package, say), so that it cannot serve; else ``warn``."""
        return "fail" if needed else "warn"


@dataclass(frozen=True)
class TorchNeed:
    """What an engine, as configured, needs of torch: the doctor's torch check reads it."""

    install: str  # the fix when torch does not import
    cuda_for: str = ""  # the setting that needs a CUDA build of torch; "" when a CPU build serves
    cuda_install: str = ""  # the fix for a CPU-only build, when one does not serve


class CommandError(Exception):
    """A CLI verb cannot do what was asked; the message tells the user why (exit status 2)."""


@dataclass(frozen=True)
class CliVerb:
    """A ``tts-gateway`` command an engine adds.

    A verb with ``verbs`` is a group (``voice`` of ``voice add``); the others run ``run``, a
    "module:function". With ``own_parser`` (top level only) that is ``run(argv) -> int`` on the
    rest of the command line, without the gateway's config. Otherwise the CLI loads the
    config, adds ``--config`` and what ``arguments`` adds to the verb's parser, and calls
    ``run(settings, args) -> int`` with the engine's settings.
    """

    name: str
    help: str
    run: str = ""
    # The pip extra whose packages `run` imports: the CLI names it when one is missing.
    extra: str = "server"
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    own_parser: bool = False
    verbs: tuple[CliVerb, ...] = ()


@dataclass(frozen=True)
class EngineDescriptor:
    """One engine, as the gateway's config, metrics, doctor and CLI know it."""

    name: str  # [engine] name = "<name>" picks it; its settings are [engine.<name>]
    # A frozen dataclass that checks its values in __post_init__ (ValueError: the config
    # loader names the key); its defaults are the engine's defaults.
    settings: type
    factory: str  # "module:Class", called with the settings: the tts_gateway.engine.base.Engine
    # The engine's own series (EngineStats.extra and .totals), by name without the tts_
    # prefix (and without _total), with their help texts.
    gauges: Mapping[str, str] = field(default_factory=dict)
    totals: Mapping[str, str] = field(default_factory=dict)
    # "module:function" taking a Checkup, returning the engine's own list of Findings.
    doctor: str = ""
    # What the engine needs of torch, given its settings; None: it does not use torch.
    torch_need: Callable[[Any], TorchNeed] | None = None
    cli: tuple[CliVerb, ...] = ()  # its tts-gateway commands
