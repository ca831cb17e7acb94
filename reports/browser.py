"""Open a report in headless Chromium (Debian's chromium + chromedriver, driven by selenium):
used by the browser tests, and to take the README's screenshot:

    python -m reports.browser runs/.../report.html docs/report-top.png [--width 1280 --height 1000]
    python -m reports.browser runs/.../report.html docs/report-capacity.png --section capacity

Needs `apt-get install -y chromium chromium-driver` and `pip install selenium` (the [dev] extra).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# docs/platform.md: how Chromium runs on the build machines.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
                  "--hide-scrollbars", "--force-device-scale-factor=1"]


def _find(path: str, name: str) -> str | None:
    return path if Path(path).exists() else shutil.which(name)


def missing() -> str | None:
    """Why a browser cannot be started here (None: it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium, or the [dev] extra)"
    if not _find(CHROMIUM, "chromium"):
        return f"{CHROMIUM} not found (apt-get install -y chromium chromium-driver)"
    if not _find(CHROMEDRIVER, "chromedriver"):
        return f"{CHROMEDRIVER} not found (apt-get install -y chromium-driver)"
    return None


def chromium(width: int = 1400, height: int = 1000) -> Any:
    """A headless Chromium WebDriver that keeps the page's console log (goog:loggingPrefs)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = _find(CHROMIUM, "chromium") or CHROMIUM
    for flag in CHROMIUM_FLAGS + [f"--window-size={width},{height}"]:
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(_find(CHROMEDRIVER, "chromedriver") or CHROMEDRIVER), options=opts)


def open_report(driver: Any, path: str | Path, timeout_s: float = 60.0) -> None:
    """Load a report and wait until the document is complete and every figure is drawn (or
    the timeout passes: the caller's assertions then say what is missing)."""
    driver.get(Path(path).resolve().as_uri())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = driver.execute_script(
            "return [document.readyState, document.querySelectorAll('script.fig-data').length,"
            " document.querySelectorAll('.js-plotly-plot').length]")
        if state[0] == "complete" and state[1] == state[2]:
            return
        time.sleep(0.1)


def screenshot(report: str | Path, out: str | Path, width: int = 1280, height: int = 1000,
               section: str | None = None) -> Path:
    """The top of a report as a PNG, or one whole section of it (`section`: its id, e.g.
    "capacity"); palette-quantised when Pillow is present, to stay small."""
    driver = chromium(width, height)
    try:
        open_report(driver, report)
        if section is not None:
            tall = driver.execute_script("const s = document.getElementById(arguments[0]);"
                                         "return s ? s.scrollHeight : null", section)
            if tall is None:
                raise ValueError(f"{report}: no section with id {section!r}")
            height = max(height, int(tall) + 100)
        inner = driver.execute_script("return [window.innerWidth, window.innerHeight]")
        driver.set_window_size(2 * width - inner[0], 2 * height - inner[1])   # the viewport, exactly
        time.sleep(0.5)   # let Plotly finish its transitions and resizes
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if section is None:
            driver.save_screenshot(str(out))
        else:
            from selenium.webdriver.common.by import By
            driver.find_element(By.ID, section).screenshot(str(out))
    finally:
        driver.quit()
    try:
        from PIL import Image
        Image.open(out).convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(out, optimize=True)
    except ImportError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reports.browser",
                                description="Screenshot the top of a report, or one of its sections.")
    p.add_argument("report")
    p.add_argument("out")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=1000)
    p.add_argument("--section", default=None, metavar="ID", help="one section (its id, e.g. capacity), whole")
    a = p.parse_args(argv)
    why = missing()
    if why:
        print(f"reports.browser: error: {why}", file=sys.stderr)
        return 2
    try:
        print(screenshot(a.report, a.out, a.width, a.height, a.section))
    except ValueError as e:
        print(f"reports.browser: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
