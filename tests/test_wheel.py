"""The built wheel, installed as a user installs it: the gateway serves its pages and
`tts-gateway bench` runs from site-packages, the client installs alone and speaks, and every
import name lives under tts_gateway.

The wheel is built (this venv's setuptools, no network) from a copy of what pyproject.toml
packages, so the checkout gets no build/ or egg-info. Each fresh venv gets the wheel through pip
(--no-deps, --no-index) and its dependencies from this venv: the server's venv reads this venv's
site-packages after its own (a .pth), so tts_gateway comes from the wheel (checked); the client's
venv gets websockets and orjson linked in, and nothing else.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tts_gateway.gateway.config import shipped_web_dir

from tests.conftest import ws_url
from tests.paths import ROOT

# What pyproject.toml builds the wheel from.
SOURCES = ("pyproject.toml", "README.md", "gateway", "engine", "integrations", "testkit", "web")
CLIENT_DEPENDENCIES = ("websockets", "orjson")
SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"])


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    succeed([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation",
             "-w", str(out), str(source)])
    [built] = out.glob("tts_gateway-*.whl")
    return built


def succeed(command: list, cwd: Path | None = None) -> str:
    """``command``'s output; a failure shows what it said."""
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command}: {result.stderr}"
    return result.stdout


def fresh_venv(path: Path, wheel: Path) -> Path:
    """A venv with the wheel installed and no dependency; returns its site-packages."""
    succeed([sys.executable, "-m", "venv", "--without-pip", str(path)])
    python = path / "bin" / "python"
    succeed([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)])
    return Path(succeed([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())


def link_distribution(name: str, site: Path) -> None:
    """This venv's installed ``name`` (its packages and its dist-info), linked into ``site``."""
    files = importlib.metadata.distribution(name).files
    for top in {file.parts[0] for file in files if not file.parts[0].startswith("..")}:
        installed = SITE_PACKAGES / top
        if installed.exists() and not (site / top).exists():
            (site / top).symlink_to(installed)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_pyproject_lists_every_package_of_the_repo():
    """A new folder with an __init__.py must be added to the list, or the wheel goes without it."""
    mapped = pyproject()["tool"]["setuptools"]["package-dir"]
    found = {"tts_gateway.web"}  # files only: no __init__.py
    for name, folder in mapped.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                found.add(".".join((name, *init.parent.relative_to(ROOT / folder).parts)))
    assert set(pyproject()["tool"]["setuptools"]["packages"]) == found


def test_the_wheel_installs_only_under_tts_gateway(wheel, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.partition("/")[0] for name in names} == {"tts_gateway", "tts_gateway-0.1.0.dist-info"}
    site = fresh_venv(tmp_path / "venv", wheel)
    assert {path.name for path in site.iterdir()} == {"tts_gateway", "tts_gateway-0.1.0.dist-info"}


SPEAK = """
import asyncio, sys
try:
    import numpy
except ModuleNotFoundError:
    pass
else:
    sys.exit("numpy imports: this venv holds more than the client")
from tts_gateway.gateway.client import TTSClient

async def main():
    async with TTSClient.connect(sys.argv[1], sample_rate=24000) as tts:
        audio = await tts.context().speak("Hello from the client alone.")
    print(len(audio))

asyncio.run(main())
"""


async def test_the_client_installs_alone_and_speaks(wheel, gateway, tmp_path):
    venv = tmp_path / "client"
    site = fresh_venv(venv, wheel)
    for name in CLIENT_DEPENDENCIES:
        link_distribution(name, site)
    # Beside the gateway on this event loop, so the client runs as a process of its own.
    process = await asyncio.create_subprocess_exec(venv / "bin" / "python", "-I", "-c", SPEAK, ws_url(gateway),
                                                   cwd=tmp_path, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    assert int(stdout) // 2 > 24000 * 0.5  # more than half a second of 16-bit speech at 24 kHz


WHERE = "import tts_gateway.gateway, tts_gateway.engine.piper; print(tts_gateway.gateway.__file__, tts_gateway.engine.piper.__file__)"


def test_the_installed_gateway_serves_its_pages_and_bench_runs(wheel, tmp_path):
    venv = tmp_path / "server"
    site = fresh_venv(venv, wheel)
    (site / "suite-dependencies.pth").write_text(f"{SITE_PACKAGES}\n")  # after the venv's own site-packages
    # Isolated mode (-I): no PYTHONPATH, and the checkout is not on sys.path.
    where = succeed([venv / "bin" / "python", "-I", "-c", WHERE], cwd=tmp_path).split()
    assert all(Path(file).is_relative_to(site / "tts_gateway") for file in where), where
    port = free_port()
    env = {**os.environ, "TTS_GATEWAY__ENGINE__NAME": "piper", "TTS_GATEWAY__SERVER__LOG_LEVEL": "warning"}
    env.pop("PYTHONPATH", None)
    log = tmp_path / "gateway.log"  # a file, not a pipe: nothing reads it while the gateway runs
    with open(log, "w") as stderr:
        server = subprocess.Popen([venv / "bin" / "tts-gateway", "serve", "--host", "127.0.0.1", "--port", str(port)],
                                  cwd=tmp_path, env=env, stderr=stderr)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, base, log)
        for path, marker in (("/", "<html"), ("/dashboard", "<html"), ("/app.js", "")):
            with urllib.request.urlopen(base + path, timeout=10) as response:
                assert response.status == 200 and marker in response.read().decode().lower(), path
        bench = subprocess.run([venv / "bin" / "tts-gateway", "bench", "--url", f"ws://127.0.0.1:{port}/v1/stream",
                                "--sessions", "2", "--duration", "4", "--json", tmp_path / "bench.json"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert bench.returncode == 0, bench.stderr
        summary = json.loads((tmp_path / "bench.json").read_text())["summary"]
        assert summary["outcomes"].get("done", 0) >= 1, summary
    finally:
        server.terminate()
        server.wait(30)


def wait_ready(server: subprocess.Popen, base: str, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the gateway exited with {server.returncode}: {log.read_text()}")
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"the gateway was not ready within {timeout} s")


def test_the_web_folder_is_found_through_the_import_system(monkeypatch):
    assert shipped_web_dir() == ROOT / "web"  # this checkout, installed editable
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # an install without it
    with pytest.raises(FileNotFoundError, match=r"web client's files \(tts_gateway.web\) are not installed"):
        shipped_web_dir()
