"""A headless Debian chromium driven by Selenium through Debian's chromium-driver (nothing downloaded).

`make test` installs both (the Makefile's system-tools); without them the browser tests fail,
saying what to install, rather than skip.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

# The window the page is laid out in: a laptop's screen.
WINDOW = "1400,1000"
# chromium as root (the test machines' user) runs only without its sandbox.
CHROMIUM_ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--window-size={WINDOW}", "--no-first-run", "--disable-extensions")


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    browser = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        raise AssertionError("the admin page's browser test needs Debian's chromium and chromium-driver: "
                             "`make system-tools` (or `apt-get install chromium chromium-driver`)")
    options = Options()
    options.binary_location = browser
    for argument in CHROMIUM_ARGS:
        options.add_argument(argument)
    session = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    try:
        yield session
    finally:
        session.quit()  # ends chromium and the chromedriver process Selenium started
