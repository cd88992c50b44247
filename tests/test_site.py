"""The rendered site, checked as a reader sees it.

The site is built by `make docs` (warnings are errors, every notebook executed),
served from a local HTTP server, and every page is loaded in headless Chromium: no console
error, every image loaded, the math typeset, and no request to any host but the local server.
Without Chromium the browser checks are skipped on a reader's machine and fail on CI (CI=true).
"""

import functools
import http.server
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUILD = DOCS / "_build"
HTML = BUILD / "html"
SCREENSHOTS = BUILD / "screenshots"
CHAPTERS = [p.stem for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))]
# `make docs` itself, with this interpreter's environment and without its set-up step, so the
# test builds exactly what a reader's `make` builds, and a fresh `make` build is reused.
MAKE_DOCS = ["make", "-s", "-o", "setup", "docs", f"BIN={pathlib.Path(sys.executable).parent}"]
BUILD_TIMEOUT = 20 * 60  # seconds; nine chapters of under a minute each, plus the landing page
PAGE_TIMEOUT = 30_000  # milliseconds, for each page load and each wait inside a page
PAGES = ["index", "api", "genindex", "py-modindex", "search"] + [f"chapters/{c}" for c in CHAPTERS]
# Debian's package; CHROMIUM=/path/to/chrome points the test at another Chromium-based browser.
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The chapter whose screenshot is kept (the README shows it): 7, exactness, if it exists.
SCREENSHOT_CHAPTER = next((c for c in CHAPTERS if c.startswith("07_")), (CHAPTERS or [None])[0])


@pytest.fixture(scope="session")
def site():
    """Build the site, incrementally: a changed chapter re-executes, a new flash_lib every page."""
    run = subprocess.run(MAKE_DOCS, cwd=ROOT, capture_output=True, text=True,
                         timeout=BUILD_TIMEOUT)
    if run.returncode != 0:
        log = re.sub(r"\x1b\[[0-9;]*m", "", run.stderr)  # IPython's colours
        log = "\n".join(ln for ln in log.splitlines() if "[IPKernelApp] WARNING" not in ln)
        # A failing cell: the cell and its error. Then Sphinx's warnings, and the end of the log.
        cell = log.find("An error occurred while executing the following cell")
        end = log.find("The above exception was the direct cause", cell)
        detail = log[cell:end if end > cell else cell + 4000] + "...\n" if cell >= 0 else ""
        warnings = "\n".join(ln for ln in log.splitlines() if re.search(r": (WARNING|ERROR):", ln))
        pytest.fail(f"make docs failed (exit {run.returncode}):\n{detail}{warnings}\n...\n"
                    f"{log[-2000:]}")
    return HTML


def test_site_builds_with_warnings_as_errors(site):
    """The build passes with -W -n and makes a page for every chapter (each one checked below)."""
    built = {p.relative_to(site).with_suffix("").as_posix() for p in site.rglob("*.html")}
    assert set(PAGES) <= built, f"pages not built: {sorted(set(PAGES) - built)}"


def test_site_refers_to_nothing_remote(site):
    """No page loads a script, stylesheet, font, image or frame from elsewhere (links are fine)."""
    remote = re.compile(
        r"<(?:script|link|img|iframe|source|embed)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.I)
    offenders = {}
    for page in site.rglob("*.html"):
        for match in remote.finditer(page.read_text()):
            offenders.setdefault(page.relative_to(site).as_posix(), []).append(match.group(0))
    assert not offenders, offenders
    mathjax = site / "_static" / "mathjax" / "tex-chtml.js"
    assert mathjax.is_file(), "MathJax is not served with the site"


# ------------------------------------------------------------------------------------------------
# In the browser
# ------------------------------------------------------------------------------------------------


def _no_chromium(reason):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}: CI must run the browser checks (.ci/run installs chromium)")
    pytest.skip(f"{reason}: the in-browser checks of the site are skipped "
                "(install Chromium, e.g. `apt-get install chromium`, to run them)")


@pytest.fixture(scope="session")
def server(site):
    """The built site on http://127.0.0.1:<free port>/, as `make serve` would serve it."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


@pytest.fixture(scope="session")
def browser(server):
    if not os.access(CHROMIUM, os.X_OK):
        _no_chromium(f"no Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _no_chromium("Playwright for Python is not installed")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        yield chromium
        chromium.close()


# Text outside code and typeset math that still looks like TeX: math the build failed to mark up.
RAW_MATH_JS = r"""() => {
  // Search results quote the pages' source text, TeX included, on purpose.
  const skip = 'PRE, CODE, SCRIPT, STYLE, TEXTAREA, MJX-CONTAINER, #search-results';
  const walker = document.createTreeWalker(document.querySelector('main') || document.body,
                                           NodeFilter.SHOW_TEXT);
  const found = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (n.parentElement.closest(skip)) continue;
    const t = n.textContent;
    const raw = t.includes('$$') || /\\\(|\\\[|\$[^$\n]*\\[A-Za-z]+[^$\n]*\$/.test(t);
    if (raw) found.push(t.trim().slice(0, 120));
  }
  return found;
}"""


def _visit(browser, base, page_name, query=""):
    """Load one page from `base` (the local server, or file:///.../html/ as a reader opens it).

    Returns the live page and its context, what a reader would notice as broken, and the number
    of formulas on the page.
    """
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    problems, requests = [], []
    local = (base, "data:", "blob:")

    def route(r):
        return r.continue_() if r.request.url.startswith(local) else r.abort()

    context.route("**/*", route)
    context.on("request", lambda req: requests.append(req.url))
    page = context.new_page()
    page.set_default_timeout(PAGE_TIMEOUT)
    page.on("console", lambda msg: msg.type == "error" and problems.append(f"console: {msg.text}"))
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    response = page.goto(base + page_name + ".html" + query, wait_until="load")
    if base.startswith("http"):
        assert response and response.ok, f"{page_name}: HTTP {response and response.status}"

    # Images: lazy ones would wait for a scroll, so ask for all of them now.
    page.evaluate("document.querySelectorAll('img').forEach(i => { i.loading = 'eager'; })")
    page.wait_for_function("Array.from(document.images).every(i => i.complete)")
    broken = page.evaluate("Array.from(document.images).filter(i => !(i.naturalWidth > 0))"
                           ".map(i => i.getAttribute('src'))")
    problems += [f"image not loaded: {src}" for src in broken]

    # Math: Sphinx marks every formula with class "math"; each must hold MathJax's output.
    n_math = page.locator(".math").count()
    if n_math:
        page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.promise")
        page.evaluate("MathJax.startup.promise")
        untypeset = page.evaluate(
            "Array.from(document.querySelectorAll('.math'))"
            ".filter(e => !e.querySelector('mjx-container')).map(e => e.textContent.slice(0, 80))")
        problems += [f"math not typeset: {t}" for t in untypeset]
        tex_errors = page.evaluate(
            "Array.from(document.querySelectorAll('mjx-merror'))"
            ".map(e => e.getAttribute('data-mjx-error') || e.textContent)")
        problems += [f"TeX error: {t}" for t in tex_errors]
    problems += [f"raw TeX left in the text: {t!r}" for t in page.evaluate(RAW_MATH_JS)]
    problems += [f"request for anything but the site's own files: {u}" for u in requests
                 if not u.startswith(local)]
    return page, context, problems, n_math


def _chapter_furniture(page, chapter):
    """What the site adds around a chapter: neighbours, the .ipynb download, how to run it."""
    problems = []
    if page.locator(".prev-next-area a.left-prev").count() != 1:
        problems.append("no link to the previous page")
    if page.locator(".prev-next-area a.right-next").count() != 1:
        problems.append("no link to the next page")
    box = page.locator(".run-this-chapter")
    if box.count() != 1 or "make lab" not in box.inner_text():
        return problems + ["no 'Run this chapter' box saying `make lab`"]
    href = box.locator("a.download").get_attribute("href") or ""
    if not href.endswith(f"/{chapter}.ipynb"):
        return problems + [f"no download link to {chapter}.ipynb: {href!r}"]
    with urllib.request.urlopen(urllib.parse.urljoin(page.url, href), timeout=30) as r:
        downloaded = json.load(r)
    committed = json.loads((ROOT / "notebooks" / f"{chapter}.ipynb").read_text())
    if downloaded != committed:
        problems.append(f"the download is not the committed notebooks/{chapter}.ipynb")
    return problems


@pytest.mark.parametrize("page_name", PAGES)
def test_page_reads_well_in_chromium(browser, server, page_name):
    """No console error, images loaded, math typeset, nothing remote; chapters' links work."""
    page, context, problems, n_math = _visit(browser, server, page_name)
    try:
        if page_name == "index" or page_name.startswith("chapters/"):
            assert n_math > 0, f"{page_name}: no math found on a page that has formulas"
        if page_name.startswith("chapters/"):
            problems += _chapter_furniture(page, page_name.split("/", 1)[1])
        if page_name == "index":
            assert page.locator("img").count() >= 1, "the landing page's headline plots are missing"
        shots = {"index": "index.png", f"chapters/{SCREENSHOT_CHAPTER}": "chapter.png"}
        shot = shots.get(page_name)
        if shot:
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=SCREENSHOTS / shot)
    finally:
        context.close()
    assert not problems, f"{page_name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page_name", ["index", f"chapters/{SCREENSHOT_CHAPTER}"])
def test_page_reads_well_opened_as_a_file(browser, site, page_name):
    """`make` prints the path of index.html: opened from disk, with no server, it must work too.

    The landing page and one chapter stand for the rest: every chapter has the same structure
    (one folder down, the same assets).
    """
    page, context, problems, _ = _visit(browser, site.as_uri() + "/", page_name)
    context.close()
    assert not problems, f"{page_name} (file://):\n" + "\n".join(problems)


def test_search_finds_a_chapter(browser, server):
    """The search box works offline: the index is a local script, not a service."""
    page, context, problems, _ = _visit(browser, server, "search", query="?q=softmax")
    try:
        results = page.locator("#search-results li")
        results.first.wait_for()
        assert results.count() >= 1
    finally:
        context.close()
    assert not problems, "\n".join(problems)
