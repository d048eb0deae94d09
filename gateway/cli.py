"""``tts-gateway``: run the gateway, or speak a line to a WAV file.

Only the standard library is imported up front: ``tts-gateway bench`` is a client of the
public protocol and runs on the light install (``pip install tts-gateway``). Every other
command imports what it runs on when it runs, and says which extra to install when that
is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tts_gateway.engine.registry import CliVerb, EngineDescriptor
    from tts_gateway.gateway.config import Config


class MissingExtra(Exception):
    """A command's third-party dependencies are not installed."""


@contextlib.contextmanager
def _needs_extra(extra: str, command: str) -> Iterator[None]:
    """Imports made inside this block need ``tts-gateway[extra]``: say so when one is missing."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] == "tts_gateway":
            raise  # this package's own module is missing: a broken install, not a missing extra
        raise MissingExtra(
            f"`tts-gateway {command}` needs the {extra} extra (no module named {exc.name!r}); "
            f"install it with: pip install 'tts-gateway[{extra}]'"
        ) from exc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser, and no config: it is a client of a running gateway
        from tts_gateway.gateway.loadgen import main as main_bench

        return main_bench(argv[1:])
    # The engines' descriptors (the standard library only) add their commands, e.g. CosyVoice2's
    # `voice` and `make-checkpoint`.
    from tts_gateway.engine.registry import ENGINES, resolve

    own_parsers = {verb.name: verb for engine in ENGINES.values() for verb in engine.cli if verb.own_parser}
    try:
        if argv[:1] and argv[0] in own_parsers:
            verb = own_parsers[argv[0]]
            with _needs_extra(verb.extra, verb.name):
                return resolve(verb.run)(argv[1:])
        return _configured(_parser(ENGINES).parse_args(argv))
    except MissingExtra as exc:
        print(f"tts-gateway: {exc}", file=sys.stderr)
        return 2


def _parser(engines: dict[str, EngineDescriptor]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tts-gateway", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tts-gateway {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the WebSocket gateway")
    _add_config_args(serve)
    serve.add_argument("--host", help="listen address (overrides [server] host)")
    serve.add_argument("--port", type=int, help="listen port (overrides [server] port)")

    say = commands.add_parser("say", help="speak TEXT into a WAV file with the configured engine")
    _add_config_args(say)
    say.add_argument("text", help="what to say")
    say.add_argument("-o", "--output", required=True, type=Path, help="WAV file to write (16-bit mono)")
    say.add_argument("--voice", help="voice id (default: the engine's default voice)")
    say.add_argument("--speed", type=float, default=1.0, help="speaking rate, 0.5-2.0")

    bench = commands.add_parser(
        "bench", help="load-test a running gateway with simulated agents (see docs/benchmarks.md)", add_help=False
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)

    doctor = commands.add_parser(
        "doctor", help="check this machine and config for CosyVoice2 / vLLM / GPU problems, with fixes"
    )
    _add_config_args(doctor)
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")

    for engine in engines.values():
        for verb in engine.cli:
            _add_verb(commands, engine.name, verb)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tts-gateway")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _add_verb(commands: argparse._SubParsersAction, engine_name: str, verb: CliVerb) -> None:
    """An engine's command, as its descriptor declares it; a leaf remembers itself in ``args.verb``."""
    if verb.own_parser:  # main runs it before this parser sees the command line; here for --help
        own = commands.add_parser(verb.name, help=verb.help, add_help=False)
        own.add_argument("rest", nargs=argparse.REMAINDER)
        return
    parser = commands.add_parser(verb.name, help=verb.help)
    if verb.verbs:
        group = parser.add_subparsers(dest=f"{verb.name}_command", required=True)
        for child in verb.verbs:
            _add_verb(group, engine_name, child)
        return
    _add_config_args(parser)
    if verb.arguments is not None:
        verb.arguments(parser)
    parser.set_defaults(verb=(engine_name, verb))


def _configured(args: argparse.Namespace) -> int:
    """The commands that run on the gateway's config: serve, say, doctor and the engines' verbs."""
    from tts_gateway.gateway.config import ConfigError  # the standard library and the engines' descriptors only

    with _needs_extra("server", args.command):  # every one of them runs engine code
        from tts_gateway.engine.base import EngineError

    try:
        config = _load(args)
    except ConfigError as exc:
        print(f"tts-gateway: config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "doctor":
            with _needs_extra("server", "doctor"):
                from tts_gateway.gateway.doctor import run_doctor
            return run_doctor(config, as_json=args.json)
        if args.command == "serve":
            _run(_serve(config))
        elif args.command == "say":
            problem = _say_problem(args.text, args.output)
            if problem:
                print(f"tts-gateway say: {problem}", file=sys.stderr)
                return 2
            _run(_say(config, args.text, args.output, args.voice, args.speed))
        else:
            return _engine_verb(config, args)
    except ConfigError as exc:  # found as the gateway starts (a certificate file it cannot use)
        print(f"tts-gateway: config error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"tts-gateway: engine error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tts-gateway: {exc}", file=sys.stderr)
        return 1
    return 0


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, help="config.toml (default: ./config.toml if present; TTS_GATEWAY__* env overrides apply)"
    )


def _load(args: argparse.Namespace) -> Config:
    from tts_gateway.gateway.config import load_config

    path = args.config
    if path is None and Path("config.toml").is_file():
        path = Path("config.toml")
    config = load_config(path)
    overrides = {}
    if getattr(args, "host", None):
        overrides["host"] = args.host
    if getattr(args, "port", None) is not None:
        overrides["port"] = args.port
    if overrides:
        import dataclasses

        config = dataclasses.replace(config, server=dataclasses.replace(config.server, **overrides))
    return config


def _run(coro) -> None:
    try:
        import uvloop
    except ImportError:  # uvloop is not built for every platform; asyncio's loop works too
        asyncio.run(coro)
    else:
        uvloop.run(coro)


async def _serve(config: Config) -> None:
    with _needs_extra("server", "serve"):
        from tts_gateway.engine.registry import create_engine
        from tts_gateway.gateway.server import Gateway

    gateway = Gateway(config, create_engine(config.engine.name, config.engine.selected))
    await gateway.serve_forever()


def _say_problem(text: str, output: Path) -> str:
    """Why ``say`` cannot do its job, found before the engine loads; "" when it can."""
    if not text.strip():
        return "nothing to say: TEXT is empty"
    folder = output.parent
    if not folder.is_dir():
        return f"cannot write {output}: folder {folder} does not exist"
    if output.is_dir():
        return f"cannot write {output}: it is a folder"
    return ""


async def _say(config: Config, text: str, output: Path, voice: str | None, speed: float) -> None:
    with _needs_extra("server", "say"):
        import numpy as np

        from tts_gateway.engine.base import AudioChunk, UtteranceOptions, drive
        from tts_gateway.engine.registry import create_engine
        from tts_gateway.gateway.audio import float_to_s16

    chunks = []

    async def keep(chunk: AudioChunk) -> None:
        chunks.append(chunk.samples)

    engine = create_engine(config.engine.name, config.engine.selected)
    await engine.start()
    try:
        utterance = engine.open_utterance(UtteranceOptions(voice=voice or engine.default_voice, speed=speed))
        await drive(utterance, keep, text=text)
    finally:
        await engine.close()
    audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    with wave.open(str(output), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(engine.sample_rate)
        wav.writeframes(float_to_s16(audio).tobytes())
    print(f"wrote {output} ({len(audio) / engine.sample_rate:.2f} s at {engine.sample_rate} Hz)")


def _engine_verb(config: Config, args: argparse.Namespace) -> int:
    from tts_gateway.engine.registry import CommandError, resolve

    engine_name, verb = args.verb
    if engine_name != config.engine.name:
        # The verb works on its own engine's files and settings, which the configured engine never reads.
        print(f"tts-gateway: `tts-gateway {args.command}` is for the {engine_name} engine, and the configured "
              f"engine is {config.engine.name} (its voices: GET /v1/voices on a running gateway); to use it, "
              f"set [engine] name = \"{engine_name}\" (or TTS_GATEWAY__ENGINE__NAME={engine_name})", file=sys.stderr)
        return 2
    with _needs_extra(verb.extra, args.command):
        try:
            return resolve(verb.run)(getattr(config.engine, engine_name), args)
        except CommandError as exc:
            print(f"tts-gateway: {exc}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
