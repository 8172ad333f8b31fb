"""``detjac view`` in a browser without a screen: the viewer served by a ``detjac view`` process, and a headless
Chromium driven by selenium (never allowed to download anything), as the viewer's tests, its benchmark and the
docs' screenshots use them. Import it explicitly (``from detjac.view.headless import Served, new_driver``).

The browser needs the ``selenium`` package (the ``test`` extra; imported only when a driver is made) and Debian's
``chromium`` with its driver (``apt-get install chromium chromium-driver``); :func:`browser_missing` says what is
lacking, and :func:`new_driver` refuses with that.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

INSTALL = "apt-get install chromium chromium-driver (Debian/Ubuntu) and pip install selenium (the test extra)"


def detjac_command(*args: str) -> list[str]:
    """The command line of ``detjac ARGS`` with this interpreter."""
    return [sys.executable, "-m", "detjac.cli.main", *args]


class Served:
    """A ``detjac view STORE OPTIONS`` process (``STORE``: a store or a graph JSON file) and the URL it printed;
    :meth:`stop` ends it."""

    def __init__(self, store: str | Path, *options: str) -> None:
        self.process = subprocess.Popen(detjac_command("view", str(store), *options), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self.first_line = self.process.stdout.readline()  # printed once the server listens
        found = re.search(r"(http://\S+/)", self.first_line)
        if found is None:
            self.process.kill()
            raise RuntimeError(f"Expected detjac view to print its URL. Got {self.first_line!r}, "
                               f"{self.process.stderr.read()!r}")
        self.url = found.group(1)

    def stop(self) -> str:
        """Stop the server; its standard error."""
        self.process.terminate()
        _, err = self.process.communicate(timeout=10)
        return err


def chromium_binary() -> str | None:
    return next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name)) is not None), None)


def browser_missing() -> str | None:
    """What a headless browser lacks here, as text (None: nothing)."""
    import importlib.util

    missing = []
    if importlib.util.find_spec("selenium") is None:
        missing.append("the selenium package")
    if chromium_binary() is None:
        missing.append("chromium")
    if shutil.which("chromedriver") is None:
        missing.append("chromedriver")
    return ", ".join(missing) or None


def new_driver():
    """A headless Chromium with the local chromedriver (selenium-manager kept offline); a RuntimeError naming what
    is missing when selenium, chromium or chromedriver is."""
    missing = browser_missing()
    if missing is not None:
        raise RuntimeError(f"Expected selenium, chromium and chromedriver for a headless browser ({INSTALL}). "
                           f"Got no {missing}.")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000",
                "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.binary_location = chromium_binary()
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for tests that read it
    os.environ.setdefault("SE_OFFLINE", "true")
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
