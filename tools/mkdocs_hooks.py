"""MkDocs hooks for attnlab's site (``hooks:`` in mkdocs.yml), run by ``make docs``.

The docstrings cross-reference each other with Sphinx roles (``:func:`attention```), which
mkdocstrings prints as text (":func:" and the name in code). After the build each such role becomes
a link to the object's heading where the site documents it, or plain code where it does not
(a private helper, a module the reference leaves out): no role text is left in any page
(``tests/tools/test_docs.py`` holds the built site to that).
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const):<code>([^<]*)</code>")
HEADING_ID = re.compile(r'\bid="(attnlab(?:\.[A-Za-z_][A-Za-z0-9_]*)+)"')


def _anchors(site: Path) -> dict[str, str]:
    """Every documented object's id -> the page (relative to the site) whose heading it is."""
    found: dict[str, str] = {}
    for page in sorted(site.rglob("*.html")):
        for ident in HEADING_ID.findall(page.read_text(encoding="utf-8")):
            found.setdefault(ident, page.relative_to(site).as_posix())
    return found


def _shared(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def resolve(target: str, context: str, anchors: dict[str, str]) -> str | None:
    """The id a role's target names, seen from the object ``context`` whose docstring holds it:
    the exact id, or the one id ending in ``.target`` that shares the most of ``context``'s path."""
    name = target.lstrip("~").lstrip(".").split("(")[0].strip()
    if not name:
        return None
    if name in anchors:
        return name
    matches = [i for i in anchors if i.endswith("." + name)]
    if not matches:
        return None
    best = max(_shared(m, context) for m in matches)
    top = [m for m in matches if _shared(m, context) == best]
    return top[0] if len(top) == 1 else None


def rewrite(text: str, page: str, anchors: dict[str, str]) -> str:
    """``text`` (one page's HTML, at ``page`` relative to the site) with every role replaced."""
    contexts = [(m.start(), m.group(1)) for m in HEADING_ID.finditer(text)]

    def context_at(pos: int) -> str:
        before = [ident for start, ident in contexts if start < pos]
        return before[-1] if before else ""

    def replace(m: re.Match) -> str:
        raw = html.unescape(m.group(1))
        shown = raw.lstrip("~").lstrip(".")
        if raw.startswith("~"):
            shown = shown.rsplit(".", 1)[-1]
        code = f"<code>{html.escape(shown)}</code>"
        ident = resolve(raw, context_at(m.start()), anchors)
        if ident is None:
            return code
        href = os.path.relpath(anchors[ident], os.path.dirname(page) or ".")
        href = "" if anchors[ident] == page else href
        return f'<a class="autorefs autorefs-internal" href="{html.escape(href)}#{html.escape(ident)}">{code}</a>'

    return ROLE.sub(replace, text)


def on_post_build(config, **kwargs) -> None:
    site = Path(config["site_dir"])
    anchors = _anchors(site)
    for page in site.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        new = rewrite(text, page.relative_to(site).as_posix(), anchors)
        if new != text:
            page.write_text(new, encoding="utf-8")
