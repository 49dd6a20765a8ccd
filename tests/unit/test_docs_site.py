"""The documentation site: every internal link and anchor of the README and of every page resolves, every page is in
the site's navigation, and the site builds strictly (mkdocs: broken links, anchors and pages outside the navigation
fail the build)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _slug(heading: str) -> str:
    """The anchor MkDocs' toc extension gives a heading (its default slugify)."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return slugify(text, "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m.group(2).strip()) for m in re.finditer(r"^(#{1,6})\s+(.*)$", text, re.M)}


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", [ROOT / "README.md", *_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_internal_links_and_anchors_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def _nav_files(nav) -> list[str]:
    files = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        files += _nav_files(value) if isinstance(value, list) else [value]
    return files


def test_every_page_is_in_the_navigation():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = set(_nav_files(nav))
    pages = {str(p.relative_to(DOCS)) for p in _pages()}
    assert pages - listed == set(), f"pages missing from mkdocs.yml nav: {sorted(pages - listed)}"
    assert listed - pages == set(), f"nav entries without a page: {sorted(listed - pages)}"


@pytest.mark.skipif(find_spec("mkdocs") is None or find_spec("mkdocstrings") is None,
                    reason="mkdocs / mkdocstrings not installed (pip install -e '.[dev]')")
def test_site_builds_strictly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-6000:]
    assert "WARNING" not in out.stderr, out.stderr[-6000:]
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()

