"""Headless Chromium for the page tests (Debian's `chromium` and `chromium-driver`, driven by
selenium): the driver, the routing of circuit-tracer's viewer's CDN scripts to the same
libraries from their npm packages (the Chrome DevTools Protocol's Fetch domain, through
selenium's CDP connection), the console's errors, and the screenshots kept for a person to look
at (`test-artifacts/browser/`, or $MINIGPT_TEST_ARTIFACTS).

The viewer's libraries: $MINIGPT_VIEWER_LIBS (default ~/.cache/minigpt-viewer-libs) holds
`circuit-tracer/` (`pip install --no-deps --target ... circuit-tracer==0.5.0`: its frontend and
its standard-library server) and `npm/<name>/package/` (`npm pack` of d3 7.9.0, d3-jetpack
2.2.0, d3-collection 1.0.7 (a dependency of d3-jetpack that d3 7 no longer bundles), dagre
0.8.5, pako 2.1.0); .ci/run fills it. Tests that need what is missing skip, saying why."""

from __future__ import annotations

import base64
import os
import shutil
import threading
from pathlib import Path

import pytest

from minigpt.paths import PROJECT_ROOT

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser")) if p),
                None)
CHROMEDRIVER = shutil.which("chromedriver") or (
    "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run")
LIBS = Path(os.environ.get("MINIGPT_VIEWER_LIBS",
                           Path.home() / ".cache" / "minigpt-viewer-libs"))
ARTIFACTS = Path(os.environ.get("MINIGPT_TEST_ARTIFACTS",
                                PROJECT_ROOT / "test-artifacts")) / "browser"
NPM = LIBS / "npm"
CDN = "https://transformer-circuits.pub/2025/attribution-graphs/static_js/lib/"
# The viewer's index.html's scripts -> the files that stand in for them. The live-reload
# client of its authors' development server and the .npy reader are not needed by a graph
# the viewer reads as JSON: they get an empty script.
ROUTES = {
    CDN + "hotserver-client-ws.js": (),
    CDN + "d3.js": (NPM / "d3/package/dist/d3.min.js",),
    CDN + "jetpack_2024-07-20.js": (NPM / "d3-collection/package/dist/d3-collection.min.js",
                                    NPM / "d3-jetpack/package/build/d3-jetpack.cjs",
                                    Path(__file__).parent / "data" / "jetpack_conventions.js"),
    CDN + "npy_v0.js": (),
    "https://unpkg.com/dagre@0.8.5/dist/dagre.min.js": (NPM / "dagre/package/dist/dagre.min.js",),
    "https://unpkg.com/pako@2.1.0/dist/pako.min.js": (NPM / "pako/package/dist/pako.min.js",),
}


def viewer_libs() -> Path:
    """circuit-tracer's installed files (for PYTHONPATH), or skip saying what is missing."""
    ct = LIBS / "circuit-tracer"
    if not (ct / "circuit_tracer" / "frontend" / "assets" / "index.html").is_file():
        pytest.skip(f"circuit-tracer's viewer is not in {ct} (pip install --no-deps --target "
                    f"{ct} circuit-tracer==0.5.0; .ci/run does)")
    missing = [str(p) for files in ROUTES.values() for p in files if not p.is_file()]
    if missing:
        pytest.skip(f"the viewer's libraries are not in {NPM}: {missing[0]} (npm pack d3@7.9.0 "
                    "d3-jetpack@2.2.0 d3-collection@1.0.7 dagre@0.8.5 pako@2.1.0; .ci/run does)")
    return ct


def make_driver(profile: Path):
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium chromium-driver)")
    if CHROMEDRIVER is None:
        pytest.skip("chromedriver is not installed (apt-get install -y chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    d.set_page_load_timeout(60)
    d.set_window_size(1400, 1000)
    return d


def console_errors(driver) -> list[str]:
    """The console's errors and warnings since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] in ("SEVERE",
                                                                                "WARNING")]


def screenshot(driver, name: str) -> Path:
    """A PNG of the window, kept in ARTIFACTS for a person to look at."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    png = driver.get_screenshot_as_png()
    path.write_bytes(png)
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    return path


class Routed:
    """While open, every request of the page to the viewer's CDN hosts is answered from
    ROUTES (anything else there fails: nothing leaves the machine), and the local server's
    missing favicon with an empty icon; `seen` lists the URLs answered. The CDP connection
    runs in a thread of its own (trio), beside the test's WebDriver calls."""

    HOSTS = ("https://transformer-circuits.pub/*", "https://unpkg.com/*", "*/favicon.ico")

    def __init__(self, driver) -> None:
        self.driver, self.seen = driver, []
        self._ready, self._scope, self._token, self._error = threading.Event(), None, None, None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError(f"no CDP connection to Chromium: {self._error}")
        return self

    def __exit__(self, *exc) -> None:
        if self._scope is not None:
            self._token.run_sync_soon(self._scope.cancel)
        self._thread.join(20)

    def _run(self) -> None:
        import trio
        from selenium.common.exceptions import WebDriverException

        try:
            trio.run(self._serve)
        except (OSError, RuntimeError, WebDriverException) as e:  # said when __enter__ fails
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        import trio

        async with self.driver.bidi_connection() as conn:
            s, dt = conn.session, conn.devtools
            await s.execute(dt.fetch.enable(patterns=[dt.fetch.RequestPattern(url_pattern=h)
                                                      for h in self.HOSTS]))
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self._scope = scope
                self._ready.set()
                async for ev in s.listen(dt.fetch.RequestPaused):
                    await self._answer(s, dt, ev)

    async def _answer(self, s, dt, ev) -> None:
        url = ev.request.url
        self.seen.append(url)
        if url.endswith("/favicon.ico"):
            body, kind = b"", "image/x-icon"
        elif url in ROUTES:
            body, kind = b"\n".join(p.read_bytes() for p in ROUTES[url]), "text/javascript"
        else:
            await s.execute(dt.fetch.fail_request(ev.request_id,
                                                  dt.network.ErrorReason.BLOCKED_BY_CLIENT))
            return
        await s.execute(dt.fetch.fulfill_request(
            ev.request_id, 200, [dt.fetch.HeaderEntry("Content-Type", kind)],
            body=base64.b64encode(body).decode()))
