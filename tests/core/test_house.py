"""The house rules the layout promises (issue 31), checked on the source so they stay true:
no module in src/attnlab is over 800 lines, and nothing below the CLI imports it (the only
way in from outside cli/ is ``python -m attnlab``, whose ``__main__`` runs the CLI)."""

from __future__ import annotations

import ast
from pathlib import Path

import attnlab

ROOT = Path(attnlab.__file__).parent
MAX_LINES = 800


def test_no_module_is_over_800_lines():
    """Python and C++ alike (issue 49: decode.cpp was 1,193 lines; now its tile sources and its dot
    products are headers of their own)."""
    files = [*ROOT.rglob("*.py"), *ROOT.rglob("*.cpp"), *ROOT.rglob("*.h"), *ROOT.rglob("*.c")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these along their concepts: {long}"
    assert any(p.suffix == ".cpp" for p in files)  # the C++ was looked at


def test_nothing_outside_the_cli_imports_it():
    upward = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "cli" or rel == Path("__main__.py"):
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            names = ([n.module or ""] + [f"{n.module}.{a.name}" for a in n.names] if isinstance(n, ast.ImportFrom)
                     else [a.name for a in n.names] if isinstance(n, ast.Import) else [])
            if any(m == "attnlab.cli" or m.startswith("attnlab.cli.") for m in names):
                upward.append(f"{rel}:{n.lineno}")
    assert not upward, upward
