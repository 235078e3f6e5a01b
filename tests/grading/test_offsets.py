"""Which (batch, head) each program of a learner's kernel reached (issue 62): the grader's
reading of the child's record (attnlab.grading.offsets) and the client's check of its shape.

The records here are built by hand, as the child's interpreter writes them
(grading/sandbox/interpreter.touched): a launch's grid and tensors, then per program (along grid
axis 1) and tensor argument the slices reached, each with the first and last element of it.
The real kernels that make them are the corpus's (tests/corpus/lab05.py: head_offset,
gqa_group_mapping, gqa_grad_sum mutants)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import mistakes
from attnlab.grading import offsets
from attnlab.grading.sandbox import client

L, S, E = 37, 45, 16


def _record(kernel: str, grid1: int, tensors: dict, touched: list) -> dict:
    """``tensors``: name -> shape; ``touched``: (pid, name, kind, [(slice, first, last), ...])."""
    return {"launches": [[kernel, [3, grid1, 1], [[n, *shape] for n, shape in tensors.items()]]],
            "touched": [[0, pid, name, kind, [list(x) for x in reached]] for pid, name, kind, reached in touched]}


def _rows(slice_: int, first_row: int, last_row: int, row: int = E) -> tuple:
    return slice_, first_row * row, last_row * row + row - 1


def _dq_launch(B: int, H: int, Hkv: int, lse_slice, k_slice) -> dict:
    """A dQ kernel's launch over (tiles, B * H): each program reads Q, LSE at the slice
    ``lse_slice(b, h)`` and K at ``k_slice(b, h)``, and stores dQ at its own."""
    tensors = {"Q": [B, H, L, E], "K": [B, Hkv, S, E], "LSE": [B, H, L], "DQ": [B, H, L, E]}
    touched = []
    for pid in range(B * H):
        b, h = divmod(pid, H)
        touched += [(pid, "Q", 0, [_rows(pid, 0, L - 1)]), (pid, "LSE", 0, [_rows(lse_slice(b, h), 0, L - 1, 1)]),
                    (pid, "K", 0, [_rows(k_slice(b, h), 0, S - 1)]), (pid, "DQ", 1, [_rows(pid, 0, L - 1)])]
    return _record("bwd_dq_kernel", B * H, tensors, touched)


def test_programs_that_stay_in_their_own_batch_and_head_give_nothing():
    right = _dq_launch(2, 4, 2, lambda b, h: b * 4 + h, lambda b, h: b * 2 + h // 2)
    assert offsets.findings(right) == []


def test_lse_read_without_its_head_offset_is_named_at_the_tensor_and_program():
    found = offsets.findings(_dq_launch(2, 2, 2, lambda b, h: 0, lambda b, h: b * 2 + h))
    assert [f["code"] for f in found] == ["head_offset"]
    message = found[0]["message"]
    assert "bwd_dq_kernel's program 1" in message and "read LSE of (batch 0, head 0)" in message
    assert "where it owns (batch 0, head 1)" in message and "LSE + (b * 2 + head) * 37" in message


def test_keys_of_another_batch_are_an_offset_and_of_another_head_in_the_batch_the_group_map():
    no_batch = offsets.findings(_dq_launch(2, 4, 2, lambda b, h: b * 4 + h, lambda b, h: h // 2))
    assert [(f["code"], "read K of (batch 0" in f["message"]) for f in no_batch] == [("head_offset", True)]
    modulo = offsets.findings(_dq_launch(2, 4, 2, lambda b, h: b * 4 + h, lambda b, h: b * 2 + h % 2))
    assert [f["code"] for f in modulo] == ["gqa_group_mapping"]
    assert "H // Hkv = 2" in modulo[0]["message"]


def _dkdv_launch(heads_of: list) -> dict:
    """A dK/dV kernel's launch over (tiles, B * Hkv) with B = 1, H = 4, Hkv = 2: program hk reads
    the query-side slices ``heads_of[hk]`` of Q and LSE."""
    tensors = {"Q": [1, 4, L, E], "LSE": [1, 4, L], "K": [1, 2, S, E], "DK": [1, 2, S, E]}
    touched = []
    for pid, heads in enumerate(heads_of):
        touched += [(pid, "Q", 0, [_rows(h, 0, L - 1) for h in heads]),
                    (pid, "LSE", 0, [_rows(h, 0, L - 1, 1) for h in heads]),
                    (pid, "K", 0, [_rows(pid, 0, S - 1)]), (pid, "DK", 1, [_rows(pid, 0, S - 1)])]
    return _record("bwd_dkdv_kernel", 2, tensors, touched)


def test_a_key_value_program_owns_its_groups_query_heads():
    assert offsets.findings(_dkdv_launch([[0, 1], [2, 3]])) == []
    strided = offsets.findings(_dkdv_launch([[0, 2], [1, 3]]))
    assert {f["code"] for f in strided} == {"gqa_group_mapping"}
    assert "its group's query heads are (batch 0, head 0) or (batch 0, head 1)" in strided[0]["message"]
    first_only = offsets.findings(_dkdv_launch([[0], [2]]))
    assert {f["code"] for f in first_only} == {"gqa_grad_sum"}


def test_an_offset_elsewhere_in_the_kernel_says_why_a_group_looks_short():
    """LSE read at head 0 by every dK/dV program: program 0 reads only head 0 of its group, and
    program 1 reads outside its group. The offset is the mistake; the short group follows from it."""
    found = offsets.findings(_dkdv_launch([[0], [0]]))
    assert [f["code"] for f in found] == ["head_offset", "head_offset"]


def test_a_last_tile_read_past_its_slice_end_is_a_mask_not_an_offset():
    """L = 37: the third tile of 16 rows reads rows 32..47, 11 of them the next head's first rows."""
    tensors = {"Q": [1, 2, L, E]}
    unmasked = _record("k", 2, tensors, [(0, "Q", 0, [_rows(0, 0, L - 1), _rows(1, 0, 10)])])
    found = offsets.findings(unmasked)  # named only where nothing else names a failed check (weak)
    assert [(f["code"], f.get("weak")) for f in found] == [("load_mask", True)] and "mask=" in found[0]["message"]
    # the same reach from an offset shifted by 8 rows (h * S for h * L): its own slice starts at row 8
    shifted = _record("k", 2, tensors, [(0, "Q", 0, [_rows(0, 8, L - 1), _rows(1, 0, 7)])])
    assert [f["code"] for f in offsets.findings(shifted)] == ["head_offset"]
    # and a whole tile into the next head is not a mask's overreach
    far = _record("k", 2, tensors, [(0, "Q", 0, [_rows(0, 0, L - 1), _rows(1, 0, 20)])])
    assert [f["code"] for f in offsets.findings(far)] == ["head_offset"]


def test_one_finding_per_kernel_tensor_and_kind_over_an_exercises_calls():
    broken = _dq_launch(2, 2, 2, lambda b, h: 0, lambda b, h: b * 2 + h)
    seen: set = set()
    assert len(offsets.findings(broken, seen)) == 1
    assert offsets.findings(broken, seen) == []


def test_a_launch_whose_grid_says_nothing_of_batch_and_heads_is_not_judged():
    record = _dq_launch(2, 2, 2, lambda b, h: 0, lambda b, h: b * 2 + h)
    record["launches"][0][1] = [4, 3, 1]  # axis 1 is not B * heads of any tensor
    assert offsets.findings(record) == []
    record["launches"][0][1] = []  # a grid that was not a tuple of ints
    assert offsets.findings(record) == []


_names = st.sampled_from(["Q", "K", "LSE", "D", "DQ", "x"])
_shape = st.lists(st.integers(0, 5), min_size=3, max_size=4)
_records = st.fixed_dictionaries({
    "launches": st.lists(st.tuples(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True), st.one_of(st.just([]), st.lists(st.integers(0, 9), min_size=3,
                                                                                         max_size=3)),
                                   st.lists(st.tuples(_names, _shape).map(lambda t: [t[0], *t[1]]), max_size=5)
                                   ).map(list), min_size=1, max_size=3),
    "touched": st.lists(st.tuples(st.integers(0, 2), st.integers(0, 12), _names, st.integers(0, 1),
                                  st.lists(st.lists(st.integers(0, 300), min_size=3, max_size=3), max_size=4)
                                  ).map(list), max_size=20),
})


@settings(max_examples=300, deadline=None)
@given(_records)
def test_any_record_the_client_accepts_is_read_without_raising(record):
    record["touched"] = [t for t in record["touched"] if t[0] < len(record["launches"])]
    client._check_slices(record)  # the client's own check passes these
    found = offsets.findings(record)
    assert len(found) <= offsets.MAX_FINDINGS
    assert all(f["code"] in mistakes.CODES and isinstance(f["message"], str) for f in found)


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-3, 2**32) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=30))
def test_the_client_refuses_every_malformed_record_with_its_own_error(value):
    try:
        client._check_slices(value)
    except client.BadMessage:
        return
    offsets.findings(value)  # what it let through is a record the grader reads


@pytest.mark.parametrize("bad", [
    {"launches": [], "touched": [[0, 0, "Q", 0, []]]},  # a touch of a launch that is not there
    {"launches": [["k", [1, 2], []]], "touched": []},  # a grid of two numbers
    {"launches": [["k", [1, 2, 1], [["Q", 1, 2]]]], "touched": []},  # a shape of two dims
    {"launches": [["k", [1, 2, 1], []]], "touched": [[0, 0, "Q", 2, []]]},  # a kind that is neither
    {"launches": [["k", [1, 2, 1], []]], "touched": [[0, 0, "Q", True, []]]},
    {"launches": [["k", [1, 2, 1], []]], "touched": [[0, 0, "Q", 0, [[1, 2]]]]},  # a slice without its extent
    {"launches": [["k", [1, 2, 1], []]], "touched": [[0, -1, "Q", 0, []]]},
    {"launches": [["k", [1, 2, 1], []]], "touched": [], "extra": 1},
])
def test_the_client_refuses(bad):
    with pytest.raises(client.BadMessage):
        client._check_slices(bad)


def test_a_group_wider_than_the_child_records_is_not_judged():
    """Issue 62's attacker launched a kernel over one program with a (1, 2**22, 1) tensor: a group of
    4M query heads per program, a 4M-element set per record and a message of 100 MB. No such group
    is judged (the child keeps at most 16 slices per record)."""
    wide = _record("k", 1, {"X": [1, 1 << 22, 1]}, [(0, "X", 0, [(0, 0, 0)])])
    assert offsets.findings(wide) == []
    assert offsets._owned(0, 1, 1 << 22) is None and offsets._owned(0, 1, 16) == set(range(16))


@pytest.mark.parametrize("name", ["x\nPASS ex1 14/14", "", "a b", "9lives", "k" * 101])
def test_the_client_refuses_a_name_that_is_not_an_identifier(name):
    """A forged record's names reached the report, where a line break faked 'PASS' and 'Score' lines."""
    record = {"launches": [[name, [1, 2, 1], []]], "touched": []}
    with pytest.raises(client.BadMessage):
        client._check_slices(record)
    record = {"launches": [["k", [1, 2, 1], [[name[:40], 1, 2, 3]]]], "touched": []}
    if len(name) <= 40:
        with pytest.raises(client.BadMessage):
            client._check_slices(record)


def test_a_pointer_that_steps_bk_elements_stops_short_of_the_rows_every_program_reaches():
    # the dQ programs read K only up to row 17 of 45 (BK = 16 elements a tile where 16 rows belong)
    short = _dq_launch(2, 4, 2, lambda b, h: b * 4 + h, lambda b, h: b * 2 + h // 2)
    for t in short["touched"]:
        if t[2] == "K":
            t[4] = [[t[4][0][0], 0, 17 * E + 3]]
    found = offsets.findings(short)
    assert [(f["code"], f.get("weak")) for f in found] == [("stale_tile", True)]
    assert "read K of (batch 0, head 0) only up to row 17 of its 45" in found[0]["message"]
    # ending at a tile's last row (row 31: a tile dropped, the diagonal skipped) is the values' to name
    for t in short["touched"]:
        if t[2] == "K":
            t[4] = [[t[4][0][0], 0, 31 * E + E - 1]]
    assert offsets.findings(short) == []
    # reaching row min(L, S) - 1 = 36 (a causal dQ program with L < S stops there) is no finding
    for t in short["touched"]:
        if t[2] == "K":
            t[4] = [[t[4][0][0], 0, (L - 1) * E]]
    assert offsets.findings(short) == []


def test_a_slice_past_the_tensors_end_is_an_offset_or_a_tile_past_the_last_head():
    far = _dq_launch(1, 2, 2, lambda b, h: h, lambda b, h: h)
    far["touched"] = [t for t in far["touched"] if t[2] != "LSE"]
    far["touched"].append([0, 1, "LSE", 1, [[16, 0, 15]]])  # D + bh * L * E: 16 slices on, past the end
    found = offsets.findings(far)
    assert [f["code"] for f in found] == ["head_offset"]
    assert "wrote LSE of the rows 15 (batch, head) slices past its end" in found[0]["message"]
    tile = _dq_launch(1, 2, 2, lambda b, h: h, lambda b, h: h)
    for t in tile["touched"]:
        if t[1:4] == [1, "DQ", 1]:
            t[4].append([2, 0, 10 * E])  # the last tile's rows past the last head, unmasked
    assert [(f["code"], f.get("weak")) for f in offsets.findings(tile)] == [("store_mask", True)]
