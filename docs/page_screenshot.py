"""Writes docs/page.png: the chat page mid-denoise, in headless Chromium against `diffgemma serve` on the bundled
demo model. The page's stream is held at the first step of the reply's second block (its first block committed
above, the second's canvas live), the screenshot taken, the stream let go.

    python docs/page_screenshot.py [--out docs/page.png]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.browser.test_page import _serve  # noqa: E402

HOLD = """
const inner = sseEvents;
sseEvents = async function* (resp) {
  for await (const ev of inner(resp)) {
    yield ev;
    if (ev.event === "canvas") {
      const f = JSON.parse(ev.data);
      if (f.block === 1 && f.step === 1) { window.held = true; await new Promise((r) => { window.resume = r; }); }
    }
  }
};
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).with_name("page.png")))
    args = ap.parse_args()
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,860"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    server = _serve()
    base = next(server)
    try:
        drv.get(base + "/")
        WebDriverWait(drv, 60).until(lambda d: d.find_element(By.ID, "status").text == "ready")
        drv.execute_script(HOLD)
        drv.find_element(By.ID, "interval").clear()
        drv.find_element(By.ID, "interval").send_keys("0")
        drv.find_element(By.ID, "prompt").send_keys("Count from 1 to 40.")
        drv.find_element(By.ID, "send").click()
        WebDriverWait(drv, 60, poll_frequency=0.02).until(
            lambda d: d.execute_script("return window.held === true")
        )
        time.sleep(0.2)
        drv.save_screenshot(args.out)
        drv.execute_script("window.resume()")
        print(f"wrote {args.out}")
    finally:
        drv.quit()
        server.close()


if __name__ == "__main__":
    main()
