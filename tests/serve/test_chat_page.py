"""The chat page in a real headless Chromium: it loads from the server alone, sends a message,
and the reply streams in (several updates of the same bubble) until it finishes; the Stop
button aborts a reply mid-stream."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.serve.conftest import start_server

webdriver = pytest.importorskip("selenium.webdriver")

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def browser_paths() -> tuple[str, str] | None:
    chromium = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    driver = CHROMEDRIVER if Path(CHROMEDRIVER).exists() else shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


@pytest.fixture(scope="module")
def browser():
    paths = browser_paths()
    if paths is None:
        pytest.skip("no Chromium + chromedriver installed (`make install` adds them where apt can)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,720"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(paths[1]), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page_server(checkpoint):
    background, served = start_server(checkpoint, max_batch=4)
    yield background, served
    background.stop()


def wait_until(condition, what: str, seconds: float = 60.0):
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.01)


def reply_state(browser) -> tuple[int, bool, str]:
    """The assistant bubble's text length, whether it is still streaming, and its text."""
    return browser.execute_script(
        "const r = document.querySelector('.message.assistant');"
        "return r ? [r.firstChild ? r.firstChild.textContent.length : 0, r.classList.contains('streaming'), r.innerText]"
        "         : [0, false, ''];")


def test_a_message_gets_a_streamed_reply_in_the_page(browser, page_server, tmp_path):
    from selenium.webdriver.common.by import By

    from tests.serve.test_server import gated

    url = page_server[0].url
    gate = gated(page_server[1])  # the engine takes a step per permit: the test sees the reply grow
    try:
        browser.get(url + "/")
        wait_until(lambda: "tiny" in browser.find_element(By.ID, "model").text, "the page to read the model's name")
        for field, value in (("max_tokens", "200"), ("temperature", "0")):
            browser.find_element(By.ID, field).clear()
            browser.find_element(By.ID, field).send_keys(value)
        browser.find_element(By.ID, "input").send_keys("Who is the king?")
        browser.find_element(By.ID, "send").click()
        user = wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.user"), "the user's bubble")
        assert user[0].text == "Who is the king?"
        gate.release(12)
        first, streaming, _ = wait_until(lambda: (s := reply_state(browser))[0] > 0 and s, "the first words")
        assert streaming  # text shows before the reply has finished
        gate.release(30)
        wait_until(lambda: reply_state(browser)[0] > first, "more words in the same bubble")
        gate.release(10_000)
        _, streaming, text = wait_until(lambda: "finished:" in (s := reply_state(browser))[2] and s, "the reply to finish")
        assert not streaming and "finished: " in text and " tokens" in text
        assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()
        browser.save_screenshot(str(tmp_path / "chat.png"))
        assert (tmp_path / "chat.png").stat().st_size > 1000
    finally:
        gate.hook.remove()
        gate.release(10_000)


def test_stop_aborts_a_reply_mid_stream(browser, page_server):
    from selenium.webdriver.common.by import By

    from tests.serve.test_server import gated, health, wait_for

    url = page_server[0].url
    gate = gated(page_server[1])
    try:
        browser.get(url + "/")
        wait_until(lambda: "tiny" in browser.find_element(By.ID, "model").text, "the page to load")
        browser.find_element(By.ID, "input").send_keys("Tell me a long story.")
        browser.find_element(By.ID, "send").click()
        wait_until(lambda: browser.find_element(By.ID, "stop").is_enabled(), "the stream to start")
        gate.release(5)
        browser.find_element(By.ID, "stop").click()
        reply = wait_until(lambda: "finished: stopped" in browser.find_element(By.CSS_SELECTOR, ".message.assistant").text
                           and browser.find_element(By.CSS_SELECTOR, ".message.assistant"), "the reply to stop")
        assert reply
        # one more step per poll, so the request cannot run to its end before the server sees the abort
        wait_for(lambda: health(url)["cancelled"] >= 1, "the server to cancel the request", tick=gate.release)
        assert health(url)["finished"] == 1  # only the first test's request ran to its end
    finally:
        gate.hook.remove()
        gate.release(10_000)
