"""Who a learner's name stands for, to the eye: invisible code points gone, look-alikes folded.

Two entries of one class whose names look the same are one learner twice (``bob``, ``bob`` +
U+034F COMBINING GRAPHEME JOINER, ``bob`` + U+3164 HANGUL FILLER, ``bоb`` with a Cyrillic o):
both pass the name rule (a letter, a mark), so the rule cannot tell them apart; the identity
(:func:`identity`) does, and the class grades neither (fail closed, as for ``José`` in NFC and
NFD). The identity is UTS #39's *skeleton* of the name after NFKC, case folding and removing
:func:`invisible` code points: each character replaced by the prototype it is confusable with
(``confusables.tsv`` beside this file, Unicode's data), then NFD.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from pathlib import Path

__all__ = ["identity", "skeleton", "invisible", "visible_form"]

# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt), and the fillers that render as
# blank space though they are letters (U+3164, U+115F, U+1160, U+FFA0 are in the list already)
_DEFAULT_IGNORABLE = ((0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
                      (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164),
                      (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
                      (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF), (0x2800, 0x2800))
_SPACES = re.compile(r"\s+")


def invisible(ch: str) -> bool:
    """Whether ``ch`` shows nothing of its own: a default-ignorable code point, a blank filler, or a
    format, control, private-use, surrogate or unassigned one."""
    cp = ord(ch)
    if any(lo <= cp <= hi for lo, hi in _DEFAULT_IGNORABLE):
        return True
    return unicodedata.category(ch) in ("Cf", "Cc", "Co", "Cs", "Cn")


@lru_cache(maxsize=1)
def _prototypes() -> dict[str, str]:
    table: dict[str, str] = {}
    for line in (Path(__file__).with_name("confusables.tsv")).read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            source, target = line.split("\t")
            table[chr(int(source, 16))] = "".join(chr(int(h, 16)) for h in target.split())
    return table


def skeleton(text: str) -> str:
    """UTS #39's skeleton: NFD, invisible code points removed, each character mapped to its
    confusable prototype, NFD again."""
    table = _prototypes()
    decomposed = unicodedata.normalize("NFD", text)
    mapped = "".join(table.get(ch, ch) for ch in decomposed if not invisible(ch))
    return unicodedata.normalize("NFD", mapped)


def visible_form(name: str) -> str:
    """``name`` without its invisible code points, NFKC, spaces collapsed: what a reader sees."""
    kept = "".join(ch for ch in unicodedata.normalize("NFKC", name) if not invisible(ch))
    return _SPACES.sub(" ", kept).strip()


def identity(learner: str) -> str:
    """Who a name stands for: its :func:`visible_form`, case-folded, an LMS copy's `` (N)``
    dropped, then its :func:`skeleton` (case-folded again: ``0`` and ``O`` share a prototype).
    Two entries of one class with the same identity are one learner twice."""
    plain = re.sub(r"\s*\(\d{1,3}\)$", "", visible_form(learner).casefold()).strip()
    return skeleton(plain).casefold()
