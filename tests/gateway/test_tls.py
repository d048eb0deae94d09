"""TLS on the one port of the real gateway (Piper voice): wss and https with a self-signed
certificate made here, and clear refusals of unusable certificate files."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from websockets.asyncio.client import connect

from tts_gateway.gateway.config import ConfigError, load_config
from tests.conftest import make_config, running_gateway
from tests.gateway.test_hardening import end, text
from tests.gateway.test_server import read_context, recv_json


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


async def test_wss_and_https_on_the_one_port(piper_engine, tmp_path):
    cert, key = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert))  # the client trusts this certificate only
    config = make_config(server={"tls_cert": str(cert), "tls_key": str(key)})
    async with running_gateway(config, piper_engine) as gw:
        async with connect(f"wss://127.0.0.1:{gw.port}/v1/stream", ssl=trust) as ws:
            assert (await recv_json(ws))["type"] == "ready"
            await ws.send(text("r1", "Hello over TLS."))
            await ws.send(end("r1"))
            _, audio, done = await read_context(ws)
            assert done["type"] == "done" and len(audio) > 10_000
        async with aiohttp.ClientSession() as http:
            async with http.post(f"https://127.0.0.1:{gw.port}/v1/audio/speech", ssl=trust,
                                 json={"input": "Hello over TLS.", "response_format": "pcm"}) as response:
                assert response.status == 200 and len(await response.read()) > 10_000
            # Plain http on a TLS port is not served.
            with pytest.raises(aiohttp.ClientError):
                async with http.get(f"http://127.0.0.1:{gw.port}/healthz") as response:
                    await response.read()


def test_certificate_settings_are_checked(tmp_path):
    cert, key = self_signed(tmp_path)
    config = tmp_path / "config.toml"
    for server, message in (
        (f'tls_cert = "{cert}"', "tls_cert and tls_key must be set together"),
        (f'tls_cert = "{cert}"\ntls_key = "{tmp_path}/missing.pem"', "tls_key: no such file"),
    ):
        config.write_text(f"[server]\n{server}\n")
        with pytest.raises(ConfigError, match=message):
            load_config(config, env={})


def test_a_file_that_is_not_a_certificate_stops_serve(tmp_path, capsys):
    from tts_gateway.gateway import cli

    cert, key = self_signed(tmp_path)
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nport = 0\ntls_cert = "{key}"\ntls_key = "{cert}"\n')  # swapped
    assert cli.main(["serve", "--config", str(config)]) == 2
    assert "not a certificate and its private key in PEM" in capsys.readouterr().err
