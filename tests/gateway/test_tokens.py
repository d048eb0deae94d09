"""Short-lived browser tokens on the real gateway (Piper voice): minted with a key by
POST /v1/tokens, accepted instead of the key on both routes, refused (401) once expired or
when forged."""

from __future__ import annotations

import time

import aiohttp
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tts_gateway.gateway.client import TTSClient
from tts_gateway.gateway.tokens import TokenSigner, key_id
from tests.conftest import make_config, running_gateway, until, ws_url
from tests.gateway.test_server import read_context, recv_json
from tests.gateway.test_hardening import end, text

KEY = "k-backend-secret"
SECRET = "s" * 32


def keyed(**auth) -> dict:
    return {"auth": {"api_keys": (KEY,), **auth}}


async def post(gw, path: str, headers: dict | None = None, json=None, data=None):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gw.port}{path}", headers=headers, json=json, data=data) as response:
            return response.status, await response.read(), response.headers


async def get(gw, path: str, headers: dict | None = None) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{gw.port}{path}", headers=headers) as response:
            return response.status


async def mint(gw, **options) -> dict:
    status, body, headers = await post(gw, "/v1/tokens", {"Authorization": f"Bearer {KEY}"}, json=options or None)
    assert status == 201, body
    assert headers["Cache-Control"] == "no-store"
    return orjson.loads(body)


async def handshake_refusal(url: str) -> tuple[int, bytes]:
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url):
            pass
    return refused.value.response.status_code, refused.value.response.body


async def test_a_token_speaks_on_both_routes_in_place_of_the_key(piper_engine):
    async with running_gateway(make_config(**keyed()), piper_engine) as gw:
        grant = await mint(gw)
        token = grant["token"]
        assert KEY not in token  # a page holds the token; the key stays with the backend
        assert grant["expires_at"] == pytest.approx(time.time() + 600, abs=5) and grant["ttl_s"] == 600
        async with connect(ws_url(gw, f"token={token}")) as ws:
            assert (await recv_json(ws))["type"] == "ready"
            await ws.send(text("r1", "Hello there."))
            await ws.send(end("r1"))
            headers, audio, done = await read_context(ws)
            assert done["type"] == "done" and len(audio) > 10_000
        bearer = {"Authorization": f"Bearer {token}"}
        assert await get(gw, "/v1/voices", bearer) == 200
        status, audio, _ = await post(gw, "/v1/audio/speech", bearer, json={"input": "Hello.", "response_format": "pcm"})
        assert status == 200 and len(audio) > 10_000
        async with TTSClient.connect(ws_url(gw), api_key=token) as tts:  # the Python client passes it as the key
            assert len(await tts.context().speak("Hello there.")) > 10_000
        # Neither a token nor a key: refused as before.
        assert (await handshake_refusal(ws_url(gw)))[0] == 401
        assert await get(gw, "/v1/voices") == 401


async def test_expired_and_forged_tokens_get_401(piper_engine):
    async with running_gateway(make_config(**keyed(token_secret=SECRET)), piper_engine) as gw:
        good = (await mint(gw))["token"]
        expired = TokenSigner(SECRET).mint(key_id(KEY), time.time() - 1)
        other_secret = TokenSigner("t" * 32).mint(key_id(KEY), time.time() + 600)
        prefix, claims, signature = good.split(".")
        tampered_signature = f"{prefix}.{claims}.{signature[:-2]}{'AA' if signature[-2:] != 'AA' else 'BB'}"
        # Claims swapped for another token's, signature kept: a longer life, say.
        swapped_claims = f"{prefix}.{other_secret.split('.')[1]}.{signature}"
        for token, reason in ((expired, b"expired"), (other_secret, b"signature"),
                              (tampered_signature, b"signature"), (swapped_claims, b"signature"),
                              ("tg1.garbage", b"signature"), ("not-a-token", b"invalid API key")):
            status, body = await handshake_refusal(ws_url(gw, f"token={token}" if token.startswith("tg1.") else f"api_key={token}"))
            assert status == 401 and reason in body, (token, body)
            status, body, _ = await post(gw, "/v1/audio/speech", {"Authorization": f"Bearer {token}"},
                                         json={"input": "Hello."})
            assert status == 401 and reason in body, (token, body)
        assert await get(gw, "/v1/voices", {"Authorization": f"Bearer {good}"}) == 200


async def test_minting_rules(piper_engine):
    async with running_gateway(make_config(**keyed(max_token_ttl_s=120.0, token_ttl_s=60.0)), piper_engine) as gw:
        assert (await post(gw, "/v1/tokens"))[0] == 401
        assert (await post(gw, "/v1/tokens", {"Authorization": "Bearer wrong"}))[0] == 401
        token = (await mint(gw, ttl_s=30))["token"]
        status, body, _ = await post(gw, "/v1/tokens", {"Authorization": f"Bearer {token}"})
        assert status == 403 and b"a token cannot mint tokens" in body
        auth = {"Authorization": f"Bearer {KEY}"}
        for options, message in (({"ttl_s": 121}, b"at most 120"), ({"ttl_s": 0}, b"above 0"),
                                 ({"ttl_s": "60"}, b"ttl_s must be"), ({"max_sessions": 0}, b"max_sessions must"),
                                 ({"scope": "all"}, b"unknown field(s): scope"), ([1], b"JSON object")):
            status, body, _ = await post(gw, "/v1/tokens", auth, json=options)
            assert status == 400 and message in body, (options, body)
        status, body, _ = await post(gw, "/v1/tokens", auth, data=b"{oops")
        assert status == 400 and b"must be JSON" in body
        assert (await mint(gw))["ttl_s"] == 60  # the configured lifetime


async def test_a_tokens_own_session_limit(piper_engine):
    async with running_gateway(make_config(**keyed()), piper_engine) as gw:
        token = (await mint(gw, max_sessions=1))["token"]
        async with connect(ws_url(gw, f"token={token}")) as first:
            assert (await recv_json(first))["type"] == "ready"
            async with connect(ws_url(gw, f"token={token}")) as second:
                refusal = await recv_json(second)
                assert refusal["code"] == "overloaded" and "this token allows 1 sessions" in refusal["message"]
                with pytest.raises(ConnectionClosed) as closed:
                    await until(second.recv(), 5)
                assert closed.value.rcvd.code == 1013
            # The key itself, and another token of it, are not held back by this token's limit.
            other = (await mint(gw))["token"]
            for query in (f"api_key={KEY}", f"token={other}"):
                async with connect(ws_url(gw, query)) as ws:
                    assert (await recv_json(ws))["type"] == "ready"
        async with connect(ws_url(gw, f"token={token}")) as again:  # its session closed: room again
            assert (await recv_json(again))["type"] == "ready"


async def test_tokens_span_replicas_only_with_a_shared_secret(piper_engine):
    shared = make_config(**keyed(token_secret=SECRET))
    async with running_gateway(shared, piper_engine) as one, running_gateway(shared, piper_engine) as two:
        token = (await mint(one))["token"]
        assert await get(two, "/v1/voices", {"Authorization": f"Bearer {token}"}) == 200
    # No secret configured: each process signs with its own random one.
    async with running_gateway(make_config(**keyed()), piper_engine) as one, \
            running_gateway(make_config(**keyed()), piper_engine) as two:
        token = (await mint(one))["token"]
        assert await get(one, "/v1/voices", {"Authorization": f"Bearer {token}"}) == 200
        assert await get(two, "/v1/voices", {"Authorization": f"Bearer {token}"}) == 401


async def test_a_token_stops_working_when_its_key_is_removed(piper_engine):
    async with running_gateway(make_config(**keyed(token_secret=SECRET)), piper_engine) as gw:
        token = (await mint(gw))["token"]
    config = make_config(auth={"api_keys": ("k-another",), "token_secret": SECRET})
    async with running_gateway(config, piper_engine) as gw:
        status, body = await handshake_refusal(ws_url(gw, f"token={token}"))
        assert status == 401 and b"no longer accepted" in body
