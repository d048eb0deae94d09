"""Where the tests find the repository's folders, wherever a test file sits in tests/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
