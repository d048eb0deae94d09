"""The browser client (web/) in headless Chromium against the real gateway (Piper voice).

Chromium is Debian's (/usr/bin/chromium; scripts/test.sh installs it), driven by
Playwright's async API so the gateway keeps serving on the same event loop. Headless
Chromium has no sound card, but the AudioWorklet still renders: framesPlayed grows.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import aiohttp
import pytest_asyncio

from tests.conftest import make_config, running_gateway
from tests.gateway.test_server import LONG_TEXT, SENTENCE

import playwright.async_api as playwright_api  # noqa: E402  (scripts/test.sh installs it and Chromium)
from tests.paths import ROOT

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOT = ROOT / "docs" / "screenshots" / "client.png"
DASHBOARD_SCREENSHOT = SCREENSHOT.with_name("dashboard.png")
ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def browser():
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield browser
        await browser.close()


@pytest_asyncio.fixture(loop_scope="session")
async def page(browser, gateway):
    context = await browser.new_context(viewport={"width": 1100, "height": 700})
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(f"http://127.0.0.1:{gateway.port}/")
    await page.wait_for_function("window.ttsState && window.ttsState.connected", timeout=10_000)
    yield page
    await context.close()
    assert not errors, errors


async def ctx(page, context_id: str) -> dict | None:
    return await page.evaluate("id => window.ttsState.contexts[id] ?? null", context_id)


async def wait_for(page, context_id: str, condition: str, timeout: float = 30.0) -> dict:
    """Wait until the JS ``condition`` holds for the context ``c`` (e.g. "c.status === 'done'")."""
    await page.wait_for_function(
        f"(() => {{ const c = window.ttsState.contexts[{context_id!r}]; return c && ({condition}); }})()",
        timeout=timeout * 1000,
        polling=20,
    )
    return await ctx(page, context_id)


async def choose(page, *, text: str, rate: int, encoding: str, tps: int | None = None) -> None:
    await page.fill("#text", text)
    await page.select_option("#rate", str(rate))
    await page.select_option("#encoding", encoding)
    if tps is not None:
        await page.fill("#tps", str(tps))


async def test_speak_plays_audio_and_shows_ttfa(page):
    voices = await page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)")
    assert "joe" in voices  # filled from the ready frame
    await choose(page, text=SENTENCE, rate=16000, encoding="pcm_s16le")
    await page.click("#speak")

    first = await wait_for(page, "c1", "c.chunks > 0 && c.framesPlayed > 0")
    assert first["status"] in ("speaking", "done")
    await asyncio.sleep(0.3)
    later = await ctx(page, "c1")
    assert later["framesPlayed"] > first["framesPlayed"]  # the worklet keeps consuming

    done = await wait_for(page, "c1", "c.status === 'done'")
    assert done["ttfaServerMs"] is not None and done["ttfaServerMs"] > 0
    assert 0 < done["ttfaBrowserMs"] < 10_000
    row = page.locator("tr[data-context='c1']")
    assert re.fullmatch(r"\d+ ms", await row.locator(".ttfa-browser").inner_text())
    assert re.fullmatch(r"\d+ ms", await row.locator(".ttfa-server").inner_text())
    assert await row.locator(".status").inner_text() == "done"

    # Everything received is played: 2 bytes per sample, resampled only for the speaker.
    total = done["bytes"] // 2
    played = await wait_for(page, "c1", f"c.framesPlayed >= {total} - 200", timeout=30)
    assert played["framesPlayed"] <= total + 2  # resampling may overshoot by a sample
    assert played["audioAfterCancel"] == 0
    assert isinstance(played["underruns"], int)


async def test_stop_cancels_and_clears_playback(page):
    await choose(page, text=LONG_TEXT, rate=24000, encoding="pcm_f32le")
    await page.click("#speak")
    await wait_for(page, "c1", "c.framesPlayed > 2400")  # 100 ms played, mid-sentence
    await page.click("#stop")

    cancelled = await wait_for(page, "c1", "c.status === 'cancelled'", timeout=10)
    # The table is redrawn on the page's next frame: wait for it rather than race it.
    await page.wait_for_function(
        "document.querySelector(\"tr[data-context='c1'] .status\")?.innerText === 'cancelled'", timeout=5_000
    )
    await asyncio.sleep(0.2)  # the worklet's last report after the clear
    before = await ctx(page, "c1")
    await asyncio.sleep(1.0)
    after = await ctx(page, "c1")
    assert after["audioAfterCancel"] == 0
    assert after["chunks"] == before["chunks"]
    assert after["framesPlayed"] == before["framesPlayed"]  # buffered audio was dropped
    # Far less than the long text was played: the rest was never generated or was dropped.
    assert after["framesPlayed"] < 24000 * 20
    assert cancelled["status"] == "cancelled"
    assert await page.is_disabled("#stop")


async def test_simulated_llm_streams_deltas(page):
    # Record the frames the page sends (reload so the session's socket is seen).
    sent: list[dict] = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(json.loads(payload))))
    await page.reload()
    await page.wait_for_function("window.ttsState.connected", timeout=10_000)
    await choose(page, text=SENTENCE, rate=8000, encoding="mulaw", tps=60)
    await page.click("#simulate")
    first = await wait_for(page, "c1", "c.chunks > 0")
    assert first["ttfaBrowserMs"] is not None
    done = await wait_for(page, "c1", "c.status === 'done'")
    assert done["ttfaServerMs"] is not None
    total = done["bytes"]  # mu-law: one byte per sample
    await wait_for(page, "c1", f"c.framesPlayed >= {total} - 100", timeout=30)
    assert (await ctx(page, "c1"))["audioAfterCancel"] == 0

    texts = [f for f in sent if f["type"] == "text"]
    assert "".join(f["text"] for f in texts) == SENTENCE
    assert len(texts) >= len(SENTENCE) // 4 and all(len(f["text"]) <= 4 for f in texts)
    assert texts[0]["encoding"] == "mulaw" and texts[0]["sample_rate"] == 8000
    assert sent[-1] == {"type": "end", "context_id": "c1"}


async def test_screenshot(page):
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    await choose(page, text=SENTENCE, rate=24000, encoding="pcm_f32le")
    await page.click("#speak")
    await wait_for(page, "c1", "c.status === 'done'")
    reply = LONG_TEXT[: LONG_TEXT.index("Friday")].strip()
    await choose(page, text=reply, rate=24000, encoding="pcm_s16le", tps=40)
    await page.click("#simulate")
    await wait_for(page, "c2", "c.framesPlayed > 24000 * 2.2", timeout=30)  # waveform full
    await page.screenshot(path=str(SCREENSHOT), full_page=True)
    if await page.is_enabled("#stop"):  # still streaming: barge in
        await page.click("#stop")
    await wait_for(page, "c2", "c.status !== 'speaking'", timeout=10)
    assert SCREENSHOT.stat().st_size > 10_000


async def test_api_key_field(browser, piper_engine):
    config = make_config(auth={"api_keys": ("k-secret",)})
    async with running_gateway(config, piper_engine) as gw:
        context = await browser.new_context()
        page = await context.new_page()
        try:
            await page.goto(f"http://127.0.0.1:{gw.port}/")  # the page itself needs no key
            await page.wait_for_function("document.getElementById('log').textContent.includes('refused')")
            assert await page.evaluate("window.ttsState.connected") is False
            await page.fill("#key", "k-secret")
            await choose(page, text="Hello.", rate=24000, encoding="pcm_f32le")
            await page.click("#speak")
            done = await wait_for(page, "c1", "c.status === 'done'")
            assert done["chunks"] > 0
            assert await page.evaluate("window.ttsState.connected") is True
        finally:
            await context.close()


async def test_a_page_given_a_token_speaks_without_the_key(browser, piper_engine):
    """A backend mints a token with its key and hands the page `/?token=…`: the client
    connects with it, and the dashboard reads its statistics with it."""
    config = make_config(auth={"api_keys": ("k-secret",)})
    async with running_gateway(config, piper_engine) as gw:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{gw.port}/v1/tokens", json={"ttl_s": 60},
                                 headers={"Authorization": "Bearer k-secret"}) as response:
                token = (await response.json())["token"]
        context = await browser.new_context()
        page = await context.new_page()
        try:
            await page.goto(f"http://127.0.0.1:{gw.port}/?token={token}")
            await page.wait_for_function("window.ttsState.connected", timeout=10_000)
            await choose(page, text="Hello.", rate=24000, encoding="pcm_f32le")
            await page.click("#speak")
            assert (await wait_for(page, "c1", "c.status === 'done'"))["chunks"] > 0
            await page.goto(f"http://127.0.0.1:{gw.port}/dashboard?token={token}")
            await page.wait_for_function("window.dashboardState.updates > 0", timeout=10_000)
            # A forged token is refused: the page says so rather than connecting.
            await page.goto(f"http://127.0.0.1:{gw.port}/?token={token[:-4]}AAAA")
            await page.wait_for_function("document.getElementById('log').textContent.includes('get a new token')")
            assert await page.evaluate("window.ttsState.connected") is False
        finally:
            await context.close()


async def test_dashboard_charts_update_under_load(browser, gateway):
    """/dashboard polls /v1/stats; under a few spoken contexts its charts get new data."""
    from tts_gateway.gateway.client import TTSClient

    from tests.conftest import ws_url

    context = await browser.new_context(viewport={"width": 1200, "height": 900})
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        await page.goto(f"http://127.0.0.1:{gateway.port}/dashboard")
        await page.wait_for_function("window.dashboardState && window.dashboardState.updates >= 1", timeout=10_000)

        async def agent(i: int) -> None:
            async with TTSClient.connect(ws_url(gateway)) as tts:
                await tts.context().speak(f"Agent {i} says hello to the dashboard.")

        await asyncio.gather(*(agent(i) for i in range(3)))
        await page.wait_for_function(
            "window.dashboardState.lastStats && window.dashboardState.lastStats.current.ttfa_count >= 3",
            timeout=15_000,
        )
        before = await page.evaluate("window.dashboardState.updates")
        await page.wait_for_function(f"window.dashboardState.updates > {before + 1}", timeout=10_000)
        stats = await page.evaluate("window.dashboardState.lastStats")
        assert stats["current"]["audio_s"] > 1.0
        assert any(v is not None for v in stats["series"]["ttfa_p50_ms"])
        DASHBOARD_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(DASHBOARD_SCREENSHOT))
    finally:
        await context.close()
    assert not errors, errors
