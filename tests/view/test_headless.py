"""``detjac.view.headless`` keeps selenium optional: importing it loads no selenium, and a driver asked for where the
browser is missing says what is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_importing_it_loads_no_selenium():
    code = "import sys, detjac.view.headless; print(any(m.startswith('selenium') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_a_driver_without_a_browser_names_what_is_missing(monkeypatch):
    from detjac.view import headless

    monkeypatch.setattr(headless.shutil, "which", lambda name: None)
    assert headless.browser_missing().endswith("chromium, chromedriver")
    with pytest.raises(RuntimeError, match="apt-get install chromium chromium-driver.*Got no .*chromium, chromedriver"):
        headless.new_driver()
