"""Per-key limits on the real gateway (Piper voice): sessions, contexts and characters per
minute, on the WebSocket (overloaded; 1013 for sessions) and the speech route (429 with
Retry-After), counted in the metrics by the key's short hash."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tts_gateway.gateway.auth import ANONYMOUS
from tts_gateway.gateway.key_limits import KeyAccount
from tts_gateway.gateway.config import LimitSettings
from tts_gateway.gateway.tokens import key_id
from tests.conftest import make_config, running_gateway, until, ws_url
from tests.gateway.test_hardening import end, text
from tests.gateway.test_server import read_context, recv_json

KEY, OTHER = "k-first-key", "k-second-key"


def config(**limits):
    return make_config(auth={"api_keys": (KEY, OTHER)}, limits=limits)


async def speak(gw, key: str | None, input_text: str = "Hello.") -> tuple[int, dict, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gw.port}/v1/audio/speech", headers=headers,
                             json={"input": input_text, "response_format": "pcm"}) as response:
            return response.status, response.headers, await response.read()


async def metrics(gw) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{gw.port}/metrics", headers={"Authorization": f"Bearer {KEY}"}) as r:
            return (await r.text())


async def refused_session(url: str) -> str:
    """A session refused for a per-key limit: its error's message, after checking the close."""
    async with connect(url) as ws:
        refusal = await recv_json(ws)
        assert refusal["type"] == "error" and refusal["code"] == "overloaded" and refusal["context_id"] is None
        with pytest.raises(ConnectionClosed) as closed:
            await until(ws.recv(), 5)
        assert closed.value.rcvd.code == 1013
        return refusal["message"]


def assert_limited(status: int, headers, body: bytes, retry_after: str | None, words: str) -> None:
    assert status == 429, body
    error = orjson.loads(body)["error"]
    assert error["code"] == "overloaded" and words in error["message"], error
    assert headers.get("Retry-After") == retry_after


async def test_sessions_per_key(piper_engine):
    async with running_gateway(config(max_sessions_per_key=1), piper_engine) as gw:
        async with connect(ws_url(gw, f"api_key={KEY}")) as first:
            assert (await recv_json(first))["type"] == "ready"
            assert "this key has 1 sessions" in await refused_session(ws_url(gw, f"api_key={KEY}"))
            # A token of the key counts against the key.
            async with aiohttp.ClientSession() as http:
                async with http.post(f"http://127.0.0.1:{gw.port}/v1/tokens",
                                     headers={"Authorization": f"Bearer {KEY}"}) as response:
                    token = (await response.json())["token"]
            await refused_session(ws_url(gw, f"token={token}"))
            # A speech request takes a session place too.
            assert_limited(*await speak(gw, KEY), retry_after="1", words="this key has 1 sessions")
            # Another key is not held back.
            async with connect(ws_url(gw, f"api_key={OTHER}")) as other:
                assert (await recv_json(other))["type"] == "ready"
        status, _, audio = await speak(gw, KEY)  # the session closed: its place is free
        assert status == 200 and len(audio) > 0
        exported = await metrics(gw)
        assert f'tts_key_refusals_total{{key="{key_id(KEY)}",limit="sessions"}} 3.0' in exported
        assert f'tts_key_refusals_total{{key="{key_id(OTHER)}",limit="sessions"}} 0.0' in exported
        assert f'tts_key_sessions{{key="{key_id(KEY)}"}} 0.0' in exported
        assert KEY not in exported and OTHER not in exported


async def test_with_no_keys_every_caller_shares_the_anonymous_key(piper_engine):
    async with running_gateway(make_config(limits={"max_sessions_per_key": 1}), piper_engine) as gw:
        async with connect(ws_url(gw)) as first:
            assert (await recv_json(first))["type"] == "ready"
            await refused_session(ws_url(gw, "api_key=anything"))
            assert f'tts_key_sessions{{key="{ANONYMOUS}"}} 1.0' in await metrics(gw)


async def test_contexts_per_key(piper_engine):
    async with running_gateway(config(max_contexts_per_key=1), piper_engine) as gw:
        async with connect(ws_url(gw, f"api_key={KEY}")) as first, connect(ws_url(gw, f"api_key={KEY}")) as second:
            await recv_json(first), await recv_json(second)
            await first.send(text("a", "Hello there, this reply is still being written"))
            await second.send(text("b", "Hello."))
            error = await recv_json(second)
            assert error["code"] == "overloaded" and error["context_id"] == "b"
            assert "this key has 1 contexts open" in error["message"]
            assert_limited(*await speak(gw, KEY), retry_after="1", words="this key has 1 contexts open")
            status, _, _ = await speak(gw, OTHER)
            assert status == 200
            assert f'tts_key_contexts{{key="{key_id(KEY)}"}} 1.0' in await metrics(gw)
            await first.send(orjson.dumps({"type": "cancel", "context_id": "a"}).decode())
            assert (await read_context(first))[2]["type"] == "cancelled"
            # The place is free again; the refused session carries on.
            await second.send(text("b", "Hello."))
            await second.send(end("b"))
            _, audio, done = await read_context(second)
            assert done["type"] == "done" and len(audio) > 0
        exported = await metrics(gw)
        assert f'tts_key_refusals_total{{key="{key_id(KEY)}",limit="contexts"}} 2.0' in exported
        assert f'tts_key_contexts{{key="{key_id(KEY)}"}} 0.0' in exported


async def test_characters_per_minute_per_key(piper_engine):
    async with running_gateway(config(chars_per_minute_per_key=60), piper_engine) as gw:
        async with connect(ws_url(gw, f"api_key={KEY}")) as ws:
            await recv_json(ws)
            await ws.send(text("c1", "Forty characters of text, spoken at once"))  # 40 of 60
            await ws.send(end("c1"))
            assert (await read_context(ws))[2]["type"] == "done"
            await ws.send(text("c2", "x" * 30))  # about 20 left (one more per second)
            error = await recv_json(ws)
            assert error["code"] == "overloaded" and error["context_id"] == "c2"
            assert "spoken its 60 characters per minute; retry in" in error["message"]
            status, headers, body = await speak(gw, KEY, "y" * 30)
            assert 1 <= int(headers["Retry-After"]) <= 10
            assert_limited(status, headers, body, headers["Retry-After"], "spoken its 60 characters per minute")
            assert_limited(*await speak(gw, KEY, "z" * 61), retry_after=None, words="61 characters at once exceed")
            # Text past the budget in the middle of a reply: the reply cannot be finished, so the
            # context ends with overloaded (audio already sent stays sent).
            await ws.send(text("c3", "Ten chars."))
            await ws.send(text("c3", " and twenty-five more.   "))
            _, _, error = await read_context(ws)
            assert error["type"] == "error" and error["code"] == "overloaded" and error["context_id"] == "c3"
            await ws.send(end("c3"))
            assert (await recv_json(ws))["code"] == "unknown_context"  # it has ended
            status, _, _ = await speak(gw, OTHER, "y" * 30)  # the other key has its own budget
            assert status == 200
        exported = await metrics(gw)
        assert f'tts_key_chars_total{{key="{key_id(KEY)}"}} 50.0' in exported
        assert f'tts_key_refusals_total{{key="{key_id(KEY)}",limit="chars"}} 4.0' in exported


def test_the_characters_budget_refills_over_the_minute():
    account = KeyAccount(LimitSettings(chars_per_minute_per_key=60))
    assert account.spend_chars(60, now=100.0) is None
    refused = account.spend_chars(10, now=100.0)
    assert refused is not None and refused.retry_after_s == 10
    assert account.spend_chars(10, now=105.0) is not None  # 5 back so far
    assert account.spend_chars(10, now=110.0) is None
    assert account.spend_chars(60, now=1000.0) is None  # full again, never more than full
    assert account.spend_chars(1, now=1000.0) is not None
    assert account.chars_total == 130 and account.refusals["chars"] == 3
