"""The gateway's configuration: one typed tree, loaded from config.toml, overridable by env.

Env rule: ``TTS_GATEWAY__<SECTION>__<KEY>=value`` sets ``[section] key``; nested
sections add more ``__`` parts (``TTS_GATEWAY__ENGINE__PIPER__WORKERS=4``). The value
is read as a TOML value when it parses as one (``8765``, ``true``, ``["a", "b"]``),
otherwise as a plain string.

Unknown keys, wrong types and out-of-range values fail at start with a message that
names the key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from tts_gateway.engine.registry import DEFAULT_ENGINE, ENGINES
from tts_gateway.gateway.wire import ENCODINGS, SAMPLE_RATES

ENV_PREFIX = "TTS_GATEWAY__"
MIN_TOKEN_SECRET_CHARS = 32  # 32 random characters are past guessing


def shipped_web_dir() -> Path:
    """The web client's and the dashboard's files: package data of tts_gateway.web (web/ in a
    checkout, tts_gateway/web in site-packages). A folder of files without Python, so a
    namespace package: its first directory on the import path is the one."""
    spec = importlib.util.find_spec("tts_gateway.web")
    folders = [Path(entry) for entry in (spec.submodule_search_locations if spec else ()) if Path(entry).is_dir()]
    if not folders:
        raise FileNotFoundError("the web client's files (tts_gateway.web) are not installed: reinstall tts-gateway, "
                                "or point [server] web_dir at a copy of web/")
    return folders[0]


class ConfigError(Exception):
    pass


# Keys that once existed: a config that still sets one is told where its setting went.
REMOVED_KEYS = {
    "server.http_port": "one port serves every route now: the POST routes moved to [server] port; remove http_port",
}


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8765  # every route: WebSocket /v1/stream and the HTTP routes; 0 = any free port
    # Static files served at "/". Empty: the web/ folder shipped with the gateway.
    web_dir: str = ""
    # On SIGTERM: stop accepting, let running contexts finish for this long, then close.
    drain_timeout_s: float = 10.0
    # A new connection sends its whole request (head and body) or WebSocket handshake within
    # this, else it is dropped: a silent or trickling client holds no connection for long.
    request_timeout_s: float = 10.0
    log_level: str = "info"
    # Browser pages allowed to open sessions and call the HTTP routes (their Origin header:
    # "https://app.example.com"). Empty: only the gateway's own pages (same host and port as
    # the request's Host). ["*"]: any page. Clients that send no Origin (not browsers) are
    # unaffected.
    allowed_origins: tuple[str, ...] = ()
    # Host names (no port) the gateway answers to; a request for any other Host is refused
    # (421), so that a rebound DNS name cannot reach it from a browser. Empty: any host.
    allowed_hosts: tuple[str, ...] = ()
    # PEM files: with both set, the one port serves https and wss. Empty: plain http and ws
    # (terminate TLS at the load balancer: docs/deployment.md).
    tls_cert: str = ""
    tls_key: str = ""

    def __post_init__(self) -> None:
        _check_origins(self.allowed_origins)
        _check_hosts(self.allowed_hosts)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be set together (or neither)")
        for name in ("tls_cert", "tls_key"):
            if getattr(self, name) and not Path(getattr(self, name)).is_file():
                raise ValueError(f"{name}: no such file {getattr(self, name)!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be between 0 and 65535")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError("log_level must be one of debug, info, warning, error")

    @property
    def web_path(self) -> Path:
        return Path(self.web_dir) if self.web_dir else shipped_web_dir()

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)


def _check_origins(origins: tuple[str, ...]) -> None:
    if "*" in origins:
        if len(origins) > 1:
            raise ValueError('allowed_origins: "*" allows every origin; list it alone')
        return
    for origin in origins:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname or origin != f"{parts.scheme}://{parts.netloc}":
            raise ValueError(
                f"allowed_origins: {origin!r} is not an origin; write scheme://host[:port] "
                "with no path or trailing slash, e.g. \"https://app.example.com\""
            )


def _check_hosts(hosts: tuple[str, ...]) -> None:
    for host in hosts:
        ipv6 = host.startswith("[") and host.endswith("]") and ":" in host
        if not host or any(c in host for c in "/ @") or (":" in host and not ipv6) or host != host.strip("."):
            raise ValueError(f"allowed_hosts: {host!r} is not a host name; write the name alone, without port or scheme")


@dataclass(frozen=True)
class AuthSettings:
    # Empty: the gateway is open. Otherwise a client presents one of these keys.
    api_keys: tuple[str, ...] = ()
    # Signs the short-lived browser tokens of POST /v1/tokens. Empty: a random secret per
    # process, so tokens do not survive a restart and one replica's tokens fail on another;
    # set the same secret on every replica to share them.
    token_secret: str = ""
    token_ttl_s: float = 600.0  # a token's lifetime unless its request asks for less
    max_token_ttl_s: float = 3600.0  # the longest lifetime a request may ask for

    def __post_init__(self) -> None:
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys must not contain empty keys")
        if self.token_secret and len(self.token_secret) < MIN_TOKEN_SECRET_CHARS:
            raise ValueError(f"token_secret must hold at least {MIN_TOKEN_SECRET_CHARS} characters")
        if not 0 < self.token_ttl_s <= self.max_token_ttl_s:
            raise ValueError("token_ttl_s must be > 0 and at most max_token_ttl_s")


@dataclass(frozen=True)
class AudioSettings:
    default_sample_rate: int = 24000
    default_encoding: str = "pcm_s16le"

    def __post_init__(self) -> None:
        if self.default_sample_rate not in SAMPLE_RATES:
            raise ValueError(f"default_sample_rate must be one of {SAMPLE_RATES}")
        if self.default_encoding not in ENCODINGS:
            raise ValueError(f"default_encoding must be one of {ENCODINGS}")


@dataclass(frozen=True)
class LimitSettings:
    max_sessions: int = 256
    max_contexts_per_session: int = 8
    max_text_chars: int = 20_000  # per context, all deltas together
    max_message_bytes: int = 65_536
    # A session with no client frame (a WebSocket ping counts) and no audio for this long is
    # closed. A client may choose its own (query parameter `inactivity_timeout`) up to the max.
    idle_timeout_s: float = 60.0
    max_inactivity_timeout_s: float = 180.0
    # Audio waiting for a client that does not read. Past this the client is cut off.
    send_buffer_bytes: int = 4 * 1024 * 1024
    # Per API key (a token counts against the key that minted it; with no keys configured,
    # every client shares one anonymous key). 0: no limit. Sessions count speech requests in
    # flight too; contexts count every context of the key's sessions and each speech request.
    max_sessions_per_key: int = 0
    max_contexts_per_key: int = 0
    chars_per_minute_per_key: int = 0  # text to speak, over a rolling minute

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_contexts_per_session", "max_text_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("max_sessions_per_key", "max_contexts_per_key", "chars_per_minute_per_key"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit)")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be >= 1024")
        if not 0 < self.idle_timeout_s <= self.max_inactivity_timeout_s:
            raise ValueError("idle_timeout_s must be > 0 and at most max_inactivity_timeout_s")
        if self.send_buffer_bytes < 65_536:
            raise ValueError("send_buffer_bytes must be >= 65536")


def _engine_section() -> type:
    """``[engine]``: ``name`` picks the engine, and every registered engine has its section
    ``[engine.<name>]``, typed by its descriptor. Built from the registry, so the gateway
    repeats no engine's name or settings."""
    names = tuple(ENGINES)

    def __post_init__(self) -> None:
        if self.name not in names:
            raise ValueError(f"name must be {_one_of(names)}")

    def selected(self) -> Any:
        """The settings of the engine ``name`` picks."""
        return getattr(self, self.name)

    sections = [(engine.name, engine.settings, field(default_factory=engine.settings)) for engine in ENGINES.values()]
    return dataclasses.make_dataclass(
        "EngineSection",
        [("name", str, field(default=DEFAULT_ENGINE)), *sections],
        namespace={"__module__": __name__, "__post_init__": __post_init__, "selected": property(selected)},
        frozen=True,
    )


def _one_of(values: tuple[str, ...]) -> str:
    """``'a' or 'b'``, ``'a', 'b' or 'c'``."""
    *rest, last = [repr(value) for value in values]
    return f"{', '.join(rest)} or {last}" if rest else last


EngineSection = _engine_section()


@dataclass(frozen=True)
class Config:
    server: ServerSettings = field(default_factory=ServerSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    audio: AudioSettings = field(default_factory=AudioSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    engine: EngineSection = field(default_factory=EngineSection)


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read ``path`` (if given), apply env overrides, and build the typed tree."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    _apply_env(data, os.environ if env is None else env)
    return _build(Config, data, "")


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> None:
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__")]
        if not all(parts):
            raise ConfigError(f"{name}: malformed override name")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: {part!r} is not a section")
        node[parts[-1]] = _parse_env_value(raw)


def _parse_env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"[{where}] must be a table, got {type(data).__name__}")
    for key in (_join(where, name) for name in data):
        if key in REMOVED_KEYS:
            raise ConfigError(f"{key}: {REMOVED_KEYS[key]}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(_join(where, k) for k in unknown)}; "
            f"known: {', '.join(sorted(fields))}"
        )
    values = {name: _coerce(hints[name], value, _join(where, name)) for name, value in data.items()}
    try:
        return cls(**values)
    except ValueError as exc:
        raise ConfigError(f"[{where or 'root'}] {exc}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if typing.get_origin(hint) is tuple:
        (item_type, _) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_coerce(item_type, item, f"{key}[]") for item in value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool, float) and type(value) is hint:
        return value
    raise ConfigError(f"{key} must be {hint.__name__}, got {value!r}")


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
