"""The built documentation site, looked at in a real browser: headless Chromium against a loopback HTTP server.

    build_site(out)              `mkdocs build --strict` into `out` (a failed build raises, with mkdocs' output)
    serve(site)                  a loopback server for the site that records every request's path and status
    render(url, ...)             Chromium's DOM of a page after loading, or a screenshot of it
    local_assets(dom)            the same-site stylesheets, scripts and images a page asks for

`python tests/docs/site_browser.py SITE --screenshot PNG` writes the home page's screenshot (`make docs-screenshot`).
Chromium is Debian's `chromium` package, run without a driver (--dump-dom, --screenshot); nothing leaves the
machine: the site is served on 127.0.0.1 and Chromium's background networking is off.
"""

import argparse
import contextlib
import functools
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,900",
)
ASSET = re.compile(r"<(?:link|script|img)\b[^>]*?\b(?:href|src)=\"(?P<url>[^\"]+)\"", re.IGNORECASE)


def chromium() -> str | None:
    """The Chromium executable, or None when it is not installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def build_site(out: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(out.parent)},
        timeout=300,
    )
    if result.returncode != 0:
        raise RuntimeError(f"mkdocs build --strict failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


@contextlib.contextmanager
def serve(site: Path) -> Iterator[tuple[str, list[tuple[str, int]]]]:
    """(base URL, the (path, status) of every request so far) while the loopback server runs."""
    requests: list[tuple[str, int]] = []

    class Handler(SimpleHTTPRequestHandler):
        def log_request(self, code="-", size="-"):
            requests.append((self.path, int(code) if str(code).isdigit() else 0))

        def log_message(self, format, *args):  # quiet: the requests list is the log
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


def render(url: str, *, screenshot: Path | None = None, timeout: float = 120) -> str:
    """The page's DOM after loading (`--dump-dom`), or, with `screenshot`, a PNG of it written there."""
    executable = chromium()
    if executable is None:
        raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        action = [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
        result = subprocess.run(
            [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *action, url],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if result.returncode != 0:
        raise RuntimeError(f"chromium exited {result.returncode} on {url}:\n{result.stderr[-3000:]}")
    return result.stdout


def local_assets(dom: str) -> list[str]:
    """The URLs of the stylesheets, scripts and images a page loads from its own site (not links to other pages)."""
    urls = []
    for match in ASSET.finditer(dom):
        url = match["url"]
        tag = match[0].lower()
        if url.startswith(("http:", "https:", "data:", "//", "#")) and "127.0.0.1" not in url:
            continue
        if tag.startswith("<link") and not re.search(r"rel=\"(stylesheet|icon|shortcut icon)\"", tag):
            continue
        urls.append(url)
    return urls


def main() -> None:
    parser = argparse.ArgumentParser(description="Screenshot the built site's home page with headless Chromium.")
    parser.add_argument("site", type=Path, help="the built site (make docs writes site/)")
    parser.add_argument("--screenshot", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args()
    args.screenshot.parent.mkdir(parents=True, exist_ok=True)
    with serve(args.site.resolve()) as (base, _):
        render(f"{base}/index.html", screenshot=args.screenshot.resolve())
    print(f"wrote {args.screenshot}")


if __name__ == "__main__":
    main()
