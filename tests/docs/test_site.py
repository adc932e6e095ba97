"""The documentation site: `mkdocs build --strict` passes offline, and a real browser renders what it built.

The build is shared by the tests of this file (one xdist group, one module fixture). The browser check serves the
site on 127.0.0.1 and loads the home page and one API page in headless Chromium: each has its title, the navigation
and its content, every stylesheet, script and image it names exists in the site, and no request the browser made
was answered with an error.
"""

import re
from pathlib import Path

import pytest
from site_browser import build_site, chromium, local_assets, render, serve

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("docs_site")]

PAGES = {
    "index.html": ("coreformer", "one attention core"),
    "api/attention/index.html": ("Attention", "eager_attention_forward"),
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    build_site(out)
    return out


def test_site_builds_strict_with_every_page_and_the_api_reference(site):
    for page in PAGES:
        assert (site / page).is_file(), page
    api = (site / "api" / "attention" / "index.html").read_text()
    assert 'id="coreformer.attention.Attention"' in api  # mkdocstrings rendered the class from its docstring
    performance = (site / "performance" / "index.html").read_text()
    assert "Generated from" in performance and (site / "results" / "compare.json").is_file()


def test_site_has_no_remote_assets(site):
    """Built and viewed offline: no page loads a stylesheet, script, font or image from another host."""
    loads = re.compile(r"<(?:link|script|img)\b[^>]*?\b(?:href|src)=\"(https?://[^\"]+)\"", re.IGNORECASE)
    remote = {url for page in site.rglob("*.html") for url in loads.findall(page.read_text())}
    assert remote == set(), f"the built pages load assets from the network: {sorted(remote)[:5]}"


@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (.ci/run installs it with apt-get)")
@pytest.mark.parametrize("page", PAGES)
def test_browser_renders_page_with_navigation_and_every_asset(site, page):
    title, content = PAGES[page]
    with serve(site) as (base, requests):
        dom = render(f"{base}/{page}")
    assert re.search(rf"<title>[^<]*{re.escape(title)}[^<]*</title>", dom), dom[:500]
    assert 'class="md-nav' in dom and 'class="md-header' in dom  # navigation and header rendered
    assert content in dom
    assets = local_assets(dom)
    assert any(url.endswith(".css") for url in assets) and any(url.endswith(".js") for url in assets)
    page_dir = (site / page).parent
    missing = [url for url in assets if not (page_dir / url.split("?")[0].split("#")[0]).resolve().is_file()]
    assert missing == [], f"{page} names assets the site lacks: {missing}"
    failed = [(path, status) for path, status in requests if status >= 400]
    assert failed == [], f"the browser's requests that failed: {failed}"
    assert any(path.endswith(".css") for path, _ in requests)  # the browser did fetch the stylesheets


@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (.ci/run installs it with apt-get)")
def test_browser_screenshot_of_home_page_is_not_blank(site, tmp_path):
    from PIL import Image

    png = tmp_path / "home.png"
    with serve(site) as (base, _):
        render(f"{base}/index.html", screenshot=png)
    image = Image.open(png).convert("RGB")
    assert image.size == (1280, 900)
    colours = image.getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50  # text, the header bar and tables: far from one flat colour
