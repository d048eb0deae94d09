"""HTTP routes that need a request body, on their own port (aiohttp, same event loop).

websockets' HTTP handling serves the GET routes beside ``/v1/stream``, but it reads no
request body, so uploads go here: ``POST /v1/voices`` registers a zero-shot voice from a
prompt recording and its transcript (multipart form: ``name``, ``text``, ``audio``).
The same API keys apply. Listening on a second port keeps each server on a well-kept
library's ordinary path instead of splicing two HTTP stacks on one socket.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from engine.base import Engine, EngineError
from gateway.auth import authorized

log = logging.getLogger("tts_gateway.http")

MAX_UPLOAD_BYTES = 16 * 1024 * 1024  # 30 s of 48 kHz stereo 16-bit fits with room


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


class HttpApi:
    def __init__(self, engine: Engine, api_keys: tuple[str, ...], count_error) -> None:
        self.engine = engine
        self.api_keys = api_keys
        self.count_error = count_error
        self.app = web.Application(client_max_size=MAX_UPLOAD_BYTES)
        self.app.router.add_post("/v1/voices", self.add_voice)
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the real port when 0 was asked

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def add_voice(self, request: web.Request) -> web.Response:
        if not authorized(self.api_keys, request.headers.get("Authorization", ""), request.query.get("api_key")):
            self.count_error("unauthorized")
            return _error(401, "unauthorized", "missing or invalid API key")
        try:
            form = await request.post()  # multipart/form-data or urlencoded
        except ValueError as exc:
            return _error(400, "bad_request", f"unreadable form: {exc}")
        fields = {name: _field_bytes(form.get(name)) for name in ("name", "text", "audio")}
        missing = [name for name, value in fields.items() if not value]
        if missing:
            return _error(
                400, "bad_request",
                f"missing field(s): {', '.join(missing)}; send multipart/form-data with name, text and audio (a WAV file)",
            )
        try:
            name, text = fields["name"].decode(), fields["text"].decode()
        except UnicodeDecodeError:
            return _error(400, "bad_request", "name and text must be UTF-8")
        try:
            voice = await asyncio.to_thread(self.engine.add_voice, name, fields["audio"], text)
        except NotImplementedError as exc:
            return _error(501, "not_supported", str(exc))
        except EngineError as exc:
            log.exception("voice registration failed")
            return _error(500, "internal", str(exc))
        except ValueError as exc:  # the engine's message says what is wrong with the prompt
            return _error(400, "bad_audio", str(exc))
        return web.json_response({"voice": voice.as_json()}, status=201)


def _field_bytes(value) -> bytes:
    if value is None:
        return b""
    if isinstance(value, web.FileField):
        return value.file.read()
    return value.encode() if isinstance(value, str) else bytes(value)
