"""The picture of the chat page in docs/serving.md: `lmforge serve`'s page in headless Chromium, a
short conversation with a checkpoint (the demo's SFT model by default), saved as a PNG.

    python scripts/screenshot_chat.py [--checkpoint runs/demo/sft] [--out docs/img/chat.png]
"""

from __future__ import annotations

import argparse
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from lmforge.data.sft_demo import SYSTEM_PROMPT
from lmforge.serve.app import create_app
from lmforge.serve.server import BackgroundServer
from lmforge.stages.serve import ServeRecipe, build_served

MESSAGES = ["What is 44 * 3?", "What is 864 - 394?"]  # two of the demo's exact-answer tasks


def wait_for_reply(driver: webdriver.Chrome, count: int, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        replies = driver.find_elements(By.CSS_SELECTOR, ".message.assistant .meta")
        if len(replies) >= count:
            return
        time.sleep(0.05)
    raise TimeoutError(f"reply {count} did not finish")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="runs/demo/sft")
    parser.add_argument("--out", default="docs/img/chat.png")
    parser.add_argument("--name", default="demo-sft", help="the model's name on the page")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    args = parser.parse_args()

    served = build_served(ServeRecipe(checkpoint=args.checkpoint, model_name=args.name, device="cpu"))
    options = webdriver.ChromeOptions()
    options.binary_location = args.chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1000,700", "--hide-scrollbars"):
        options.add_argument(arg)
    with BackgroundServer(create_app(served)) as server:
        driver = webdriver.Chrome(service=Service(args.chromedriver), options=options)
        try:
            driver.get(server.url + "/")
            driver.find_element(By.ID, "system").send_keys(SYSTEM_PROMPT)
            driver.find_element(By.ID, "temperature").clear()
            driver.find_element(By.ID, "temperature").send_keys("0")
            for i, message in enumerate(MESSAGES, start=1):
                driver.find_element(By.ID, "input").send_keys(message)
                driver.find_element(By.ID, "send").click()
                wait_for_reply(driver, i)
            driver.save_screenshot(args.out)
        finally:
            driver.quit()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
