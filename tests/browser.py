"""The browser the page tests drive: the system's Chromium, found on PATH as every page test finds it.

Where there is none, the page tests skip with the reason; in CI (CI=true, where .ci/run installs Chromium)
they fail instead, so a CI run can never pass with its browser tests skipped."""
import os
import shutil

import pytest

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REASON = "no chromium on PATH (apt-get install chromium) for the browser test"


def require_chromium() -> str:
    """The browser's path, or skip (fail under CI=true) with the reason."""
    if CHROMIUM is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{REASON}; .ci/run installs it, so in CI the browser tests must run")
        pytest.skip(REASON)
    return CHROMIUM
