"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright, against a
real server with two real jobs. The page loads with the token and not without it, shows both
jobs by name with rates above zero, shows it when one leaves and when the server stops. A
screenshot is kept (its path is printed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.integration, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip("no Chromium here: install Debian's `chromium` package (.ci/run does) to test the dashboard page")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the `test` extra")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


def rate_of(page, name: str) -> float:
    cells = page.locator(f'#jobs tbody tr[data-job="{name}"]:not(.left) td')
    return float(cells.nth(5).inner_text().replace(",", "")) if cells.count() else 0.0


def test_the_page_shows_two_live_jobs_and_one_leaving(server, dashboard, browser, tmp_path: Path):
    jobs = {
        name: server.job(
            tmp_path / f"{name}.out", "--start", "20", "--epochs", "1000", "--sleep", sleep, "--name", name
        )
        for name, sleep in (("alpha", "0.02"), ("beta", "0.05"))
    }
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))

        refused = page.goto(dashboard.base + "/")
        assert refused.status == 403 and "token" in page.content()

        loaded = page.goto(dashboard.url)
        assert loaded.status == 200 and page.url == dashboard.base + "/", "the token leaves the address bar"
        page.wait_for_function(
            "() => ['alpha', 'beta'].every((name) => {"
            "  const row = document.querySelector(`#jobs tbody tr[data-job='${name}']:not(.left)`);"
            "  return row && parseFloat(row.children[5].textContent) > 0; })",
            timeout=60_000,
        )
        assert rate_of(page, "alpha") > 0 and rate_of(page, "beta") > 0
        assert page.locator("#chart-samples canvas").count() == 1
        assert "server pid" in page.locator("#connection").inner_text()
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"dashboard screenshot: {shot}")

        jobs["beta"].terminate()
        jobs["beta"].wait()
        page.wait_for_selector('#jobs tbody tr.left[data-job="beta"]', timeout=30_000)
        assert page.locator('#jobs tbody tr[data-job="beta"]:not(.left)').count() == 0
        page.wait_for_function(
            "() => [...document.querySelectorAll('#events li')].some((li) => li.textContent.includes(\"'beta'\") "
            "&& li.textContent.includes('left'))",
            timeout=10_000,
        )
        assert rate_of(page, "alpha") > 0, "the other job goes on"
        page.screenshot(path=str(tmp_path / "dashboard-after.png"), full_page=True)
        assert shot.stat().st_size > 10_000

        server.stop()  # the page says so and keeps the last state; it does not break
        page.wait_for_selector("#connection.down", timeout=30_000)
        assert "stopped answering" in page.locator("#connection").inner_text()
        assert page.locator('#jobs tbody tr[data-job="alpha"]').count() == 1
        assert errors == [], errors
    finally:
        for job in jobs.values():
            job.kill()
            job.wait()
