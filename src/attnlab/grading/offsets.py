"""Which (batch, head) each program of a learner's kernel reached, against the one it owns (lab 05).

The child records, for every load and store of a learner kernel under Triton's interpreter, the
(batch, head) slice of each tensor argument it reached (:func:`.sandbox.interpreter.touched`).
This module decides, in the grader, which slices each program owns and names what went
elsewhere: a pointer offset with another tensor's sizes, without the batch, at the wrong head
(``head_offset``), a key/value head that is not ``h // (H // Hkv)`` (``gqa_group_mapping``), a
dK/dV program that reads only some of its group's query heads (``gqa_grad_sum``).

What a program owns comes from the launch alone, never from names: lab 05's launchers put
batch x head on grid axis 1, so a launch whose axis 1 is ``B * Hx`` gives program ``p`` the
(batch, head) ``divmod(p, Hx)`` of every tensor argument with ``Hx`` heads. A tensor argument with
``Hy`` heads is the other side: with ``Hy < Hx`` (K and V from a query program) the program owns
head ``h // (Hx // Hy)``; with ``Hy > Hx`` (Q, dO, lse and D from a dK/dV program) the
``Hy // Hx`` query heads of its group. A launch whose grid says nothing of the kind is not judged.

Evidence for a name, never a grade: the points are the values'.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["findings"]

MAX_FINDINGS = 3  # named per call: the first per (kernel, argument, load or store)
MAX_GROUP = 16  # query heads per key/value head judged: the child keeps at most 16 slices per record
TILE_ROWS = 16  # the rows of a tile that may run past its slice's end: lab 05's BLOCK, tl.dot's smallest tile


def _owned(pid: int, hx: int, hy: int) -> Optional[set[int]]:
    """The slices of a tensor with ``hy`` heads that program ``pid`` of a launch over ``B * hx``
    owns, or None when neither head count divides the other."""
    b, h = divmod(pid, hx)
    if hy == hx:
        return {pid}
    if hx % hy == 0:
        return {b * hy + h // (hx // hy)}
    if hy % hx == 0 and hy // hx <= MAX_GROUP:
        r = hy // hx
        return {b * hy + h * r + i for i in range(r)}
    return None  # no head map, or a group wider than the child records (a shaped launch: issue 62's attacker)


def _where(s: int, shape: list) -> str:
    """(batch b, head h) of slice ``s`` of a tensor of ``shape`` (B, H, ...), or how far past its end."""
    if s >= shape[0] * shape[1]:
        return f"the rows {s - shape[0] * shape[1] + 1} (batch, head) slices past its end"
    b, h = divmod(s, shape[1])
    return f"(batch {b}, head {h})"


def _message(kernel: str, pid: int, hx: int, name: str, kind: int, shape: list, got: list, want: set,
             code: str, last: int = 0) -> str:
    verb = "wrote" if kind else "read"
    heads = shape[1]
    them = ", ".join(_where(s, shape) for s in got[:3]) + (" ..." if len(got) > 3 else "")
    owned = " or ".join(_where(s, shape) for s in sorted(want))
    head = f"{kernel}'s program {pid} along grid axis 1 (batch {pid // hx}, head {pid % hx} of {hx})"
    sizes = " * ".join(str(n) for n in shape[2:])
    if code == "gqa_group_mapping" and heads > hx:  # a key/value program reading the query side
        return (f"{head} {verb} {name} of {them}, where its group's query heads are {owned}: key/value head g serves "
                f"query heads g * (H // Hkv) .. (g + 1) * (H // Hkv) - 1 (here H // Hkv = {heads // hx}), in its own "
                "batch")
    if code == "gqa_group_mapping":
        return (f"{head} {verb} {name} of {them}, where its key/value head is {owned}: query head h reads key/value "
                f"head h // (H // Hkv) (here H // Hkv = {hx // heads}), in its own batch")
    if code == "stale_tile":
        row = 1
        for n in shape[3:]:
            row *= n
        return (f"{head} {verb} {name} of {owned} only up to row {last // row} of its {shape[2]}, short of the "
                f"rows every tile loop reaches (its shape is {list(shape)}): a pointer steps BK rows per tile, "
                f"BK * (its row's size) elements (ptr += BK * stride), or the offsets come from the loop's index; stepped by BK "
                f"elements it reads the first rows again, shifted")
    if code in ("load_mask", "store_mask"):
        return (f"{head} {verb} {name} past the last row of its own (batch, head), into the next one's first rows: "
                f"{'store' if kind else 'load'} with mask= (rows < L, keys < S){'' if kind else ' and other=0.0'}, "
                "or the last, partial tile reads another head's values (past the last head, memory that is not the "
                "tensor's)")
    if code == "gqa_grad_sum":
        return (f"{head} {verb} {name} of {them} only: a key/value head's dK and dV sum over every query head of its "
                f"group ({owned}), each at its own offset")
    return (f"{head} {verb} {name} of {them}, where it owns {owned}: each tensor's pointer starts at its own "
            f"(batch, head), {name} + (b * {heads} + head) * {sizes} elements with that tensor's own sizes (its "
            f"shape is {list(shape)}); an offset with another tensor's sizes, without the batch, or at another "
            f"head reads or writes another head's rows. The given launcher's grid is (tiles, B * heads): "
            f"tl.program_id(1) is the batch x head, tl.program_id(0) the tile")


def _overreach(extra: list, owned: set, reached: dict, shape: list) -> bool:
    """Whether what a program reached outside its slices is a tile read past its slice's end:
    only the first :data:`TILE_ROWS` rows of the slice right after one it owns, from a tile that
    starts where tiles start (a row that is a multiple of :data:`TILE_ROWS` in the slice it owns).
    That is a missing mask (load_mask or store_mask, named by the values or the bounds check);
    an offset shifted by d rows starts its own slice at row d instead."""
    row = 1
    for n in shape[3:]:
        row *= n
    for s in extra:
        if s - 1 not in owned or reached[s][1] >= TILE_ROWS * row or s - 1 not in reached:
            return False
        if (reached[s - 1][0] // row) % TILE_ROWS:
            return False
    return True


def _short(reached: dict, owned: set, shape: list, tensors: list) -> bool:
    """Whether the program never reached the rows every program of its kind reaches: the first
    min(L, S) rows of each slice it owns (the rows of the launch's shortest (B, H, N, ...) tensor).
    A loop over tiles reaches them whatever the mask (under is_causal the last query tile sees the
    keys up to min(L, S) - 1, and every key tile sees the queries up to L - 1); a pointer stepped by
    BK elements where BK rows belong stops short, between two tiles' rows."""
    lengths = [t[3] for t in tensors if len(t) == 5 and t[3] > 0]
    if not lengths:
        return False
    row = 1
    for n in shape[3:]:
        row *= n
    need = (min(lengths) - 1) * row  # the first element of the last row every program reaches
    # a loop whose bound is off (a tile dropped, the diagonal skipped) ends at a tile's last row, a multiple of
    # TILE_ROWS rows: that is the values' to name; a pointer stepped by elements ends between tiles
    return any(reached[s][1] < need and (reached[s][1] // row + 1) % TILE_ROWS for s in owned if s in reached)


def findings(slices: Any, seen: Optional[set] = None) -> list[dict]:
    """The named mistakes (``{"code", "message"}``) of one call's slices record (a result's
    ``"slices"``, already validated by the client), at most :data:`MAX_FINDINGS`; [] when every
    program stayed in what it owns, or the record says nothing judgeable. A last tile that ran past
    its slice's end unmasked is ``load_mask`` or ``store_mask`` with ``"weak": True``: it names a
    failed check that nothing else named, and replaces no other name. ``seen``: the (kernel,
    argument, load or store) already named by an earlier call of the same exercise, and added to."""
    if not isinstance(slices, dict):
        return []
    launches, named = slices.get("launches", []), {}  # (kernel, name, kind) -> (rank, finding): an offset first
    seen = set() if seen is None else seen
    for launch, pid, name, kind, touched in slices.get("touched", []):
        kernel, grid, tensors = launches[launch]
        shapes = {t[0]: t[1:] for t in tensors}
        batches = {s[0] for s in shapes.values()}
        shape = shapes.get(name)
        if shape is None or len(grid) != 3 or len(batches) != 1 or (kernel, name, kind) in seen:
            continue
        B = batches.pop()
        if B < 1 or grid[1] % B or grid[1] < B or shape[1] < 1:
            continue
        hx, hy = grid[1] // B, shape[1]
        want = _owned(pid, hx, hy)
        if want is None:
            continue
        reached = {s: (lo, hi) for s, lo, hi in touched}
        got = sorted(reached)
        extra = sorted(set(got) - want)
        code = ""
        if extra and _overreach(extra, want, reached, shape):  # a mask's business: named only where nothing is
            code = "store_mask" if kind else "load_mask"
        elif extra:
            # whole other heads of its own batch, as many as it owns: the group's map; an offset with the wrong
            # sizes reaches into two slices (L rows from h * S span heads h and h + 1), or another batch
            regrouped = len(got) == len(want) and all(s // hy == pid // hx for s in extra)
            code = "gqa_group_mapping" if hx != hy and regrouped else "head_offset"
        elif not extra and hy > hx and not kind and set(got) < want:  # a dK/dV program over part of its group
            code = "gqa_grad_sum"  # unless another program of the kernel read outside its group: that says why
        elif not extra and _short(reached, want, shape, tensors):  # its pointer stepped less than a tile of rows
            code = "stale_tile"
        rank = {"gqa_grad_sum": 1, "load_mask": 2, "store_mask": 2, "stale_tile": 2}.get(code, 0)
        if code and rank < named.get((kernel, name, kind), (3, None))[0]:
            named[(kernel, name, kind)] = (rank, {"code": code, "message": _message(
                kernel, pid, hx, name, kind, shape, extra or got, want, code,
                min((reached[s][1] for s in want if s in reached), default=0))})
    out = [dict(finding, weak=True) if rank == 2 else finding for rank, finding in sorted(
        named.values(), key=lambda pair: pair[0] == 2)]  # the offsets first, the masks' overreach after
    seen.update(named)
    return out[:MAX_FINDINGS]
