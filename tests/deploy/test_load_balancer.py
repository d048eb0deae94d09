"""Several gateways behind Debian's HAProxy with deploy/haproxy/haproxy.cfg, started by
deploy/launch-replicas.sh: sessions spread over the replicas, and a rolling restart (SIGTERM one
replica, start it again, then the next) while sessions speak loses no reply."""

from __future__ import annotations

import asyncio
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tts_gateway.gateway.client import GatewayError, TTSClient
from tts_gateway.gateway.wire import STREAM_PATH, CloseCode

from tests.paths import ROOT

REPLICAS = 3
SESSIONS = 30

def free_ports(count: int) -> list[int]:
    """``count`` consecutive free ports (the launcher puts replica i on base + i)."""
    for _ in range(50):
        base = random.randrange(20000, 60000, 10)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return list(range(base, base + count))
        except OSError:
            continue
    raise RuntimeError("no free ports")


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


async def until_status(url: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(http_status, url) != status:
        assert time.monotonic() < deadline, f"{url} never answered {status}"
        await asyncio.sleep(0.2)


def served_by(url: str) -> str | None:
    """The replica the balancer sent a request to (its X-Served-By header)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.headers.get("X-Served-By")
    except OSError:
        return None


async def until_in_rotation(url: str, replicas: int, timeout: float) -> None:
    """Until the balancer's health checks have every replica up: with no load, leastconn
    takes turns, so a few requests reach them all."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    while len(seen) < replicas:
        assert time.monotonic() < deadline, f"the balancer only sends to {sorted(seen)}"
        name = await asyncio.to_thread(served_by, url)
        if name is not None:
            seen.add(name)
        await asyncio.sleep(0.1)


def active_sessions(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return int(float(re.search(r"^tts_active_sessions (\S+)$", text, re.M).group(1)))


@dataclass
class Reply:
    session: int
    started_at: float
    samples: int = 0
    rate: int = 0
    done_ms: float | None = None
    error: str | None = None


@dataclass
class Traffic:
    """What the sessions did: every reply, and how their connections ended."""

    replies: list[Reply] = field(default_factory=list)
    clean_closes: int = 0
    connections: int = 0
    failures: list[str] = field(default_factory=list)


async def speak_until(url: str, session: int, stop: asyncio.Event, traffic: Traffic) -> None:
    """One agent: replies one after another with short pauses, reconnecting through the
    balancer when its replica closes the session after a reply (drain)."""
    rng = random.Random(session)
    while not stop.is_set():
        try:
            async with TTSClient.connect(url) as tts:
                traffic.connections += 1
                while not stop.is_set():
                    context = tts.context(encoding="pcm_s16le")  # raises once the session was closed
                    reply = Reply(session, time.monotonic())
                    traffic.replies.append(reply)
                    try:
                        await context.send_text(f"Session {session} says reply {len(traffic.replies)}.")
                        await context.end()
                        async for chunk in context:
                            reply.samples += len(chunk.data) // 2
                    except GatewayError as error:
                        reply.error = f"{error.code} ({error.close_code})"
                        raise
                    reply.rate = context.sample_rate
                    reply.done_ms = context.done.audio_ms if context.done is not None else None
                    await asyncio.sleep(rng.uniform(0.2, 1.0))
        except GatewayError as error:
            if error.code == "connection_closed" and error.close_code == CloseCode.GOING_AWAY:
                traffic.clean_closes += 1  # drained after a reply: reconnect through the balancer
            else:
                traffic.failures.append(f"session {session}: {error.code}: {error}")
                await asyncio.sleep(0.5)
        except OSError as error:
            traffic.failures.append(f"session {session}: {error!r}")
            await asyncio.sleep(0.5)


async def test_rolling_restart_behind_haproxy_loses_no_reply(tmp_path: Path) -> None:
    *ports, listen = free_ports(REPLICAS + 1)
    logs = tmp_path / "logs"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # tts-gateway
        "TTS_GATEWAY__SERVER__DRAIN_TIMEOUT_S": "20",
        "TTS_GATEWAY__LIMITS__MAX_SESSIONS": "64",
    }
    launcher = subprocess.Popen(
        ["bash", str(ROOT / "deploy" / "launch-replicas.sh"), "--replicas", str(REPLICAS), "--base-port",
         str(ports[0]), "--listen", f"127.0.0.1:{listen}", "--logs", str(logs), "--"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    stop = asyncio.Event()
    traffic = Traffic()
    agents: list[asyncio.Task] = []
    restarted: list[subprocess.Popen] = []  # replicas started again: the launcher does not know them
    try:
        for port in ports:
            await until_status(f"http://127.0.0.1:{port}/readyz", 200, 120)
        url = f"ws://127.0.0.1:{listen}{STREAM_PATH}"
        await until_in_rotation(f"http://127.0.0.1:{listen}/healthz", REPLICAS, 30)
        for session in range(SESSIONS):
            agents.append(asyncio.create_task(speak_until(url, session, stop, traffic)))
            await asyncio.sleep(0.05)
        await asyncio.sleep(2)
        spread = [await asyncio.to_thread(active_sessions, port) for port in ports]
        assert sum(spread) == SESSIONS and min(spread) >= SESSIONS // REPLICAS - 3, spread  # leastconn

        for replica, port in enumerate(ports):
            pid = int((logs / f"gateway-{replica}.pid").read_text())
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 40
            while Path(f"/proc/{pid}").exists() and (Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"):
                assert time.monotonic() < deadline, f"replica {replica} did not exit after its drain"
                await asyncio.sleep(0.2)
            command = shlex.split((logs / f"gateway-{replica}.cmd").read_text())
            with open(logs / f"gateway-{replica}-restarted.log", "w") as log:
                restarted.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
            await until_status(f"http://127.0.0.1:{port}/readyz", 200, 120)
            await asyncio.sleep(3)  # sessions speak on the restarted replica before the next goes
        await asyncio.sleep(3)
    finally:
        stop.set()
        ended = await asyncio.wait_for(asyncio.gather(*agents, return_exceptions=True), 60)
        traffic.failures += [f"agent raised {error!r}" for error in ended if isinstance(error, BaseException)]
        os.killpg(launcher.pid, signal.SIGTERM)
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
        for replica in restarted:
            replica.terminate()
        for replica in restarted:
            try:
                replica.wait(30)
            except subprocess.TimeoutExpired:
                replica.kill()
        for pidfile in logs.glob("*.pid"):
            with_pid = int(pidfile.read_text())
            if Path(f"/proc/{with_pid}").exists():
                os.kill(with_pid, signal.SIGKILL)

    assert not traffic.failures, traffic.failures[:5]
    assert traffic.clean_closes >= 1  # drained sessions were closed after their reply
    assert traffic.connections >= SESSIONS + traffic.clean_closes  # ... and reconnected
    cut = [r for r in traffic.replies if r.error is not None and r.samples > 0]
    assert not cut, cut[:5]  # no reply lost audio midway
    done = [r for r in traffic.replies if r.error is None]
    assert len(done) >= 3 * SESSIONS
    for reply in done:
        assert reply.done_ms is not None and reply.samples > 0
        assert abs(reply.done_ms - 1000 * reply.samples / reply.rate) <= 1  # all the audio the done frame counts
