"""The decoder's Triton kernels run by Triton's interpreter on CPU tensors, for the tests.

``TRITON_INTERPRET=1`` must be set before Triton is imported, and it then turns every kernel
of the process into Python: so a test runs its cases in a subprocess (``run_cases``), a module
that prints one JSON object of case results (``print_cases``), runs each case with the fused
kernels on and off (``fused_and_plain``) and counts there which kernels ran (``counted``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable

import torch

from tts_gateway.engine.cosyvoice2.model import fused_kernels
from tests.paths import ROOT

# Launches of each counted kernel in the case-running process, by name.
launches: Counter[str] = Counter()


def counted(name: str, launch: Callable) -> Callable:
    """``launch`` (a kernel's launcher), each call counted in ``launches[name]``."""

    def run(*args, **kwargs):
        launches[name] += 1
        return launch(*args, **kwargs)

    return run


def fused_and_plain(fused: Callable[[], object], plain: Callable[[], object]) -> tuple[object, object, dict]:
    """``fused()`` with the fused kernels on and ``plain()`` with them off (the switch is off
    after): their results, and the counted kernels the fused run launched. The plain run may
    launch none."""
    launches.clear()
    fused_kernels.enabled = True
    try:
        with torch.inference_mode():
            got = fused()
        ran = dict(launches)
        launches.clear()
        fused_kernels.enabled = False
        with torch.inference_mode():
            expected = plain()
    finally:
        fused_kernels.enabled = False
    if launches:
        raise AssertionError(f"the plain path launched kernels: {dict(launches)}")
    return got, expected, ran


def print_cases(*fills: Callable[[dict], None]) -> None:
    """The case-running module's output: each ``fill(cases)`` run in turn, then the cases as one
    JSON object. Exits with a message unless Triton's interpreter is on."""
    if not (fused_kernels.INTERPRETED and fused_kernels.available()):
        sys.exit("needs Triton, with TRITON_INTERPRET=1 set before it is imported")
    cases: dict = {}
    for fill in fills:
        fill(cases)
    print(json.dumps(cases))


def run_cases(module: str) -> dict:
    """The JSON object ``python -m module`` prints, run under Triton's interpreter (Triton is in
    the test extra: without it the run fails, and so does the test)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)
