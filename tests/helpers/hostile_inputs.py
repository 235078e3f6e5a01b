"""Hypothesis strategies for hostile learner input: names, zip archives, notebooks, class trees.

What the format and the file system allow, not only the cases anyone thought of: zip members
with every flag, method, CRC, nesting and name (and bytes of their headers flipped), notebooks
of every JSON shape, folders nested deep, names in NFC and NFD, in other cases, with an LMS copy's
``(N)``, with control and bidi characters and bytes that are not UTF-8, FIFOs and links.
Used by tests/grading/test_fuzz_intake.py.
"""

from __future__ import annotations

import io
import json
import os
import stat
import unicodedata
import warnings
import zipfile
from pathlib import Path

from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
LAB01 = (ROOT / "labs/track1/01-attention/solutions/attention.py").read_bytes()
LAB01_STUB = (ROOT / "labs/track1/01-attention/attention.py").read_bytes()
LAB05 = (ROOT / "labs/track1/05-triton-flash/flash_triton.py").read_bytes()
LAB_FILES = ("attention.py", "masks.py", "multihead.py", "flash.py", "flash_triton.py")

HOSTILE_TEXT = ["\x1b]0;owned\x07", "\x1b[2J", "\r", "\u202e", "\u2066", "\x9b", "\x00", "\udcff", "\udce9",
                "\ufeff", "\u2028"]

# the pieces names are made of: plain, accented (NFC and NFD), hostile, an LMS copy's suffix
_PIECES = st.sampled_from(["alice", "Alice", "ALICE", "bob", "José", unicodedata.normalize("NFD", "José"), "李",
                           "o'neil", " (1)", " (2)", "-2", "_3", ".", "..", " ", "x" * 120, *HOSTILE_TEXT])


def _valid_name(name: str) -> bool:
    """A name this file system can hold: no '/', no NUL, at most 255 bytes, not '.' or '..'."""
    if not name or name in (".", "..") or "/" in name or "\x00" in name:
        return False
    return len(os.fsencode(name)) <= 255


names = st.lists(_PIECES, min_size=1, max_size=4).map("".join).filter(_valid_name)


def file_names(suffixes=(".py", ".ipynb", ".zip", ".txt", "")) -> st.SearchStrategy[str]:
    """A file's name: a lab's file in some spelling, another lab's, or a hostile name."""
    lab_file = st.sampled_from(LAB_FILES).flatmap(lambda f: st.sampled_from(
        [f, f.upper(), f.capitalize(), f.replace(".py", " (1).py"), f.replace(".py", "-2.py"),
         f.replace(".py", ".ipynb")]))
    other = st.tuples(names, st.sampled_from(suffixes)).map("".join).filter(_valid_name)
    return st.one_of(lab_file, other)


# ------------------------------------------------------------------------------ bodies
def python_bodies() -> st.SearchStrategy[bytes]:
    hostile_line = st.sampled_from(HOSTILE_TEXT).map(lambda t: f"x = 1 +\n# {t}\ndef f(:\n  {t}\n".encode(
        "utf-8", "surrogateescape"))
    return st.one_of(st.sampled_from([LAB01, LAB01_STUB, LAB05, b"", b"\xff\xfe\x00garbage", b"(" * 300]),
                     hostile_line, st.binary(max_size=200))


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children,
                                                                              max_size=4)),
    max_leaves=20)


@st.composite
def notebooks(draw) -> bytes:
    """A notebook's bytes: any JSON, a notebook of odd cells, one nested past any parser's depth,
    or bytes that are not JSON at all."""
    kind = draw(st.sampled_from(["json", "cells", "deep", "bytes"]))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "deep":
        n = draw(st.integers(100, 3000))
        return ("[" * n + "]" * n).encode() if draw(st.booleans()) else ('{"cells":' + "[" * n + "]" * n + "}").encode()
    if kind == "bytes":
        return draw(st.binary(max_size=100))
    source = st.one_of(
        st.sampled_from(["%time x = 1", "!ls /", "get_ipython().system('id')", "import os\nos.environ['X'] = '1'",
                         "def f(:", LAB01.decode(), "x = 1\nprint(x)"]),
        st.sampled_from(HOSTILE_TEXT).map(lambda t: f"%magic {t}\ndef g():\n    return '{t}'"),
        st.text(max_size=40))
    cell = st.one_of(
        st.fixed_dictionaries({"cell_type": st.sampled_from(["code", "markdown", "raw", 3]),
                               "source": st.one_of(source, st.lists(st.one_of(source, st.integers()), max_size=3),
                                                   st.integers(), st.none())}),
        json_values)
    return json.dumps({"cells": draw(st.lists(cell, max_size=5)), "nbformat": 4}).encode("utf-8", "surrogatepass")


@st.composite
def zip_archives(draw, depth: int = 0) -> bytes:
    """A zip archive: members of any name, body, method and flag, a zip inside it, and then
    perhaps bytes of its headers flipped (encrypted flag, method, CRC, a local name)."""
    buf = io.BytesIO()
    members = draw(st.lists(st.tuples(
        st.one_of(file_names(), st.sampled_from(["../up.py", "/abs.py", "C:evil.py", "a/b/c/d/attention.py",
                                                 "__MACOSX/attention.py", ".attention.py", "dir/", "link.py"])),
        st.one_of(python_bodies(), notebooks(),
                  st.just(b"nested") if depth >= 2 else st.deferred(lambda: zip_archives(depth + 1))),
        st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA]),
        st.booleans(), st.booleans()), max_size=4))
    with zipfile.ZipFile(buf, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name": a duplicate is what a hostile zip may hold
        for name, body, method, utf8, link in members:
            info = zipfile.ZipInfo(name.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
            info.compress_type = method
            if link:
                info.external_attr = (stat.S_IFLNK | 0o777) << 16
            if not utf8:
                info.flag_bits &= ~0x800
            z.writestr(info, body)
    data = bytearray(buf.getvalue())
    for flip in draw(st.lists(st.sampled_from(["encrypt", "method", "crc", "name", "size", "byte"]), max_size=2)):
        _flip(data, flip, draw(st.integers(0, 2**16)))
    return bytes(data)


def _flip(data: bytearray, what: str, n: int) -> None:
    """Break one field of the first member's local header (and the central directory's where it has one)."""
    local, central = data.find(b"PK\x03\x04"), data.find(b"PK\x01\x02")
    if local < 0:
        return
    if what == "encrypt":
        data[local + 6] |= 1
        if central >= 0:
            data[central + 8] |= 1
    elif what == "method":
        data[local + 8] = n & 0xFF
        if central >= 0:
            data[central + 10] = n & 0xFF
    elif what == "crc":
        data[local + 14] ^= 0xFF
    elif what == "name" and len(data) > local + 30:
        data[local + 30] ^= 0x20
    elif what == "size":
        data[local + 22] ^= 0x7F
    elif what == "byte":
        data[n % len(data)] ^= 0xFF


def strings_in(data) -> list[str]:
    """Every string in a JSON-like value, keys too: what a results.json shows a person."""
    if isinstance(data, str):
        return [data]
    if isinstance(data, dict):
        return [s for k, v in data.items() for s in strings_in(k) + strings_in(v)]
    if isinstance(data, list):
        return [s for v in data for s in strings_in(v)]
    return []


def bodies() -> st.SearchStrategy[bytes]:
    return st.one_of(python_bodies(), notebooks(), zip_archives())


# ------------------------------------------------------------------------------ trees
@st.composite
def entries(draw, depth: int = 0):
    """One entry of a class folder: ``(name, kind, payload)`` with kind file, folder, deep
    (a chain of folders), link or fifo."""
    kind = draw(st.sampled_from(["file", "file", "folder", "deep", "link", "fifo"] if depth < 2 else ["file", "link"]))
    if kind == "file":
        return draw(file_names()), "file", draw(bodies())
    if kind == "folder":
        return draw(names), "folder", draw(st.lists(entries(depth + 1), max_size=3))
    if kind == "deep":
        return draw(names), "deep", (draw(st.integers(1, 14)), draw(bodies()))
    if kind == "link":
        return draw(file_names()), "link", draw(st.sampled_from(["/etc/passwd", "..", "../other", "nowhere"]))
    return draw(file_names()), "fifo", None


class_trees = st.lists(entries(), max_size=6)


def make_tree(folder: Path, tree) -> list[str]:
    """Lay ``tree`` out under ``folder``; returns the names of its top-level entries as made
    (a name the file system already holds, in any case, is left out)."""
    made = []
    for name, kind, payload in tree:
        path = folder / name
        if os.path.lexists(path):
            continue
        if kind == "file":
            path.write_bytes(payload)
        elif kind == "folder":
            path.mkdir()
            make_tree(path, payload)
        elif kind == "deep":
            levels, body = payload
            path.mkdir()
            inner = path
            for _ in range(levels):
                inner = inner / "d"
                inner.mkdir()
            (inner / "attention.py").write_bytes(body)
        elif kind == "link":
            os.symlink(payload, path)
        else:
            os.mkfifo(path)
        made.append(name)
    return made
