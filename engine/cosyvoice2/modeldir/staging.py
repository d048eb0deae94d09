"""Directories written whole or not at all (caches and stores beside a model directory)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged_directory(final: Path) -> Iterator[Path]:
    """Yields an empty directory beside ``final`` that replaces ``final`` when the block ends
    without error, so a crash or a full disk never leaves a half-written one behind."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield staging
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
