"""Inputs nobody can rebuild: each exercise's generator, its whole state derived from a key.

An exercise draws its inputs from a ``torch.Generator`` (:attr:`.exercise.Exercise.prepare`).
Seeded through ``manual_seed``, torch's CPU generator (MT19937) keeps 32 bits of the seed, so a
62-bit class seed gave at most 2**32 input sets, fewer still where seeds were spaced (issue 61:
``seed * 1000 + i`` left 29 bits, and seeds 7 and 7 + 2**29 drew the same inputs). Here the
generator's whole state, 624 words of 32 bits, is SHAKE-256 of:

* ``key``: the run's secret (in a class: an HMAC of the class key, the class seed and the
  learner's name, :func:`attnlab.grading.classroom.batch.learner_key`; for one file, SHA-256 of
  its seed's decimal digits, every bit of it);
* the exercise's id;
* the SHA-256 of the submission's bytes: a regrade of other bytes draws other inputs, so a table
  of answers precomputed for one set of inputs is graded on another.

Nothing here is shown to a learner: the run id is what they see.
"""

from __future__ import annotations

import hashlib
import struct

import torch

__all__ = ["seed_key", "inputs_generator", "MT_WORDS"]

MT_WORDS = 624  # MT19937's state: 624 words of 32 bits
# torch's CPU generator state (CPUGeneratorImplState, aten/src/ATen/CPUGeneratorImpl.cpp): the initial
# seed (u64), left (i32), seeded (i32), next (u64), then the 624 state words, one u64 each
_LEFT, _SEEDED, _NEXT, _WORDS = 8, 12, 16, 24


def seed_key(seed: int) -> bytes:
    """The key of a run given a seed (``attnlab grade FILE --seed N``): every bit of the seed counts."""
    return hashlib.sha256(b"attnlab-seed:" + str(int(seed)).encode()).digest()


def _layout_checked() -> None:
    """The state layout above, checked against this torch: a seeded generator's first word is its seed."""
    state = bytes(torch.Generator().manual_seed(0x1234_5678).get_state().numpy())
    left, seeded, nxt, first = struct.unpack_from("<iiQQ", state, _LEFT)
    if (left, seeded, nxt, first) != (1, 1, 0, 0x1234_5678) or len(state) < _WORDS + 8 * MT_WORDS:
        raise RuntimeError("this torch's CPU generator state is not laid out as attnlab.grading.inputs expects: "
                           "the grader cannot derive its inputs (report it, with torch's version)")


def inputs_generator(key: bytes, exercise: str, digest: str) -> torch.Generator:
    """A CPU generator whose whole MT19937 state is SHAKE-256 of ``key``, ``exercise`` (its id) and
    ``digest`` (the submission's SHA-256, hex), each length-prefixed so no two triples collide."""
    _layout_checked()
    material = b"attnlab-inputs"
    for part in (key, exercise.encode("utf-8", "surrogateescape"), digest.encode("ascii", "replace")):
        material += struct.pack("<Q", len(part)) + part
    words = hashlib.shake_256(material).digest(4 * MT_WORDS)
    g = torch.Generator()
    state = bytearray(g.get_state().numpy().tobytes())
    struct.pack_into("<iiQ", state, _LEFT, 1, 1, 0)  # left = 1: the next draw twists the whole state first
    for i in range(MT_WORDS):
        struct.pack_into("<Q", state, _WORDS + 8 * i, int.from_bytes(words[4 * i:4 * i + 4], "little"))
    g.set_state(torch.frombuffer(state, dtype=torch.uint8))
    return g
