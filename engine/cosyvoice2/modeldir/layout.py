"""What an official CosyVoice2-0.5B model directory holds, and where voices are kept beside it.

The one description of the layout: the loader, the engine, the voice store and ``tts-gateway
doctor`` all read it here. Torch-free, so that the doctor can judge a directory on a machine
where torch is not installed.
"""

from __future__ import annotations

from pathlib import Path

SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
CAMPPLUS_FILE = "campplus.onnx"
MODEL_FILES = ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE)
# The Qwen text tokenizer (and the backbone's config.json) in a folder of its own.
TOKENIZER_DIR = "CosyVoice-BlankEN"
TOKENIZER_CONFIG_FILES = ("config.json", "tokenizer_config.json")
# Qwen's tokenizer ships as tokenizer.json, or as vocab.json + merges.txt.
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_VOCAB_FILES = ("vocab.json", "merges.txt")

# Registered voices, unless configured elsewhere: <model_dir>/voices/<voice id>/voice.json.
VOICES_DIR = "voices"
VOICE_MANIFEST = "voice.json"


class ModelDirError(ValueError):
    """The model directory is missing or incomplete; the message says what to fix."""


def missing_files(model_dir: str | Path) -> list[str]:
    """What the directory lacks, as paths relative to it (a folder ends in ``/``); empty when complete."""
    root = Path(model_dir)
    return [name for name in MODEL_FILES if not (root / name).is_file()] + _missing_tokenizer_files(root)


def default_voices_dir(model_dir: str | Path) -> Path:
    return Path(model_dir) / VOICES_DIR


def _missing_tokenizer_files(root: Path) -> list[str]:
    tokenizer = root / TOKENIZER_DIR
    if not tokenizer.is_dir():
        return [f"{TOKENIZER_DIR}/"]
    missing = [f"{TOKENIZER_DIR}/{name}" for name in TOKENIZER_CONFIG_FILES if not (tokenizer / name).is_file()]
    if not (tokenizer / TOKENIZER_FILE).is_file() and not all(
        (tokenizer / name).is_file() for name in TOKENIZER_VOCAB_FILES
    ):
        missing.append(f"{TOKENIZER_DIR}/{TOKENIZER_FILE} (or {' + '.join(TOKENIZER_VOCAB_FILES)})")
    return missing
