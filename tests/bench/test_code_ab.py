"""bench/code_ab.sh: the same benches over the checkout, then with earlier files swapped in, which
are put back afterwards, the two arms' results packed into one file (run here in a stand-in
checkout, with a stand-in for the benches)."""

from __future__ import annotations

import os
import subprocess
import tarfile

from tests.paths import ROOT

SCRIPT = ROOT / "bench" / "code_ab.sh"
# Records what the checkout's file held when the arm ran; fails when the file says so.
STAND_IN = 'cat engine/model.py > "$OUT/seen.txt"; ! grep -q fail engine/model.py\n'


def run(tmp_path, earlier: dict[str, str], now: str = "now\n") -> subprocess.CompletedProcess:
    checkout = tmp_path / "checkout"
    (checkout / "engine").mkdir(parents=True)
    (checkout / "engine" / "model.py").write_text(now)
    for path, text in earlier.items():
        (checkout / ".ab" / path).parent.mkdir(parents=True, exist_ok=True)
        (checkout / ".ab" / path).write_text(text)
    (tmp_path / "arm.sh").write_text(STAND_IN)
    (tmp_path / "out").mkdir()
    env = {**os.environ, "OUT": str(tmp_path / "out"), "CODE_AB_ARM": str(tmp_path / "arm.sh")}
    return subprocess.run(["bash", str(SCRIPT), ".ab"], env=env, cwd=checkout, capture_output=True, text=True,
                          timeout=60)


def seen(tmp_path) -> dict[str, str]:
    with tarfile.open(tmp_path / "out" / "code_ab.tar.gz") as packed:
        return {arm: packed.extractfile(f"{arm}/seen.txt").read().decode() for arm in ("now", "before")}


def test_each_arm_runs_over_its_version_and_the_checkout_is_put_back(tmp_path):
    done = run(tmp_path, {"engine/model.py": "before\n"})
    assert done.returncode == 0, done.stderr
    assert seen(tmp_path) == {"now": "now\n", "before": "before\n"}
    assert (tmp_path / "checkout" / "engine" / "model.py").read_text() == "now\n"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["code_ab.tar.gz"]


def test_a_failed_arm_fails_the_call_and_still_puts_the_files_back(tmp_path):
    done = run(tmp_path, {"engine/model.py": "fail\n"})
    assert done.returncode == 1 and "the before arm failed" in done.stderr
    assert seen(tmp_path) == {"now": "now\n", "before": "fail\n"}
    assert (tmp_path / "checkout" / "engine" / "model.py").read_text() == "now\n"


def test_files_that_are_not_in_the_checkout_are_refused_before_anything_runs(tmp_path):
    done = run(tmp_path, {"engine/other.py": "x\n"})
    assert done.returncode == 2 and "not a file of this checkout" in done.stderr
    assert not (tmp_path / "out" / "code_ab.tar.gz").exists()
