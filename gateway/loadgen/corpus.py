"""The replies the simulated agents speak: realistic assistant turns with numbers, prices,
dates, lists and Markdown, one reply per line. They ship inside the package
(``gateway/loadgen/data/replies_<lang>.txt``), so an installed ``tts-gateway bench`` has them."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

CORPUS_DIR = files("tts_gateway.gateway.loadgen") / "data"
LANGUAGES = ("en", "zh", "mix")  # mix: the English and the Chinese replies together


def load_corpus(lang: str = "en", path: Path | None = None) -> list[str]:
    """Replies, one per line; ``\\n`` in the file is a line break in the reply.

    ``path``: a replies file of your own instead of the built-in corpus of ``lang``."""
    if path is not None:
        sources = [Path(path)]
    else:
        sources = [CORPUS_DIR / f"replies_{code}.txt" for code in (("en", "zh") if lang == "mix" else (lang,))]
    replies = []
    for file in sources:
        for line in file.read_text(encoding="utf-8").splitlines():
            if line.strip():
                replies.append(line.strip().replace("\\n", "\n"))
    if not replies:
        raise ValueError(f"no replies in {', '.join(map(str, sources))}")
    return replies
