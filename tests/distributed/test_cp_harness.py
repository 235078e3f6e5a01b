"""attnlab.distributed.testing.run_ranks: results by rank, and a failing rank fails the test (never a
skip), with the rank named and, for a hang, the collective it waits in."""

from __future__ import annotations

import time

import pytest

from attnlab.distributed.testing import RanksFailed, run_ranks
from helpers.cp_workers import dies, hangs, raises, sums

pytestmark = [pytest.mark.subprocess]


def test_each_rank_returns_its_value():
    assert run_ranks(sums, 3, timeout=60) == [6.0, 6.0, 6.0]


def test_a_rank_that_dies_fails_the_run_and_is_named():
    with pytest.raises(RanksFailed) as info:
        run_ranks(dies, 2, timeout=60)
    text = str(info.value)
    assert text.startswith("run_ranks(dies, world=2): rank 1 exited with code 3 without a result"), text
    # its peer, left in the barrier, is named too: gloo's error (the connection closed) or the wait
    assert "rank 0 raised" in text or "rank 0 did not finish in 60 s: it was in" in text, text


def test_a_hang_is_killed_and_named_with_its_collective():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(hangs, 2, timeout=8)
    text = str(info.value)
    assert "rank 0 did not finish in 8 s: it was in distributed_c10d.all_reduce" in text or \
        "rank 0 did not finish in 8 s: it was in distributed.all_reduce" in text, text
    assert "rank 1 did not finish in 8 s: it was in no collective call" in text, text
    assert time.monotonic() - start < 60  # killed, not waited out


def test_a_rank_that_raises_fails_with_its_traceback():
    with pytest.raises(RanksFailed, match="rank 1 raised:(.|\n)*ValueError: a shard of the wrong length"):
        run_ranks(raises, 2, timeout=60)
