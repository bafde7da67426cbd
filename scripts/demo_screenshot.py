"""A screenshot of the demo page for a model folder, taken in headless Chromium (the README's picture).

    .venv/bin/python scripts/demo_screenshot.py runs/multi30k-en-de/averaged docs/images/demo.png
    .venv/bin/python scripts/demo_screenshot.py MODEL OUT.png --sentence "Two dogs are playing in the snow."

Serves `vaswani-tx demo`'s page on 127.0.0.1 (a free port), types the sentence, presses Translate, reads the
translation, opens the attention view and saves a screenshot of the page; then stops the browser and the server.
Needs Debian's `chromium` and `chromium-driver` (`apt-get install chromium chromium-driver`) and selenium (the
dev extra). The browser resolves no name but 127.0.0.1, so the page reaches nothing else. tests/test_demo.py
runs the same steps (`open_browser`, `translate_on_page`, `open_attention`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from pathlib import Path

# what the browser needs to show a heatmap whose token labels can be read
WINDOW = (1400, 1500)
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",  # root in a container has no user namespace for Chromium's sandbox
    "--disable-dev-shm-usage",
    "--disable-gpu",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # only 127.0.0.1 is ever contacted
    "--no-proxy-server",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--no-first-run",
    "--lang=en-US",
)


def chromium() -> tuple[str, str] | None:
    """The paths of Chromium and its driver (Debian's `chromium` and `chromium-driver`), or None when one is missing."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def open_browser(window: tuple[int, int] = WINDOW):
    """Headless Chromium through Selenium, with the driver given (Selenium Manager, which downloads, never runs)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    paths = chromium()
    if paths is None:
        raise RuntimeError("Chromium or its driver is missing: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in (*CHROMIUM_FLAGS, f"--window-size={window[0]},{window[1]}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=paths[1]), options=options)


def translate_on_page(driver, url: str, sentence: str, timeout: float = 60) -> str:
    """Open the page, type `sentence`, press Translate; the translation the page shows."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    wait = WebDriverWait(driver, timeout)
    source = wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "#source textarea")))
    source.clear()
    source.send_keys(sentence)
    driver.find_element(By.CSS_SELECTOR, "#translate").click()
    box = driver.find_element(By.CSS_SELECTOR, "#translation textarea")
    return wait.until(lambda _: box.get_attribute("value"))


def open_attention(driver, timeout: float = 60) -> None:
    """Open the attention view and wait for both figures (the heatmap and the overview of its layer)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element(By.CSS_SELECTOR, "#attention .label-wrap").click()
    figures = "#heatmap img, #overview img"
    WebDriverWait(driver, timeout).until(lambda d: len([i for i in d.find_elements(By.CSS_SELECTOR, figures)]) == 2)
    WebDriverWait(driver, timeout).until(
        lambda d: all(
            d.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", image)
            for image in d.find_elements(By.CSS_SELECTOR, figures)
        )
    )


def save_screenshot(driver, path: str | os.PathLike) -> Path:
    """The whole page, as tall as its content, to a PNG file."""
    for _ in range(3):  # the page reflows at a new size: until the window holds all of it
        height = driver.execute_script(
            "return Math.max(document.documentElement.scrollHeight, document.body.scrollHeight, "
            "document.querySelector('gradio-app')?.scrollHeight || 0)"
        )
        if driver.get_window_size()["height"] >= height + 100:
            break
        driver.set_window_size(WINDOW[0], height + 200)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not driver.save_screenshot(str(path)):
        raise RuntimeError(f"the browser could not save {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a saved model folder, as for vaswani-tx demo")
    parser.add_argument("output", help="the PNG file to write")
    parser.add_argument("--sentence", default="Two young men are playing soccer on a field.")
    args = parser.parse_args(argv)
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    from vaswani_tx.demo.demo import build_demo, serve

    page = serve(build_demo(args.model, device="cpu"), "127.0.0.1", free_port(), block=False)
    driver = None
    try:
        driver = open_browser()
        translation = translate_on_page(driver, page.local_url, args.sentence)
        open_attention(driver)
        print(f"{args.sentence} -> {translation}\n{save_screenshot(driver, args.output)}")
    finally:
        if driver is not None:
            driver.quit()
        page.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
