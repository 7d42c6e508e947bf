"""The console in headless Chromium (Debian's chromium and chromedriver, driven by Selenium): it
loads behind the sign-in form, shows a breaker opening when a fake provider fails, and flips the
kill switch end to end, through its confirm step. The page's screenshot is checked non-empty
(with ``TIDEGATE_TEST_UPDATE_SCREENSHOT=1`` it is also written to docs/img/console.png)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.admin_harness import admin_auth, prompt_flag, two_sockets
from tests.gateway.harness import KEY, fake

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip(
        "headless Chromium is not installed (Debian packages chromium and chromium-driver; "
        ".ci/run installs them)",
        allow_module_level=True,
    )
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ADMIN = "tg-console-admin-key"
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "console.png"


def _config(tmp_path: Path) -> dict[str, Any]:
    return {
        "auth": admin_auth(tmp_path, ADMIN),
        "providers": {
            "flaky": fake("never", model="m-flaky", faults=[{"kind": "http", "status": 500}]),
            "backup": fake("from the backup", model="m-backup"),
        },
        "models": {"chat": {"providers": ["flaky", "backup"]}},
        "retry": {"attempts": 1},
        "breaker": {"consecutive_failures": 3, "recovery_s": 600},
        "flags": [prompt_flag()],
    }


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1100",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _until(driver: Any, check: Callable[[Any], Any], timeout: float = 10.0) -> Any:
    # The page re-renders its tables on every poll: an element found an instant before may be
    # gone when it is read, which is a reason to look again, not a failure.
    return WebDriverWait(
        driver, timeout, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
    ).until(check)


def _text(driver: Any, selector: str) -> str:
    """The element's text, found again if a re-render replaced it while it was being read."""
    for _ in range(20):
        try:
            return str(driver.find_element(By.CSS_SELECTOR, selector).text)
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"{selector} was replaced on every read")


def test_the_console_shows_a_breaker_opening_and_flips_the_kill_switch(
    tmp_path: Path, browser: Any
) -> None:
    with two_sockets(tmp_path, _config(tmp_path)) as (public, admin, _):
        browser.get(f"{admin}/console")
        browser.find_element(By.ID, "key").send_keys(ADMIN)
        browser.find_element(By.ID, "sign-in").click()
        _until(browser, lambda d: _text(d, "#operator") == "oncall")
        breaker = '#breakers tr[data-provider="flaky"] td.state'
        _until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, breaker))
        assert _text(browser, breaker) == "closed"
        assert _text(browser, "#answer-mode") == "full"

        with httpx.Client(base_url=public, headers={"Authorization": f"Bearer {KEY}"}) as client:
            for _ in range(4):  # served by the backup; the flaky provider's breaker opens
                assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
            _until(browser, lambda d: _text(d, breaker) == "open")

            browser.find_element(By.ID, "mode-unavailable").click()
            assert browser.find_element(By.ID, "confirm").is_displayed()
            assert _text(browser, "#answer-mode") == "full", "nothing changes before the confirm"
            browser.find_element(By.ID, "confirm-yes").click()  # no reason given: refused
            assert "why" in _text(browser, "#confirm-problem").lower()
            browser.find_element(By.ID, "confirm-why").send_keys("console test: provider incident")
            browser.find_element(By.ID, "confirm-yes").click()
            _until(browser, lambda d: _text(d, "#answer-mode") == "unavailable")
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 503
            _until(browser, lambda d: "console test" in _text(d, "#audit tbody"))
            assert "oncall" in _text(browser, "#audit tbody")
            _until(browser, lambda d: _text(d, "#in-flight") == "0")

        shot = tmp_path / "console.png"
        assert browser.save_screenshot(str(shot))
        data = shot.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        assert len(data) > 10_000, "the screenshot is (nearly) empty"
        if os.environ.get("TIDEGATE_TEST_UPDATE_SCREENSHOT") == "1":
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, SCREENSHOT)
