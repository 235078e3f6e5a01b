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


@pytest.mark.subprocess
def test_the_docs_build_with_warnings_as_errors(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    run = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("flash_attention", "flex_attention", "decode_attention", "ring_attention", "grade", "diagnose"):
        assert name in api, name  # the reference was built from the docstrings, not left empty


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
