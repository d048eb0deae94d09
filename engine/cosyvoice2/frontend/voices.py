"""Registered zero-shot voices, prepared once and cached on disk.

Registering a voice (:meth:`VoiceStore.add`) validates the prompt, runs the frontend
(tokenizer, speech tokenizer, speaker encoder, prompt mel) and stores the result;
sessions only :meth:`VoiceStore.load` it, which reads tensors and never recomputes.

Layout of the store directory::

    <voice_id>/voice.json    manifest: id, name, transcript, model fingerprint, shapes, ...
    <voice_id>/tensors.pt    torch.save of {prompt_text_ids, speech_tokens, speech_feat, embedding}
    <voice_id>/prompt.wav    the WAV bytes as given (to re-prepare for another model)

A voice id is a short hash of the prompt audio bytes, the transcript and the model
fingerprint (a hash of the frontend's model files and settings), so the same prompt
registered twice for the same model gets the same id and is prepared only once, and
the same prompt prepared for another model gets another id. Files are written to a
temporary name and renamed, so a crash never leaves a half-written voice behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tts_gateway.engine.cosyvoice2.modeldir.layout import CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE, TOKENIZER_DIR, VOICE_MANIFEST
from tts_gateway.engine.cosyvoice2.modeldir.staging import staged_directory
from tts_gateway.engine.cosyvoice2.frontend.prompt import CosyVoice2Frontend, PreparedVoice, PromptTextError

__all__ = [
    "VoiceStoreError",
    "UnknownVoiceError",
    "VoiceNameTaken",
    "VoiceModelMismatch",
    "VoiceInfo",
    "VoiceStore",
    "model_fingerprint",
]

TENSORS = "tensors.pt"
PROMPT = "prompt.wav"
FORMAT_VERSION = 1
_ID_CHARS = 16
_NAME_RE = re.compile(r"^[\w][\w .'()-]{0,63}$", re.UNICODE)


class VoiceStoreError(ValueError):
    """A voice store request cannot be done; the message is meant for the user."""


class UnknownVoiceError(VoiceStoreError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown voice"


class VoiceNameTaken(VoiceStoreError):
    pass


class VoiceModelMismatch(VoiceStoreError):
    """The voice was prepared with other model files than the store's."""


@dataclass(frozen=True)
class VoiceInfo:
    id: str
    name: str
    prompt_text: str
    language: str
    seconds: float
    speech_tokens: int
    created: float
    model: str

    def to_voice(self, engine: str = "cosyvoice2"):
        """The gateway's :class:`tts_gateway.engine.base.Voice` for this entry."""
        from tts_gateway.engine.base import Voice

        return Voice(id=self.id, name=self.name, language=self.language, engine=engine)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "prompt_text": self.prompt_text, "language": self.language,
                "seconds": self.seconds, "speech_tokens": self.speech_tokens, "created": self.created,
                "model": self.model}


def _hash_file(path: Path, h: "hashlib._Hash") -> None:
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)


def model_fingerprint(model_dir: str | os.PathLike, frontend_settings: dict[str, Any] | None = None) -> str:
    """A short hash of everything that determines a prepared voice: the ONNX models, the tokenizer files, settings.

    File digests are memoised in-process by (path, size, mtime), so the released
    ~500 MB speech tokenizer is read once per process.
    """
    root = Path(model_dir)
    parts: list[tuple[str, str]] = []
    files = [root / SPEECH_TOKENIZER_FILE, root / CAMPPLUS_FILE]
    tok_dir = root / TOKENIZER_DIR
    if tok_dir.is_dir():
        prefixes = ("tokenizer", "vocab", "merges", "special_tokens", "added")
        files += sorted(p for p in tok_dir.iterdir() if p.is_file() and p.name.startswith(prefixes))
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing from the model directory")
        parts.append((path.relative_to(root).as_posix(), _file_digest(path)))
    h = hashlib.sha256()
    for name, digest in parts:
        h.update(f"{name}={digest}\n".encode())
    h.update(json.dumps(frontend_settings or {}, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


_DIGESTS: dict[tuple[str, int, int], str] = {}
_DIGEST_LOCK = threading.Lock()


def _file_digest(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _DIGEST_LOCK:
        if key in _DIGESTS:
            return _DIGESTS[key]
    h = hashlib.sha256()
    _hash_file(path, h)
    digest = h.hexdigest()
    with _DIGEST_LOCK:
        _DIGESTS[key] = digest
    return digest


class VoiceStore:
    """Prepared zero-shot voices in a directory.

    ``frontend`` is a :class:`CosyVoice2Frontend` or a zero-argument callable that
    builds one; it is only needed (and only built) to add voices. ``model_id`` is the
    model fingerprint that ids and manifests are tied to; by default it is computed
    from the frontend's model directory.
    """

    def __init__(self, directory: str | os.PathLike,
                 frontend: CosyVoice2Frontend | Callable[[], CosyVoice2Frontend] | None = None,
                 model_id: str | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._frontend = frontend
        self._model_id = model_id
        self._cache: dict[str, PreparedVoice] = {}
        self._lock = threading.RLock()

    # -- model ----------------------------------------------------------------

    @property
    def frontend(self) -> CosyVoice2Frontend:
        with self._lock:
            if self._frontend is None:
                raise VoiceStoreError("this voice store is read-only (no frontend to prepare voices)")
            if not isinstance(self._frontend, CosyVoice2Frontend):
                self._frontend = self._frontend()
            return self._frontend

    @property
    def model_id(self) -> str:
        with self._lock:
            if self._model_id is None:
                fe = self.frontend
                self._model_id = model_fingerprint(fe.model_dir, {"mel": fe.mel_kwargs, "ratio": fe.token_mel_ratio})
            return self._model_id

    # -- ids ------------------------------------------------------------------

    def voice_id(self, wav_bytes: bytes, prompt_text: str) -> str:
        h = hashlib.sha256()
        h.update(b"cosyvoice2-voice\0")
        h.update(self.model_id.encode())
        h.update(b"\0")
        h.update(prompt_text.strip().encode("utf-8"))
        h.update(b"\0")
        h.update(hashlib.sha256(bytes(wav_bytes)).digest())
        return h.hexdigest()[:_ID_CHARS]

    # -- registration ---------------------------------------------------------

    def add(self, name: str, wav_bytes: bytes, prompt_text: str, *, language: str = "auto",
            replace: bool = False) -> str:
        """Register a voice from WAV bytes and their transcript; returns its id.

        Raises a :class:`~tts_gateway.engine.cosyvoice2.frontend.prompt.PromptAudioError` for unusable audio
        or text, :class:`VoiceNameTaken` if another voice already has ``name`` (unless
        ``replace``). Adding the same audio and text again returns the existing id
        without recomputing (and renames it if ``name`` differs).
        """
        name = self._check_name(name)
        if not isinstance(prompt_text, str) or not prompt_text.strip():
            raise PromptTextError("the prompt's transcript is empty; give the exact words spoken in the audio")
        voice_id = self.voice_id(wav_bytes, prompt_text)
        with self._lock:
            holder = self._find_name(name)
            if holder is not None and holder.id != voice_id:
                if not replace:
                    raise VoiceNameTaken(f"a voice named {name!r} already exists (id {holder.id})")
                self.remove(holder.id)
            existing = self._read_manifest(voice_id)
            if existing is not None and existing.get("model") == self.model_id:
                if existing.get("name") != name or existing.get("language") != language:
                    existing.update(name=name, language=language)
                    self._write_json(self.directory / voice_id / VOICE_MANIFEST, existing)
                return voice_id
        prepared = self.frontend.prepare_wav(bytes(wav_bytes), prompt_text)
        manifest = {
            "format": FORMAT_VERSION,
            "id": voice_id,
            "name": name,
            "language": language,
            "prompt_text": prepared.prompt_text,
            "model": self.model_id,
            "created": round(time.time(), 3),
            "seconds": prepared.meta.get("seconds"),
            "source_rate": prepared.meta.get("source_rate"),
            "shapes": {k: list(v.shape) for k, v in prepared.tensors().items()},
            "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in prepared.tensors().items()},
        }
        with self._lock:
            self._write_voice(voice_id, manifest, prepared, bytes(wav_bytes))
            self._cache[voice_id] = prepared
        return voice_id

    def remove(self, voice: str) -> None:
        with self._lock:
            info = self.info(voice)
            self._cache.pop(info.id, None)
            shutil.rmtree(self.directory / info.id, ignore_errors=True)

    # -- lookup ---------------------------------------------------------------

    def list(self) -> list[VoiceInfo]:
        """Every voice in the store prepared for this store's model, sorted by name."""
        model = self._model_id_or_none()
        voices = [self._info(m) for m in self._manifests() if model is None or m.get("model") == model]
        return sorted(voices, key=lambda v: (v.name.lower(), v.id))

    def info(self, voice: str) -> VoiceInfo:
        """Look a voice up by id or by name."""
        manifest = self._read_manifest(voice) if _looks_like_id(voice) else None
        if manifest is None:
            found = self._find_name(voice)
            if found is None:
                raise UnknownVoiceError(f"unknown voice {voice!r}")
            return found
        return self._info(manifest)

    def load(self, voice: str) -> PreparedVoice:
        """The prepared tensors of a voice (by id or name), from memory or disk; never recomputes."""
        info = self.info(voice)
        with self._lock:
            cached = self._cache.get(info.id)
            if cached is not None:
                return cached
        model = self._model_id_or_none()
        if model is not None and info.model != model:
            raise VoiceModelMismatch(
                f"voice {info.name!r} was prepared for other model files; register it again for this model"
            )
        path = self.directory / info.id / TENSORS
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError as exc:
            raise UnknownVoiceError(f"voice {info.id} has no tensors on disk") from exc
        prepared = PreparedVoice(
            prompt_text=info.prompt_text,
            prompt_text_ids=data["prompt_text_ids"],
            speech_tokens=data["speech_tokens"],
            speech_feat=data["speech_feat"],
            embedding=data["embedding"],
            meta={"id": info.id, "name": info.name, "seconds": info.seconds},
        )
        prepared.check()
        with self._lock:
            self._cache[info.id] = prepared
        return prepared

    def __contains__(self, voice: str) -> bool:
        try:
            self.info(voice)
        except UnknownVoiceError:
            return False
        return True

    # -- internals -----------------------------------------------------------

    def _model_id_or_none(self) -> str | None:
        if self._model_id is not None:
            return self._model_id
        if self._frontend is None:
            return None
        return self.model_id

    @staticmethod
    def _check_name(name: str) -> str:
        if not isinstance(name, str) or not _NAME_RE.match(name.strip()):
            raise VoiceStoreError(
                "voice names are 1-64 characters: letters, digits, spaces and . ' ( ) - _, starting with a "
                "letter or digit"
            )
        return name.strip()

    def _manifests(self) -> Iterable[dict[str, Any]]:
        for child in sorted(self.directory.iterdir()):
            if child.is_dir() and _looks_like_id(child.name):
                manifest = self._read_manifest(child.name)
                if manifest is not None:
                    yield manifest

    def _find_name(self, name: str) -> VoiceInfo | None:
        model = self._model_id_or_none()
        for manifest in self._manifests():
            if manifest.get("name") == name and (model is None or manifest.get("model") == model):
                return self._info(manifest)
        return None

    def _read_manifest(self, voice_id: str) -> dict[str, Any] | None:
        path = self.directory / voice_id / VOICE_MANIFEST
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, json.JSONDecodeError):
            return None
        if not isinstance(manifest, dict) or manifest.get("id") != voice_id:
            return None
        return manifest

    @staticmethod
    def _info(m: dict[str, Any]) -> VoiceInfo:
        return VoiceInfo(
            id=m["id"], name=m.get("name", m["id"]), prompt_text=m.get("prompt_text", ""),
            language=m.get("language", "auto"), seconds=float(m.get("seconds") or 0.0),
            speech_tokens=int((m.get("shapes", {}).get("speech_tokens") or [0, 0])[-1]),
            created=float(m.get("created") or 0.0), model=m.get("model", ""),
        )

    @staticmethod
    def _write_json(path: Path, data: dict[str, Any]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def _write_voice(self, voice_id: str, manifest: dict[str, Any], prepared: PreparedVoice, wav: bytes) -> None:
        with staged_directory(self.directory / voice_id) as staging:
            torch.save({k: v.contiguous().clone() for k, v in prepared.tensors().items()}, staging / TENSORS)
            (staging / PROMPT).write_bytes(wav)
            self._write_json(staging / VOICE_MANIFEST, manifest)


def _looks_like_id(text: str) -> bool:
    return isinstance(text, str) and len(text) == _ID_CHARS and all(c in "0123456789abcdef" for c in text)
