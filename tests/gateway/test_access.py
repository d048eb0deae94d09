"""Which pages and host names reach the real gateway (Piper voice): the Origin rule on the
WebSocket handshake and the HTTP routes (CORS), and the Host rule (DNS rebinding)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.conftest import make_config, running_gateway, ws_url
from tests.gateway.test_server import recv_json

FOREIGN = "https://evil.example"
APP = "https://app.example"


async def handshake_status(gw, headers: dict[str, str]) -> int:
    """The status a WebSocket handshake with these headers gets (Host defaults to the gateway's)."""
    headers = {"Host": f"127.0.0.1:{gw.port}", **headers}
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    lines = [
        "GET /v1/stream HTTP/1.1", "Upgrade: websocket", "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    status_line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    return int(status_line.split()[1])


async def request(gw, method: str, path: str, headers: dict[str, str], json=None):
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"http://127.0.0.1:{gw.port}{path}", headers=headers, json=json) as response:
            return response.status, response.headers, await response.read()


async def test_a_foreign_page_is_refused_by_default_and_the_gateways_own_page_is_not(gateway):
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(gateway), origin=FOREIGN):
            pass
    assert refused.value.response.status_code == 403
    assert b"allowed_origins" in refused.value.response.body
    # The page the gateway serves itself: same host and port as the request.
    async with connect(ws_url(gateway), origin=f"http://127.0.0.1:{gateway.port}") as ws:
        assert (await recv_json(ws))["type"] == "ready"
    # A program, not a browser: no Origin at all.
    async with connect(ws_url(gateway)) as ws:
        assert (await recv_json(ws))["type"] == "ready"
    # The same origin on another port is another origin.
    assert await handshake_status(gateway, {"Origin": f"http://127.0.0.1:{gateway.port + 1}"}) == 403
    assert await handshake_status(gateway, {"Origin": "null"}) == 403  # a sandboxed page or a file


@pytest.mark.parametrize("allowed, origin, status", [
    ((APP,), APP, 101),
    ((APP,), "HTTPS://APP.EXAMPLE", 101),  # browsers send lower case; a person may not
    ((APP,), FOREIGN, 403),
    ((APP,), "http://app.example", 403),  # another scheme is another origin
    (("*",), FOREIGN, 101),
])
async def test_listed_origins_open_sessions(piper_engine, allowed, origin, status):
    async with running_gateway(make_config(server={"allowed_origins": allowed}), piper_engine) as gw:
        assert await handshake_status(gw, {"Origin": origin}) == status


async def test_cors_preflight_and_answers_name_only_allowed_pages(piper_engine):
    async with running_gateway(make_config(server={"allowed_origins": (APP,)}), piper_engine) as gw:
        preflight = {"Origin": APP, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        status, headers, _ = await request(gw, "OPTIONS", "/v1/audio/speech", preflight)
        assert status == 204
        assert headers["Access-Control-Allow-Origin"] == APP
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert {"authorization", "content-type"} <= {h.strip().lower() for h in headers["Access-Control-Allow-Headers"].split(",")}
        assert "Origin" in headers.getall("Vary")

        status, headers, body = await request(gw, "OPTIONS", "/v1/audio/speech", {**preflight, "Origin": FOREIGN})
        assert status == 403 and b"forbidden_origin" in body
        assert "Access-Control-Allow-Origin" not in headers

        # The streamed speech answer carries the header too (it is sent before the body).
        status, headers, body = await request(gw, "POST", "/v1/audio/speech", {"Origin": APP},
                                              json={"input": "Hello.", "response_format": "pcm"})
        assert status == 200 and len(body) > 0 and headers["Access-Control-Allow-Origin"] == APP
        status, headers, _ = await request(gw, "POST", "/v1/audio/speech", {"Origin": FOREIGN},
                                           json={"input": "Hello.", "response_format": "pcm"})
        assert status == 403 and "Access-Control-Allow-Origin" not in headers
        # No Origin: no CORS headers, and the request is served.
        status, headers, _ = await request(gw, "GET", "/v1/voices", {})
        assert status == 200 and "Access-Control-Allow-Origin" not in headers


async def test_the_host_must_be_listed_when_hosts_are(piper_engine):
    config = make_config(server={"allowed_hosts": ("tts.example", "127.0.0.1")})
    async with running_gateway(config, piper_engine) as gw:
        for host, status in (("tts.example", 200), ("TTS.example:8765", 200), (f"127.0.0.1:{gw.port}", 200),
                             ("rebound.attacker.example", 421), ("tts.example.attacker.example", 421)):
            assert (await request(gw, "GET", "/v1/voices", {"Host": host}))[0] == status, host
            assert await handshake_status(gw, {"Host": host}) == (101 if status == 200 else 421), host
        # A balancer's health check names the replica by its address: the probes answer it.
        assert (await request(gw, "GET", "/readyz", {"Host": "10.0.0.11:8765"}))[0] == 200
        status, _, body = await request(gw, "GET", "/metrics", {"Host": "10.0.0.11:8765"})
        assert status == 421 and b"does not serve the host" in body
    # Without a list, any Host is served.
    async with running_gateway(make_config(), piper_engine) as gw:
        assert (await request(gw, "GET", "/v1/voices", {"Host": "anything.example"}))[0] == 200
