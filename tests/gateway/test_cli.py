"""The command line as a user runs it: `tts-gateway serve`, `say`, the example agent."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import wave
from pathlib import Path

import pytest
from websockets.sync.client import connect as websocket_connect

from tests.gateway.test_server import LONG_TEXT
from tests.paths import ROOT


CLI = [sys.executable, "-m", "tts_gateway.gateway"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wav_seconds(path: Path) -> float:
    with wave.open(str(path)) as wav:
        assert wav.getnchannels() == 1 and wav.getsampwidth() == 2
        return wav.getnframes() / wav.getframerate()


def test_say_writes_a_wav(tmp_path):
    out = tmp_path / "hello.wav"
    result = subprocess.run(
        [*CLI, "say", "Hello there! The total is $3.50.", "-o", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout
    assert 1.5 < wav_seconds(out) < 6.0


@pytest.mark.parametrize(
    "text, output, message",
    [
        ("", "out.wav", "nothing to say: TEXT is empty"),
        ("  ", "out.wav", "nothing to say: TEXT is empty"),
        ("Hello.", "missing/out.wav", "folder missing does not exist"),
        ("Hello.", ".", "it is a folder"),
    ],
)
def test_say_refuses_what_it_cannot_do_before_loading_a_voice(tmp_path, text, output, message):
    result = subprocess.run([*CLI, "say", text, "-o", output], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not list(tmp_path.glob("*.wav"))


def test_version():
    result = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("tts-gateway 0.")


@pytest.mark.parametrize(
    "config, message",
    [
        ("[server]\nprot = 1\n", "config error: unknown key(s) server.prot"),
        ("[server]\nhttp_port = 8766\n", "config error: server.http_port: one port serves every route now: "
         "the POST routes moved to [server] port"),
    ],
)
def test_bad_config_stops_with_a_clear_message(tmp_path, config, message):
    (tmp_path / "config.toml").write_text(config)
    result = subprocess.run([*CLI, "serve"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


def start_serving(cwd: Path, port: int, drain_timeout_s: float) -> subprocess.Popen:
    """`tts-gateway serve --port PORT`, once its /readyz says 200."""
    env = {**os.environ, "TTS_GATEWAY__SERVER__DRAIN_TIMEOUT_S": str(drain_timeout_s)}
    server = subprocess.Popen(
        [*CLI, "serve", "--port", str(port)], cwd=cwd, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 90
    while True:
        assert server.poll() is None, server.stdout.read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as response:
                if response.status == 200:
                    return server
        except OSError:
            pass
        assert time.monotonic() < deadline, "gateway never became ready"
        time.sleep(0.2)


def test_serve_speaks_to_the_example_agent_and_drains_on_sigterm(tmp_path):
    port = free_port()
    server = start_serving(tmp_path, port, drain_timeout_s=5)
    try:
        out = tmp_path / "reply.wav"
        agent = subprocess.run(
            [
                sys.executable, str(ROOT / "examples" / "simulated_llm_to_wav.py"),
                "--url", f"ws://127.0.0.1:{port}/v1/stream",
                "--text", "Hello there! The total is $3.50, due May 5th.",
                "--tokens-per-second", "200", "-o", str(out),
            ],
            capture_output=True, text=True, timeout=120,
        )
        assert agent.returncode == 0, agent.stderr
        assert 2.5 < wav_seconds(out) < 7.0
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    log = server.stdout.read()
    assert "draining" in log


def test_port_moves_every_route_and_sigterm_cuts_a_long_download_at_the_drain_timeout(tmp_path):
    port = free_port()
    server = start_serving(tmp_path, port, drain_timeout_s=1)
    try:
        base = f"http://127.0.0.1:{port}"
        for route in ("/healthz", "/v1/voices", "/metrics", "/"):
            with urllib.request.urlopen(base + route, timeout=5) as response:
                assert response.status == 200, route
        with TTSClient_session(port) as heard:
            assert heard == "ready"
        long_post = urllib.request.Request(
            base + "/v1/audio/speech", data=json.dumps({"input": LONG_TEXT, "response_format": "pcm"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(long_post, timeout=30) as response:
            assert response.status == 200 and response.read(4800)  # audio is streaming
            server.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            with pytest.raises(http.client.IncompleteRead):  # cut at the drain timeout, not finished
                response.read()
            assert server.wait(timeout=30) == 0
            # A minute of speech in flight; the process is gone after the 1 s drain and a margin.
            assert time.monotonic() - signalled < 1 + 3
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@contextlib.contextmanager
def TTSClient_session(port: int):
    """A WebSocket session on ``port`` (the sync client: this test has no event loop); yields the first frame's type."""
    with websocket_connect(f"ws://127.0.0.1:{port}/v1/stream") as ws:
        yield json.loads(ws.recv(timeout=10))["type"]


def test_voice_commands_say_to_set_the_model_dir(tmp_path):
    result = subprocess.run([*CLI, "voice", "list"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "TTS_GATEWAY__ENGINE__NAME": "cosyvoice2"})
    assert result.returncode == 2
    assert "tts-gateway: set engine.cosyvoice2.model_dir" in result.stderr


def test_voice_commands_on_piper_say_they_are_cosyvoice2s(tmp_path):
    """The default config runs the Piper voice: CosyVoice2's model directory is nothing to it."""
    for command in (["voice", "list"], ["voice", "add", "narrator", "--wav", "prompt.wav", "--text", "Hello."]):
        result = subprocess.run([*CLI, *command], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert "`tts-gateway voice` is for the cosyvoice2 engine, and the configured engine is piper" in result.stderr
        assert "model_dir" not in result.stderr


def test_make_checkpoint_then_voice_add_and_list(tmp_path):
    """CosyVoice2's commands, which its engine descriptor adds to the CLI."""
    from tests.engine.cosyvoice2.test_engine import PROMPT_TEXT, prompt_wav

    model = tmp_path / "model"
    made = subprocess.run([*CLI, "make-checkpoint", "--size", "tiny", str(model)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(model)
    wav = tmp_path / "prompt.wav"
    wav.write_bytes(prompt_wav())
    env = {**os.environ, "TTS_GATEWAY__ENGINE__NAME": "cosyvoice2", "TTS_GATEWAY__ENGINE__COSYVOICE2__MODEL_DIR": str(model)}

    def voice(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, "voice", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)

    added = voice("add", "narrator", "--wav", str(wav), "--text", PROMPT_TEXT)
    assert added.returncode == 0, added.stderr
    voice_id = added.stdout.strip()
    assert (model / "voices" / voice_id / "voice.json").is_file()  # beside the model: voices_dir is unset
    listed = voice("list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith(f"{voice_id}  narrator  ")
    taken = voice("add", "narrator", "--wav", str(wav), "--text", "Other words than those spoken.")
    assert taken.returncode == 2 and "already exists" in taken.stderr
