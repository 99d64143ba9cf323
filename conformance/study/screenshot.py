"""Screenshots of a built study site, taken in headless Chromium (Playwright).

``screenshots(site_dir, out_dir)`` opens every ``.html`` page of a site built
by ``python -m conformance study`` from ``file://`` and saves one PNG per page
(the browser test keeps them as artifacts; the README's screenshot is one of
them). ``open_browser()`` is the launch both share.

No browser is downloaded: the executable is the system's Chromium, found as
``$STUDY_CHROMIUM``, else ``/usr/bin/chromium``, else ``chromium`` or
``chromium-browser`` on ``PATH``. When Playwright or the executable is missing,
:class:`BrowserUnavailable` says which (the test skips with that reason).

    python -m conformance.study.screenshot SITE_DIR OUT_DIR [--full-page]
"""
from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

__all__ = ["BrowserUnavailable", "LAUNCH_ARGS", "chromium_executable", "open_browser", "site_pages",
           "screenshots"]

# a sandbox needs privileges a container lacks; no GPU; nothing that reaches the network on its own
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]


class BrowserUnavailable(RuntimeError):
    """Playwright or a Chromium executable is missing; the message says which."""


def chromium_executable() -> str:
    """The Chromium to drive: ``$STUDY_CHROMIUM``, ``/usr/bin/chromium``, or one on ``PATH``."""
    env = os.environ.get("STUDY_CHROMIUM")
    if env:
        if Path(env).is_file() and os.access(env, os.X_OK):
            return env
        raise BrowserUnavailable(f"STUDY_CHROMIUM={env!r} is not an executable file")
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise BrowserUnavailable("no Chromium executable: set STUDY_CHROMIUM, or install the system package "
                             "(e.g. apt-get install chromium) so /usr/bin/chromium exists")


@contextmanager
def open_browser(executable: str | None = None):
    """A headless Chromium (a Playwright ``Browser``), closed on exit."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        raise BrowserUnavailable(f"playwright is not installed (pip install playwright): {exc}") from None
    executable = executable or chromium_executable()
    with sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=executable, headless=True, args=LAUNCH_ARGS)
        except Exception as exc:  # playwright.Error: the executable would not start
            raise BrowserUnavailable(f"Chromium at {executable} did not start: {exc}") from None
        try:
            yield browser
        finally:
            browser.close()


def site_pages(site_dir) -> list[Path]:
    """Every ``.html`` page under ``site_dir``, index.html first, then by path."""
    site_dir = Path(site_dir)
    pages = sorted(site_dir.rglob("*.html"), key=lambda p: (p.relative_to(site_dir) != Path("index.html"),
                                                           p.relative_to(site_dir).as_posix()))
    if not pages:
        raise FileNotFoundError(f"no .html page under {site_dir}")
    return pages


def _png_name(site_dir: Path, page: Path) -> str:
    return page.relative_to(site_dir).with_suffix("").as_posix().replace("/", "__") + ".png"


def screenshots(site_dir, out_dir, *, width: int = 1280, height: int = 800, full_page: bool = False,
                browser=None) -> list[Path]:
    """Open every page of ``site_dir`` from ``file://`` and save a PNG per page into
    ``out_dir`` (``index.png``, ``masks.png``, ...); returns their paths in page order.
    ``browser``: an open Playwright browser to reuse (else one is launched and closed)."""
    site_dir, out_dir = Path(site_dir).resolve(), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pages = site_pages(site_dir)
    if browser is None:
        with open_browser() as own:
            return screenshots(site_dir, out_dir, width=width, height=height, full_page=full_page, browser=own)
    saved = []
    context = browser.new_context(viewport={"width": width, "height": height})
    try:
        page = context.new_page()
        for html in pages:
            page.goto(html.as_uri(), wait_until="load")
            path = out_dir / _png_name(site_dir, html)
            page.screenshot(path=str(path), full_page=full_page)
            saved.append(path)
    finally:
        context.close()
    return saved


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m conformance.study.screenshot",
                                 description="PNG screenshots of every page of a built study site")
    ap.add_argument("site_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=800)
    ap.add_argument("--full-page", action="store_true", help="the whole page, not only the viewport")
    args = ap.parse_args(argv)
    try:
        paths = screenshots(args.site_dir, args.out_dir, width=args.width, height=args.height,
                            full_page=args.full_page)
    except BrowserUnavailable as exc:
        print(f"no browser: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
