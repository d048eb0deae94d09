"""The typed config tree: the shipped file, env overrides, and clear failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tts_gateway.gateway.config import Config, ConfigError, load_config
from tests.paths import ROOT



def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_shipped_config_equals_the_defaults():
    assert load_config(ROOT / "config.toml", env={}) == Config()


def test_env_overrides_follow_one_rule(tmp_path):
    config = load_config(
        write(tmp_path, "[server]\nport = 1234\n"),
        env={
            "TTS_GATEWAY__SERVER__PORT": "9000",
            "TTS_GATEWAY__SERVER__HOST": "0.0.0.0",
            "TTS_GATEWAY__AUTH__API_KEYS": '["a", "b"]',
            "TTS_GATEWAY__LIMITS__IDLE_TIMEOUT_S": "5",
            "TTS_GATEWAY__ENGINE__PIPER__WORKERS": "3",
            "UNRELATED": "ignored",
        },
    )
    assert config.server.port == 9000 and config.server.host == "0.0.0.0"
    assert config.auth.api_keys == ("a", "b")
    assert config.limits.idle_timeout_s == 5.0 and isinstance(config.limits.idle_timeout_s, float)
    assert config.engine.piper.workers == 3


@pytest.mark.parametrize(
    "text, env, message",
    [
        ("[server]\nprot = 1\n", {}, "unknown key(s) server.prot"),
        ("[sever]\n", {}, "unknown key(s) sever"),
        ("[server]\nport = 'x'\n", {}, "server.port must be int"),
        ("[server]\nport = 70000\n", {}, "port must be between"),
        ("[limits]\nmax_sessions = 0\n", {}, "max_sessions must be >= 1"),
        ("[audio]\ndefault_sample_rate = 11025\n", {}, "default_sample_rate must be one of"),
        ("[audio]\ndefault_encoding = 'mp3'\n", {}, "default_encoding must be one of"),
        ("[engine]\nname = 'espeak'\n", {}, "name must be 'piper' or 'cosyvoice2'"),
        ("[engine.piper]\nworkers = 0\n", {}, "workers must be between 1 and 64"),
        ("[auth]\napi_keys = 'k'\n", {}, "auth.api_keys must be a list"),
        ("[auth]\napi_keys = ['']\n", {}, "api_keys must not contain empty keys"),
        ("server = 3\n", {}, "[server] must be a table"),
        ("[server\n", {}, "invalid TOML"),
        ("", {"TTS_GATEWAY__SERVER__PORTT": "1"}, "unknown key(s) server.portt"),
        ("", {"TTS_GATEWAY__LIMITS__MAX_SESSIONS": "many"}, "limits.max_sessions must be int"),
        ("", {"TTS_GATEWAY__SERVER": "1"}, "[server] must be a table"),
        ("[engine.cosyvoice2]\nllm_backend = 'tensorrt'\n", {}, "llm_backend must be 'torch' or 'vllm'"),
        ("[engine.cosyvoice2]\ntoken_first_hop_len = 0\n", {}, "token_first_hop_len"),
        ("[engine.cosyvoice2]\ngraph_max_batch = 32\n", {}, "need 0 <= graph_max_batch <= max_batch"),
        ("[engine.cosyvoice2]\nflow_steps = 0\n", {}, "[engine.cosyvoice2] flow_steps must be an integer >= 1"),
        ("[engine.cosyvoice2]\nflow_steps = -2\n", {}, "[engine.cosyvoice2] flow_steps must be an integer >= 1"),
        ("[engine.cosyvoice2]\nflow_steps = 2.5\n", {}, "engine.cosyvoice2.flow_steps must be int, got 2.5"),
        ("[engine.cosyvoice2.vllm]\ngpu_memory_utilization = 0.99\n", {}, "gpu_memory_utilization must be between"),
        ("[engine.cosyvoice2.vllm]\nmax_num_seqs = 64\nmax_num_batched_tokens = 32\n", {},
         "max_num_batched_tokens must be >= max_num_seqs"),
        ("[engine.cosyvoice2.vllm]\nmax_num_seqs = 8\n", {}, "warmup_batch_sizes must lie between 1 and max_num_seqs"),
        ("[engine.cosyvoice2.vllm]\ndtype = 'int8'\n", {}, "dtype must be float32, bfloat16 or float16"),
        ("[engine.cosyvoice2.vllm]\nmps_priority = 'high'\n", {}, "mps_priority must be one of normal, below-normal"),
        ("[engine.cosyvoice2.vllm]\ntoken2wav_mps_priority = 'high'\n", {},
         "token2wav_mps_priority must be one of normal, below-normal"),
        ("[engine.cosyvoice2.vllm]\nmps_thread_percentage = 0\n", {},
         "mps_thread_percentage must be between 1 and 100"),
        ("", {"TTS_GATEWAY__ENGINE__COSYVOICE2__VLLM__ENFORCE_EAGER": "maybe"}, "enforce_eager must be bool"),
        # The POST routes moved to the one port: a config from before says so, not "unknown key".
        ("[server]\nhttp_port = 8766\n", {}, "server.http_port: one port serves every route now"),
        ("", {"TTS_GATEWAY__SERVER__HTTP_PORT": "0"}, "the POST routes moved to [server] port"),
        ("[limits]\nidle_timeout_s = 200.0\n", {}, "idle_timeout_s must be > 0 and at most max_inactivity_timeout_s"),
        ("[server]\nrequest_timeout_s = 0\n", {}, "request_timeout_s must be > 0"),
        ("[server]\nallowed_origins = 'https://a.example'\n", {}, "server.allowed_origins must be a list"),
        ("[server]\nallowed_origins = ['https://a.example/']\n", {}, "'https://a.example/' is not an origin"),
        ("[server]\nallowed_origins = ['a.example']\n", {}, "'a.example' is not an origin; write scheme://host[:port]"),
        ("[server]\nallowed_origins = ['ftp://a.example']\n", {}, "'ftp://a.example' is not an origin"),
        ("[server]\nallowed_origins = ['*', 'https://a.example']\n", {}, '"*" allows every origin; list it alone'),
        ("[server]\nallowed_hosts = ['a.example:8765']\n", {}, "'a.example:8765' is not a host name"),
        ("[server]\nallowed_hosts = ['https://a.example']\n", {}, "without port or scheme"),
        ("[server]\nallowed_hosts = ['']\n", {}, "allowed_hosts: '' is not a host name"),
        ("[server]\ntls_key = 'key.pem'\n", {}, "tls_cert and tls_key must be set together"),
        ("[server]\ntls_cert = '/nowhere/c.pem'\ntls_key = '/nowhere/k.pem'\n", {}, "tls_cert: no such file"),
        ("[auth]\ntoken_secret = 'short'\n", {}, "token_secret must hold at least 32 characters"),
        ("[auth]\ntoken_ttl_s = 7200.0\n", {}, "token_ttl_s must be > 0 and at most max_token_ttl_s"),
        ("[auth]\ntoken_ttl_s = 0\n", {}, "token_ttl_s must be > 0"),
        ("[limits]\nmax_sessions_per_key = -1\n", {}, "max_sessions_per_key must be >= 0 (0: no limit)"),
        ("[limits]\nmax_contexts_per_key = -1\n", {}, "max_contexts_per_key must be >= 0"),
        ("[limits]\nchars_per_minute_per_key = 1.5\n", {}, "limits.chars_per_minute_per_key must be int"),
        ("", {"TTS_GATEWAY__SERVER__ALLOWED_ORIGINS": "https://a.example"}, "server.allowed_origins must be a list"),
    ],
)
def test_bad_config_fails_with_a_message_naming_the_key(tmp_path, text, env, message):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text), env=env)
    assert message in str(error.value)


def test_vllm_settings_for_a_small_card(tmp_path):
    text = """
[engine.cosyvoice2]
llm_backend = "vllm"
[engine.cosyvoice2.vllm]
gpu_memory_utilization = 0.25
max_num_seqs = 64
max_num_batched_tokens = 4096
warmup_batch_sizes = [1, 2, 4, 8, 16, 32, 64]
"""
    settings = load_config(write(tmp_path, text), env={"TTS_GATEWAY__ENGINE__COSYVOICE2__VLLM__ENFORCE_EAGER": "true"})
    vllm = settings.engine.cosyvoice2.vllm
    assert settings.engine.cosyvoice2.llm_backend == "vllm"
    assert (vllm.gpu_memory_utilization, vllm.max_num_seqs, vllm.enforce_eager) == (0.25, 64, True)
    assert vllm.warmup_batch_sizes == (1, 2, 4, 8, 16, 32, 64)


def test_browser_and_limit_settings(tmp_path):
    text = """
[server]
allowed_origins = ["https://app.example", "http://localhost:3000"]
allowed_hosts = ["tts.example", "[::1]"]
[limits]
max_sessions_per_key = 4
chars_per_minute_per_key = 6000
"""
    config = load_config(write(tmp_path, text), env={"TTS_GATEWAY__AUTH__TOKEN_SECRET": "s" * 32})
    assert config.server.allowed_origins == ("https://app.example", "http://localhost:3000")
    assert config.server.allowed_hosts == ("tts.example", "[::1]")
    assert (config.limits.max_sessions_per_key, config.limits.chars_per_minute_per_key) == (4, 6000)
    assert config.auth.token_secret == "s" * 32


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.toml", env={})
