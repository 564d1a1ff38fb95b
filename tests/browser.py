"""The system Chromium (Debian's `chromium` package, installed by `make test` through
scripts/ensure_browser.sh where it can be) driven by Playwright."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("MFT_CHROMIUM", "/usr/bin/chromium"))
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "img"


def require_chromium() -> None:
    """Skip, never fail, where no browser could be installed (a fresh machine without root): the
    message says what to install. `make test` installs it first wherever it can."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: apt-get install -y chromium chromium-driver "
                    "(`make test` does this itself when run as root or with passwordless sudo)")


@contextlib.contextmanager
def browser_page(width: int = 1250, height: int = 900):
    from playwright.sync_api import sync_playwright

    require_chromium()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def keep_screenshot(page, name: str, tmp_path: Path, full_page: bool = True) -> Path:
    """Screenshot into tmp_path; with MFT_DOCS_SCREENSHOTS=1 also into docs/img/ (how the docs' pictures are made)."""
    out = tmp_path / name
    page.screenshot(path=str(out), full_page=full_page)
    if os.environ.get("MFT_DOCS_SCREENSHOTS") == "1":
        DOCS.mkdir(parents=True, exist_ok=True)
        (DOCS / name).write_bytes(out.read_bytes())
    return out
