"""A real headless Chromium for the page tests (Debian's chromium + chromedriver, driven by Selenium), with a fresh
profile each time, at 1600x1000; their screenshots go to test-artifacts/ (PPOFLOW_TEST_ARTIFACTS moves it)."""

import os
import shutil
import subprocess
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import ROOT

ARTIFACTS = Path(os.environ.get("PPOFLOW_TEST_ARTIFACTS", ROOT / "test-artifacts"))


def chromium() -> webdriver.Chrome:
    """A new headless Chromium; on a fresh machine its packages are installed first, as .ci/run does."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        installed = subprocess.run([str(ROOT / "tests" / "ui" / "install_chromium.sh")], capture_output=True, text=True)
        assert installed.returncode == 0, (
            f"the page tests need Debian's chromium and chromium-driver: {installed.stderr[-500:]}"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1600,1000",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def page_text_once_it_shows(browser: webdriver.Chrome, *texts: str, timeout_s: float = 60) -> str:
    """The page's text once every one of ``texts`` is in it (a single-page app renders after it loads)."""
    WebDriverWait(browser, timeout_s).until(
        lambda b: all(text in b.find_element(By.TAG_NAME, "body").text for text in texts)
    )
    return browser.find_element(By.TAG_NAME, "body").text


def screenshot(browser: webdriver.Chrome, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / name))
