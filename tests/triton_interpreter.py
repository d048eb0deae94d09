"""The decoder's Triton kernels run by Triton's interpreter on CPU tensors, for the tests.

``TRITON_INTERPRET=1`` must be set before Triton is imported, and it then turns every kernel
of the process into Python: so a test runs its cases in a subprocess (``run_cases``), a module
that prints one JSON object of case results, and counts there which kernels ran (``counted``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable

from tests.paths import ROOT

# Launches of each counted kernel in the case-running process, by name.
launches: Counter[str] = Counter()


def counted(name: str, launch: Callable) -> Callable:
    """``launch`` (a kernel's launcher), each call counted in ``launches[name]``."""

    def run(*args, **kwargs):
        launches[name] += 1
        return launch(*args, **kwargs)

    return run


def run_cases(module: str) -> dict:
    """The JSON object ``python -m module`` prints, run under Triton's interpreter (Triton is in
    the test extra: without it the run fails, and so does the test)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)
