"""The chat page in a real browser: Debian's Chromium, headless, driven by Selenium, against `diffgemma serve` on
127.0.0.1 with the bundled demo model. Skipped where Chromium or its driver is missing, unless
REQUIRE_BROWSER_TESTS=1 (CI sets it: there a missing browser fails)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.live_server import free_port, stop, wait_up

try:  # the openai 3.x client ships httpx as `httpx2`
    import httpx2 as httpx
except ImportError:
    import httpx

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
_missing = not (CHROMIUM and DRIVER)
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:
    _missing = True
if _missing and os.environ.get("REQUIRE_BROWSER_TESTS") == "1":
    raise RuntimeError("browser tests required: install chromium, chromium-driver (apt) and selenium (pip)")
pytestmark = pytest.mark.skipif(_missing, reason="needs chromium, chromedriver and selenium")

KEY = "page-test-key"


def _serve(*args: str) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "diffgemma.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, base)
        yield base
    finally:
        stop(proc, 10)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    yield from _serve()


@pytest.fixture(scope="module")
def keyed() -> Iterator[str]:
    yield from _serve("--api-key", KEY)


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield drv
    drv.quit()


def _wait(drv, cond, timeout: float = 60):
    return WebDriverWait(drv, timeout, poll_frequency=0.02).until(lambda d: cond(d))


def _open(drv, base: str) -> None:
    drv.get(base + "/")
    drv.execute_script("sessionStorage.clear()")
    drv.get(base + "/")


def _send(drv, text: str) -> None:
    box = drv.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    drv.find_element(By.ID, "send").click()


def _replies(drv) -> list[str]:
    return [e.text for e in drv.find_elements(By.CSS_SELECTOR, ".msg.assistant .text")]


def test_the_page_loads_and_a_message_gets_a_streamed_reply(server, browser) -> None:
    _open(browser, server)
    _wait(browser, lambda d: d.find_element(By.ID, "status").text == "ready")
    assert browser.find_element(By.ID, "model").text  # the model's id, from /v1/models
    # every canvas step the server sends is kept in the page's log of frames, so the test sees each state
    browser.execute_script(
        "window.frames_seen = []; const r = renderCanvas;"
        "renderCanvas = (f) => { window.frames_seen.push([f.block, f.step, f.accepted.filter(Boolean).length,"
        " f.tokens.join('')]); r(f); };"
    )
    browser.find_element(By.ID, "interval").clear()
    browser.find_element(By.ID, "interval").send_keys("0")
    _send(browser, "Count from 1 to 40.")
    _wait(browser, lambda d: d.find_element(By.ID, "status").text.startswith("finished"))
    # the streamed reply as the page shows it is the server's answer to the same request
    model = browser.find_element(By.ID, "model").text
    req = {"model": model, "messages": [{"role": "user", "content": "Count from 1 to 40."}], "seed": 42}
    want = httpx.post(server + "/v1/chat/completions", json=req, timeout=60).json()
    assert _replies(browser)[-1] == want["choices"][0]["message"]["content"].strip()
    assert "7, 8, 9" in _replies(browser)[-1]
    frames = browser.execute_script("return window.frames_seen")
    block0 = [f for f in frames if f[0] == 0]
    assert len({(f[1], f[3]) for f in block0}) >= 2  # two distinct step states of the first block
    cells = browser.find_elements(By.CSS_SELECTOR, "#canvas .cell")
    assert len(cells) == 32 and all(
        c.get_attribute("class") in ("cell accepted", "cell renoised") for c in cells
    )
    assert "block" in browser.find_element(By.ID, "canvas-status").text


def test_stop_cancels_the_request(server, browser) -> None:
    _open(browser, server)
    _wait(browser, lambda d: d.find_element(By.ID, "status").text == "ready")
    before = _cancelled(server)
    _send(browser, "Count from 1 to 500.")
    _wait(browser, lambda d: d.find_element(By.ID, "stop").is_enabled() and _replies(d)[-1])
    browser.find_element(By.ID, "stop").click()
    _wait(browser, lambda d: d.find_element(By.ID, "status").text == "stopped")
    assert "(stopped)" in browser.find_element(By.CSS_SELECTOR, ".msg.assistant:last-child").text
    deadline = time.time() + 30  # the server sees the disconnect and stops between denoise steps
    while _cancelled(server) == before and time.time() < deadline:
        time.sleep(0.1)
    assert _cancelled(server) == before + 1


def _cancelled(base: str) -> float:
    text = httpx.get(base + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("diffgemma_generations_total") and 'reason="cancelled"' in line
    )


def test_with_an_api_key_the_page_works_only_after_the_key_is_entered(keyed, browser) -> None:
    page = httpx.get(keyed + "/")
    assert page.status_code == 200 and "diffgemma" in page.text  # the page itself needs no key
    assert httpx.get(keyed + "/v1/models").status_code == 401  # its data does
    _open(browser, keyed)
    dialog = browser.find_element(By.ID, "key-dialog")
    _wait(browser, lambda d: dialog.get_attribute("open") is not None)
    assert browser.find_element(By.ID, "model").text == ""
    browser.find_element(By.ID, "key-input").send_keys("wrong")
    browser.find_element(By.ID, "key-save").click()
    _wait(browser, lambda d: "refused" in d.find_element(By.ID, "key-error").text)
    browser.find_element(By.ID, "key-input").send_keys(KEY)
    browser.find_element(By.ID, "key-save").click()
    _wait(browser, lambda d: d.find_element(By.ID, "status").text == "ready")
    _send(browser, "What is 17 + 25?")
    _wait(browser, lambda d: d.find_element(By.ID, "status").text.startswith("finished"))
    assert "42" in _replies(browser)[-1]


def test_the_schema_panel_shows_answers_as_bars(server, browser) -> None:
    _open(browser, server)
    _wait(browser, lambda d: d.find_element(By.ID, "status").text == "ready")
    browser.find_element(By.ID, "ask").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#answers .bar"))
    bars = browser.find_elements(By.CSS_SELECTOR, "#answers .bar")
    assert [b.find_element(By.CSS_SELECTOR, "span").text for b in bars] == ["animal", "fruit", "object"]
    widths = [
        float(b.find_element(By.CSS_SELECTOR, ".fill").value_of_css_property("width")[:-2]) for b in bars
    ]
    assert all(w >= 0 for w in widths) and max(widths) > 0
    assert "kind:" in browser.find_element(By.ID, "answers").text


def test_assets_are_served_with_a_same_origin_policy(server) -> None:
    for path, kind in (
        ("/", "text/html"),
        ("/page/page.js", "text/javascript"),
        ("/page/page.css", "text/css"),
    ):
        r = httpx.get(server + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert "default-src 'self'" in r.headers["content-security-policy"]
    assert httpx.get(server + "/page/index.html").status_code == 404
    assert httpx.get(server + "/page/../config.py").status_code == 404
