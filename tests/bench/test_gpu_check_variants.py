"""bench/gpu_check_variants.sh: several gpu_check runs in one device call, each into a folder of
its own, packed when it ends, with the common options and its own (run here with a stand-in for
gpu_check.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile

from tests.paths import ROOT

SCRIPT = ROOT / "bench" / "gpu_check_variants.sh"
# Writes the options it was given and the OUT it ran with; fails, or takes 2 s, when asked to.
STAND_IN = """import json, os, sys, time
out = os.environ["OUT"]
with open(os.path.join(out, "options.json"), "w") as f:
    json.dump(sys.argv[1:], f)
if "--slow" in sys.argv:
    time.sleep(2)
sys.exit(3 if "--fail" in sys.argv else 0)
"""


def run(tmp_path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    stand_in = tmp_path / "gpu_check_stand_in.sh"
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    stand_in.write_text(f'python3 {tmp_path / "stand_in.py"} "$@"\n')
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK": str(stand_in), **env_extra}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)


def options_of(out, name: str) -> list[str]:
    """The options a variant's stand-in wrote, read from the variant's packed folder."""
    with tarfile.open(out / f"{name}.tar.gz") as packed:
        return json.load(packed.extractfile(f"{name}/options.json"))


def test_each_variant_runs_with_the_common_options_and_its_own_into_its_folder(tmp_path):
    done = run(tmp_path, "--common", '--sessions 64 --first-audio-sessions ""', "base", "",
               "between", "--urgent-chunks-between-calls --token2wav-cache-gb 40")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    assert options_of(out, "base") == ["--sessions", "64", "--first-audio-sessions", ""]
    assert options_of(out, "between") == [
        "--sessions", "64", "--first-audio-sessions", "", "--urgent-chunks-between-calls", "--token2wav-cache-gb", "40"]
    assert "== base:" in done.stdout and "== between:" in done.stdout
    assert sorted(path.name for path in out.iterdir()) == ["base.tar.gz", "between.tar.gz"]  # folders packed


def test_a_failed_variant_fails_the_call_after_the_others_have_run(tmp_path):
    done = run(tmp_path, "broken", "--fail", "next", "--sessions 1")
    assert done.returncode == 1 and "== broken failed" in done.stderr
    assert options_of(tmp_path / "out", "next") == ["--sessions", "1"]


def test_names_and_pairs_are_checked_before_anything_runs(tmp_path):
    for args in (["alone"], ["--common", "--sessions 1"], ["ok", "", "../escape", ""], ["ok", "--a 'unclosed"], []):
        done = run(tmp_path, *args)
        assert done.returncode == 2 and done.stderr, args
    assert not (tmp_path / "out").exists()


def test_a_variant_that_would_not_finish_in_the_time_left_is_skipped(tmp_path):
    """Cut off by the call's limit while its gateway starts, a variant would return nothing: one
    that the time left cannot hold (judged by the longest variant so far) is not started."""
    done = run(tmp_path, "first", "--slow", "second", "--sessions 1", VARIANTS_LIMIT_S="3")
    assert done.returncode == 1 and "== second skipped" in done.stderr
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["first.tar.gz"]
    assert "== second skipped" not in run(tmp_path, "first", "--slow", "second", "").stderr  # the default: 590 s
