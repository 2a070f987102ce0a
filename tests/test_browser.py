"""router-explorer in a real headless Chromium (selenium): type text, analyze, see the heatmap, screenshot it.

Needs the Debian packages ``chromium`` and ``chromium-driver`` (paths below, passed explicitly, so
Selenium Manager never downloads anything). Missing, the test fails and says what to install.
"""
import os
import shutil
from pathlib import Path

import pytest

from test_spaces import default_model, serve  # noqa: F401  (shared fixture and helper)

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCREENSHOTS = Path(__file__).resolve().parent.parent / "out" / "screenshots"
TEXT = "def greet(name):\n    return 'Hello, ' + name"


@pytest.fixture
def browser(tmp_path):
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not found: install Chromium and its driver "
                    "(Debian/Ubuntu: apt-get install chromium chromium-driver)", pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1700", "--lang=en-US"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(tmp_path / "profile", ignore_errors=True)


def heatmap_src(driver):
    """The rendered heatmap's image source, once it has loaded with a non-zero size (else None)."""
    for img in driver.find_elements("css selector", "#heatmap img"):
        if driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) and \
                img.size["width"] > 0 and img.size["height"] > 0:
            return img.get_attribute("src")
    return None


def test_router_explorer_in_chromium(browser, default_model):  # noqa: F811
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    from zoo.spaces import load_app

    with serve(load_app("router-explorer").build_demo()) as url:
        browser.get(url)
        wait = WebDriverWait(browser, 120, poll_frequency=0.5)
        first = wait.until(heatmap_src, "the heatmap of the example text never rendered")  # page load runs it once
        box = wait.until(lambda d: d.find_element("css selector", "#text textarea"))
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.DELETE)
        box.send_keys(TEXT)
        browser.find_element("css selector", "#analyze").click()
        src = wait.until(lambda d: (s := heatmap_src(d)) != first and s, "the heatmap did not change after Analyze")
        assert src.startswith("data:image/png;base64,")
        table = wait.until(lambda d: (t := d.find_element("css selector", "#assignment").text) and
                           "question" not in t and "def" in t and t)  # the example's rows replaced by ours
        assert "layer 0" in table and "layer 1" in table
        ppl = browser.find_element("css selector", "#perplexity input").get_attribute("value")
        assert float(ppl) > 1
        img = browser.find_element("css selector", "#heatmap img")
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", img)
        assert img.size["width"] > 300 and img.size["height"] > 200, img.size
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page, plot = SCREENSHOTS / "router-explorer.png", SCREENSHOTS / "router-explorer-heatmap.png"
        assert browser.save_screenshot(str(page)) and img.screenshot(str(plot))
        assert page.stat().st_size > 10_000 and plot.stat().st_size > 5_000
        print(f"\nscreenshots: {page} and {plot}")
