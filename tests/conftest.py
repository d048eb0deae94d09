"""Shared fixtures: one started Piper engine for the whole run, and gateways on it.

Every gateway listens on a free loopback port and is stopped at the end of its test.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import pytest_asyncio

from tts_gateway.engine.base import Engine, Voice
from tts_gateway.engine.piper.engine import PiperEngine
from tts_gateway.engine.piper.settings import PiperSettings
from tts_gateway.gateway.config import Config, load_config
from tts_gateway.gateway.server import Gateway


def make_config(**sections: dict) -> Config:
    """The default config with some keys replaced: make_config(limits={"max_sessions": 1})."""
    config = load_config(None, env={})
    for section, values in sections.items():
        config = dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)})
    return dataclasses.replace(config, server=dataclasses.replace(config.server, port=0))


class StubEngine(Engine):
    """An engine with nothing to load, speaking the voices named in ``voice_ids`` (the first
    is the default); subclasses say what an utterance does."""

    name = "stub"
    sample_rate = 16000
    voice_ids: tuple[str, ...] = ("x",)

    async def start(self):
        pass

    async def close(self):
        pass

    def voices(self):
        return [Voice(v, v, "en", self.name) for v in self.voice_ids]

    @property
    def default_voice(self):
        return self.voice_ids[0]


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One intra-op torch thread for the whole run. The test models are tiny: threads gain
    nothing, and on a 2-core machine they spin against the gateway's own workers (measured
    10-40x slower with two)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def piper_engine() -> AsyncIterator[PiperEngine]:
    engine = PiperEngine(PiperSettings())
    await engine.start()
    yield engine
    await engine.close()


@asynccontextmanager
async def running_gateway(config: Config, engine) -> AsyncIterator[Gateway]:
    gateway = Gateway(config, engine, owns_engine=False)
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(piper_engine) -> AsyncIterator[Gateway]:
    async with running_gateway(make_config(), piper_engine) as gw:
        yield gw


def ws_url(gw: Gateway, query: str = "") -> str:
    return f"ws://127.0.0.1:{gw.port}/v1/stream" + (f"?{query}" if query else "")


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``check()`` holds; fail the test if it never does."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def until(awaitable: Awaitable, timeout: float = 10.0):
    return await asyncio.wait_for(awaitable, timeout)
