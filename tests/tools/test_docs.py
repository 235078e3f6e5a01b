"""The documentation a newcomer navigates (issue 32 item 7): the README opens with the two make
commands and a table of contents with a path per person; the guides and the API reference
build with MkDocs with warnings as errors (what 'make docs' runs); the named-mistakes page is
the vocabulary itself; every command's --help fits in 40 lines; the package says it is typed
and names its URLs."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from attnlab import mistakes
from attnlab.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_starts_with_make_and_a_path_per_person():
    text = (REPO / "README.md").read_text()
    head = text.split("\n## ")[0]
    assert "make demo" in head and "make test" in head and "**Contents**" in head
    for section in ("### Learners", "### Instructors", "### Engineers", "## Install", "## Documentation"):
        assert section in text, section
    assert len(text.splitlines()) < 250  # the long reference lives in docs/
    for link in ("docs/learners.md", "docs/instructors.md", "docs/engineers.md", "docs/api.md", "docs/mistakes.md",
                 "docs/cli.md", "CHANGELOG.md"):
        assert f"({link})" in text and (REPO / link).is_file(), link


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as 'make docs' builds it (strict: a warning fails the build)."""
    out = tmp_path_factory.mktemp("docs") / "site"
    mkdocs = Path(sys.executable).with_name("mkdocs")
    run = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


@pytest.mark.subprocess
def test_the_docs_build_with_warnings_as_errors(site):
    api = (site / "api.html").read_text()
    for name in ("flash_attention", "flex_attention", "decode_attention", "ring_attention", "grade", "diagnose"):
        assert name in api, name  # the reference was built from the docstrings, not left empty


@pytest.mark.subprocess
def test_no_sphinx_role_is_left_and_cross_references_are_links(site):
    """mkdocstrings prints the docstrings' Sphinx roles as text (':func:' and the name): 68 were on
    the API page. tools/mkdocs_hooks.py makes each a link to the object's heading, or plain code
    where the site does not document it."""
    import re

    role = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):<code>")
    left = {p.name: len(role.findall(p.read_text())) for p in site.glob("*.html")}
    assert not any(left.values()), left
    api = (site / "api.html").read_text()
    links = re.findall(r'<a class="autorefs autorefs-internal" href="([^"]*)"', api)
    assert len(links) >= 30, len(links)
    assert "#attnlab.flex.BlockMask" in links  # :class:`attnlab.flex.BlockMask`
    ids = set(re.findall(r'id="([^"]+)"', api))
    for href in links:  # every link lands on a heading that exists
        page, _, anchor = href.partition("#")
        target = api if page in ("", "api.html") else (site / page).read_text()
        assert anchor in (ids if target is api else set(re.findall(r'id="([^"]+)"', target))), href


def test_the_role_resolver_picks_the_nearest_of_several_objects_and_refuses_a_tie():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "tools" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    anchors = {"attnlab.tiled.flash_attention": "api.html", "attnlab.triton.flash_attention": "api.html",
               "attnlab.triton.why_unavailable": "api.html"}
    assert hooks.resolve("flash_attention", "attnlab.triton.why_unavailable", anchors) == "attnlab.triton.flash_attention"
    assert hooks.resolve("~attnlab.tiled.flash_attention", "", anchors) == "attnlab.tiled.flash_attention"
    assert hooks.resolve("flash_attention", "attnlab.dispatch.attention", anchors) is None  # a tie: no guess
    assert hooks.resolve("._private", "attnlab.tiled.flash_attention", anchors) is None
    html = ':func:<code>~attnlab.tiled.flash_attention</code> and :mod:<code>.nowhere</code>'
    out = hooks.rewrite(html, "api.html", anchors)
    assert out == ('<a class="autorefs autorefs-internal" href="#attnlab.tiled.flash_attention"><code>flash_attention'
                   '</code></a> and <code>nowhere</code>'), out


def _dom(url: str, width: int = 1200) -> str:
    import tempfile

    from helpers.ci import chromium

    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-background-networking", "--allow-file-access-from-files", f"--window-size={width},900"]
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([chromium(), *flags, f"--user-data-dir={profile}", "--dump-dom", url],
                              capture_output=True, text=True, timeout=120).stdout


@pytest.mark.browser
@pytest.mark.subprocess
def test_the_site_opened_from_disk_follows_every_navigation_link_in_chromium(site):
    """Opened as files (no server), every link of the navigation is a page of the site: with
    MkDocs' directory URLs each one showed a directory listing. One sidebar entry per object."""
    import re
    from collections import Counter

    home = _dom((site / "index.html").as_uri())
    hrefs = list(dict.fromkeys(re.findall(r'<a href="([^"#:]+)" class="nav-link', home)))
    assert len(hrefs) >= 9, hrefs
    for href in hrefs:
        page = (site / href).resolve()
        assert page.is_file() and page.suffix == ".html", href
        dom = _dom(page.as_uri())
        assert "<h1" in dom and "Index of" not in dom and "attnlab" in dom, (href, dom[:300])
    toc = re.findall(r'class="nav-link">([^<]+)</a>', (site / "api.html").read_text())
    assert [label for label, n in Counter(toc).items() if n > 1] == [], toc


@pytest.mark.browser
@pytest.mark.subprocess
def test_wide_tables_scroll_inside_a_phone_wide_page(site, tmp_path):
    """At 390 px the page itself does not scroll sideways: wide tables (the named mistakes, the
    instructors' threat model) scroll inside their own box (docs/assets/extra.css)."""
    import shutil

    for name in ("mistakes.html", "instructors.html"):
        copy = tmp_path / "site"
        if not copy.exists():
            shutil.copytree(site, copy)
        page = copy / name
        probe = ("<script>window.addEventListener('load', () => { document.body.setAttribute('data-overflow', "
                 "String(document.documentElement.scrollWidth - window.innerWidth)); });</script></body>")
        page.write_text(page.read_text().replace("</body>", probe, 1))
        dom = _dom(page.as_uri(), width=390)
        import re

        found = re.search(r'data-overflow="(-?\d+)"', dom)
        assert found is not None, dom[-500:]
        assert int(found.group(1)) <= 1, (name, found.group(1))


@pytest.mark.subprocess
def test_a_docstring_that_names_a_missing_parameter_breaks_the_build(tmp_path):
    """The strict build is not vacuous: griffe's warning about a documented parameter the
    signature lacks stops it."""
    pkg = tmp_path / "src" / "toy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('def f(a):\n    """Do.\n\n    Args:\n        b: not a parameter.\n    """\n')
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# toy\n\n::: toy.f\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: toy\nplugins:\n  - mkdocstrings:\n      handlers:\n"
                                         "        python:\n          paths: [src]\n")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    run = subprocess.run([str(mkdocs), "build", "--strict"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "does not appear in the function signature" in run.stderr


def test_the_mistakes_page_is_the_vocabulary():
    assert (REPO / "docs" / "mistakes.md").read_text() == mistakes.as_markdown(), \
        "regenerate it: python -m attnlab.mistakes > docs/mistakes.md"


def _commands():
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")  # noqa: SLF001
    return action.choices


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_help_fits_in_40_lines(name, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = _commands()[name].format_help()
    assert len(text.rstrip("\n").splitlines()) < 40, text
    assert "examples:" in text or "example" in text


def test_the_package_is_typed_and_names_its_urls():
    assert (REPO / "src" / "attnlab" / "py.typed").is_file()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["attnlab"]
    assert {"Homepage", "Documentation", "Changelog", "Issues"} <= set(project["project"]["urls"])
    assert (REPO / "docs" / "changelog.md").resolve() == (REPO / "CHANGELOG.md").resolve()
