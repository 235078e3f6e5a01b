"""The grader's output boundary: everything it prints or writes for a person passes :func:`sanitise`.

Learner text reaches people by many roads: a file or folder name, a zip member's name, the
quoted line of a ``SyntaxError``, a refused notebook line, a skip reason listing a folder's
files, a message from the sandbox. Escaping each where it enters missed some (an escape
sequence set the instructor's terminal title; a name that was not UTF-8 lost a whole class
when skipped.txt was written). So the escaping happens once, where text leaves the grader:

* :func:`write_text` and :func:`write_json`: every file written for a person (results.json,
  skipped.txt, feedback and report pages, the gradebook's cells through :func:`sanitise`);
* :func:`guarded_streams`: the command line's stdout and stderr while it grades (the terminal,
  and Gradescope's stdout in ``run_autograder``).

:func:`sanitise` shows C0 and C1 control characters (but newline and tab), bidi embeddings,
overrides, isolates and marks, line and paragraph separators, and the byte-order mark as
``\\xNN`` / ``\\uNNNN`` text, and a byte that was not UTF-8 in a file name (Python's
surrogate escape, U+DC80-U+DCFF) as ``\\xNN``. It is idempotent: what it returns holds none of
what it escapes. The only exception: with ``colour=True`` the grader's own six SGR colour codes
pass (they change only the colour of text).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, TextIO

__all__ = ["sanitise", "sanitise_data", "write_atomically", "write_text", "write_json", "SanitisingStream",
           "guarded_streams", "UNSAFE"]

# what a terminal, a bidi renderer or an encoder acts on (U+DC80-U+DCFF: a file name's non-UTF-8 byte)
UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                    "\ufeff\ud800-\udfff]")
_COLOUR = re.compile("\x1b\\[(?:0|1|2|31|32|33)m")  # GradeReport.to_text(colour=True)'s codes, nothing else


def _escape(match: "re.Match[str]") -> str:
    ch = match.group()
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's surrogate escape of one byte
        return f"\\x{code - 0xDC00:02x}"
    if 0xD800 <= code <= 0xDFFF:
        return "\ufffd"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def sanitise(text: Any, *, colour: bool = False) -> str:
    """``text`` (or ``str(text)``; a path as :func:`os.fspath`) as it may be shown to a person:
    see the module's docstring for what is escaped. ``colour``: keep the grader's SGR colours."""
    if isinstance(text, os.PathLike):
        text = os.fspath(text)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not isinstance(text, str):
        text = str(text)
    if not colour:
        return UNSAFE.sub(_escape, text)
    pieces, at = [], 0
    for m in _COLOUR.finditer(text):
        pieces += [UNSAFE.sub(_escape, text[at:m.start()]), m.group()]
        at = m.end()
    pieces.append(UNSAFE.sub(_escape, text[at:]))
    return "".join(pieces)


def sanitise_data(data: Any) -> Any:
    """Every string in a JSON-like value (keys too) through :func:`sanitise`; other values as they are.
    (Escaping the JSON text instead would not do: a bidi override written as ``\\u202e`` in JSON
    is the override again for whoever parses it.)"""
    if isinstance(data, str):
        return sanitise(data)
    if isinstance(data, dict):
        return {sanitise(k) if isinstance(k, str) else k: sanitise_data(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [sanitise_data(v) for v in data]
    return data


def write_atomically(path: os.PathLike, text: str) -> None:
    """Write ``text`` as it is to a temporary file beside ``path``, then rename it over ``path``:
    a reader sees the old file or the new one, never half of one. For the grader's own files
    (a signed row); what a person reads goes through :func:`write_text` / :func:`write_json`.
    The temporary file is removed if the write fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # threads of a class
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path: os.PathLike, text: str) -> None:
    """:func:`write_atomically` of ``sanitise(text)``: a text or HTML file a person reads."""
    write_atomically(path, sanitise(text))


def write_json(path: os.PathLike, data: Any, indent: int = 2) -> None:
    """``data`` as JSON, every string sanitised (:func:`sanitise_data`), written atomically."""
    write_atomically(path, json.dumps(sanitise_data(data), indent=indent, ensure_ascii=False) + "\n")


class SanitisingStream(io.TextIOBase):
    """A text stream that writes everything through :func:`sanitise` (colours kept) to ``raw``.
    A carriage return that begins one ``write`` passes: it is how the grader redraws its own
    progress line; anywhere else it is escaped. What the stream's encoding cannot hold is
    written as a backslash escape, never an error."""

    def __init__(self, raw: TextIO) -> None:
        super().__init__()
        self.raw = raw

    def write(self, text: str) -> int:
        lead = "\r" if text.startswith("\r") else ""
        safe = lead + sanitise(text[len(lead):], colour=True)
        encoding = getattr(self.raw, "encoding", None) or "utf-8"
        self.raw.write(safe.encode(encoding, "backslashreplace").decode(encoding))
        return len(text)

    def flush(self) -> None:
        self.raw.flush()

    def isatty(self) -> bool:
        return self.raw.isatty()

    def fileno(self) -> int:
        return self.raw.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.raw, "encoding", None) or "utf-8"


@contextlib.contextmanager
def guarded_streams() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as :class:`SanitisingStream` inside the block."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = SanitisingStream(saved[0]), SanitisingStream(saved[1])
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        sys.stdout, sys.stderr = saved
