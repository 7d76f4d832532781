"""tests/browser.py: the page tests skip with their reason where there is no Chromium, and fail in CI."""
import pytest

from tests import browser


def test_a_missing_browser_skips_here_and_fails_in_ci(monkeypatch):
    monkeypatch.setattr(browser, "CHROMIUM", None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no chromium on PATH"):
        browser.require_chromium()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="in CI the browser tests must run"):
        browser.require_chromium()
    monkeypatch.setattr(browser, "CHROMIUM", "/usr/bin/chromium")
    assert browser.require_chromium() == "/usr/bin/chromium"
