"""Every Space in a real headless Chromium (selenium): load it, run one action, see the output. router-explorer
also switches preset (the router's declared controls) and is screenshot.

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


@pytest.fixture(scope="module")
def browser(tmp_path_factory):  # one Chromium for every Space: starting it is the slow part
    tmp_path = tmp_path_factory.mktemp("chromium")
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


def image_src(driver, selector):
    """The source of the image rendered in ``selector``, once it has loaded with a non-zero size (else None, also
    when Gradio replaces the image while it is read: the new one is not rendered yet)."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        for img in driver.find_elements("css selector", f"{selector} img"):
            if driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) and \
                    img.size["width"] > 0 and img.size["height"] > 0:
                return img.get_attribute("src")
    except StaleElementReferenceException:
        return None
    return None


def heatmap_src(driver):
    return image_src(driver, "#heatmap")


def shown_text(driver, selector):
    """The visible text of ``selector`` ("" while it is absent or hidden)."""
    found = driver.find_elements("css selector", selector)
    return found[0].text if found and found[0].is_displayed() else ""


def click_label(driver, selector, text):
    """Click the radio/checkbox label reading ``text`` inside ``selector``."""
    for label in driver.find_elements("css selector", f"{selector} label"):
        if label.text.strip() == text:
            label.click()
            return
    raise AssertionError(f"no {text!r} in {selector}")


def test_router_explorer_in_chromium(browser, default_model):  # noqa: F811
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    from zoo.demos.spaces import load_app

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
        # the strong preset of the router's declared controls: top-1, a new analysis
        click_label(browser, "#router-preset", "strong")
        wait.until(lambda d: (s := heatmap_src(d)) != src and s, "the heatmap did not change with the preset")
        options = browser.find_element("css selector", "#router-options").text.replace("\n", "").replace(" ", "")
        assert '"top_k":1,' in options, options  # the JSON viewer shows what /analyze receives


def test_compression_lab_in_chromium(browser, default_model, monkeypatch):  # noqa: F811
    from selenium.webdriver.support.ui import WebDriverWait

    from zoo.demos.spaces import load_app

    monkeypatch.setenv("MOE_ZOO_LAB_WINDOWS", "1")
    monkeypatch.setenv("MOE_ZOO_LAB_TOKENS", "1024")
    with serve(load_app("compression-lab").build_demo()) as url:
        browser.get(url)
        wait = WebDriverWait(browser, 180, poll_frequency=0.5)
        first = wait.until(lambda d: image_src(d, "#saliency"), "the saliency map never rendered")
        wait.until(lambda d: "num_experts" in shown_text(d, "#compressor-options"), "no options for prune-reap")
        assert not shown_text(browser, "#runs")  # no empty table before the first run
        browser.find_element("css selector", "#compress").click()
        wait.until(lambda d: image_src(d, "#pareto"), "the size-vs-quality plot never rendered")
        runs = wait.until(lambda d: (t := shown_text(d, "#runs")) and "prune-reap" in t and t)
        assert "base" in runs
        wait.until(lambda d: (s := image_src(d, "#saliency")) != first and s, "saliency did not mark the run")


def test_adapter_lab_in_chromium(browser, default_model, monkeypatch):  # noqa: F811
    from selenium.webdriver.support.ui import WebDriverWait

    from zoo.demos.spaces import load_app

    monkeypatch.setenv("MOE_ZOO_LAB_WINDOWS", "1")
    with serve(load_app("adapter-lab").build_demo()) as url:
        browser.get(url)
        wait = WebDriverWait(browser, 240, poll_frequency=0.5)
        wait.until(lambda d: '"r"' in shown_text(d, "#adapter-options") or "r" in shown_text(d, "#adapter-options"),
                   "no options for lora-experts")
        browser.find_element("css selector", "#finetune").click()
        table = wait.until(lambda d: (t := shown_text(d, "#perplexity")) and "code" in t and t,
                           "no held-out perplexity after fine-tuning")
        assert "english" in table
        wait.until(lambda d: image_src(d, "#usage"), "the usage plot never rendered")


def test_model_zoo_in_chromium(browser, default_model):  # noqa: F811
    from selenium.webdriver.support.ui import WebDriverWait

    from zoo.demos.spaces import load_app

    with serve(load_app("model-zoo").build_demo()) as url:
        browser.get(url)
        wait = WebDriverWait(browser, 120, poll_frequency=0.5)
        card = wait.until(lambda d: (t := shown_text(d, "#model-card")) and "Recipe" in t and t,
                          "the model card never rendered")
        assert "library_name" not in card  # markdown, its YAML metadata left out
        if default_model == "zoo-tiny-moe":
            heading = browser.find_element("css selector", "#model-card h1").text
            assert heading == "zoo-tiny-moe"


def test_multimodal_digits_in_chromium(browser, tmp_path):
    import wave

    import numpy as np
    from selenium.webdriver.support.ui import WebDriverWait

    from zoo.demos.spaces import load_app

    clip = tmp_path / "tone.wav"
    rate = 22050
    samples = (0.3 * np.sin(2 * np.pi * 220 * np.arange(rate // 2) / rate) * 32767).astype(np.int16)
    with wave.open(str(clip), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    with serve(load_app("multimodal-digits").build_demo()) as url:
        browser.get(url)
        wait = WebDriverWait(browser, 120, poll_frequency=0.5)
        upload = wait.until(lambda d: d.find_element("css selector", "#speech input[type=file]"))
        upload.send_keys(str(clip))
        wait.until(lambda d: d.find_elements("css selector", "#speech audio, #speech button[aria-label=Clear]"),
                   "the clip did not load")
        browser.find_element("css selector", "#answer").click()

        def answered(d):
            errors = [e.text for e in d.find_elements("css selector", ".toast-body") if e.text.strip()]
            assert not errors, f"the Space answered with an error: {errors}"
            text = shown_text(d, "#answer-label")
            return any(w in text for w in ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                                            "nine")) and text

        answer = WebDriverWait(browser, 240, poll_frequency=0.5).until(answered, "no answer")
        assert "%" in answer
        wait.until(lambda d: image_src(d, "#groups"), "the expert-group plot never rendered")
