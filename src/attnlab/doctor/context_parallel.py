"""The context-parallel doctor: run a user's sharded attention on W gloo ranks and name what is wrong.

A context-parallel attention takes the ring's signature (:func:`attnlab.distributed.ring_attention`)::

    fn(query, key, value, *, group, is_causal=False, layout="contiguous", sinks=None,
       enable_gqa=False) -> this rank's (B, H, L/W, Ev) output

with each rank holding its rows of a ``(B, H, L, E)`` sequence (:func:`attnlab.distributed.shard_sequence`).
:func:`diagnose_context_parallel` runs it forward and backward on probes (causal in both layouts, sinks,
GQA, no mask) in :func:`attnlab.distributed.testing.run_ranks`, gathers every rank's shards, and compares
them with one process in float64. Where they differ, *bug models* of the faults context parallelism
adds, each the whole computation with one thing done wrong, say which one reproduces every probe:
sinks dropped or counted once per rank, partial results merged in base 2, a shard's causal mask on its
local positions, zigzag shards taken in rank order, a key/value shard left out, heads gathered to the
wrong slots, a key/value gradient not reduced over the ranks (codes ``cp_*`` of :mod:`attnlab.mistakes`).

Legend: B batch, H query heads, Hkv key/value heads, L the whole sequence, n = L / W rows a rank, E.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from attnlab.doctor.analysis import DoctorReport, Finding

__all__ = ["diagnose_context_parallel", "ContextParallelReport", "CP_PROBES"]


class ContextParallelReport(DoctorReport):
    """A :class:`DoctorReport` whose reference is one process in float64, not SDPA."""

    def __str__(self) -> str:
        return super().__str__().replace("matches SDPA on all", "matches one process (float64) on all")

# (name, is_causal, layout, sinks, H, Hkv) per probe; H and Hkv as multiples of W (Ulysses scatters heads)
CP_PROBES = (("causal", True, "contiguous", False, 2, 2), ("causal zigzag", True, "zigzag", False, 2, 2),
             ("sinks", True, "contiguous", True, 2, 2), ("GQA", False, "contiguous", False, 2, 1))
_E, _ROWS = 8, 4  # the head size and the rows a rank holds per zigzag chunk (n = 2 * _ROWS)


def _inputs(probe: tuple, world: int, seed: int) -> dict:
    """The probe's full float64 inputs, the same on every rank (a seeded generator)."""
    _, causal, layout, sinks, h, hkv = probe
    H, Hkv, L = h * world, hkv * world, 2 * _ROWS * world
    g = torch.Generator().manual_seed(seed)
    t = {"q": torch.randn(1, H, L, _E, generator=g, dtype=torch.float64),
         "k": torch.randn(1, Hkv, L, _E, generator=g, dtype=torch.float64),
         "v": torch.randn(1, Hkv, L, _E, generator=g, dtype=torch.float64),
         "do": torch.randn(1, H, L, _E, generator=g, dtype=torch.float64)}
    t["sinks"] = torch.randn(H, generator=g, dtype=torch.float64) * 2 if sinks else None
    return t


def _takes(fn: Callable) -> set:
    """The keyword arguments ``fn`` takes (all of them where it has ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {"layout", "sinks", "enable_gqa", "group", "is_causal"}
    return set(params)


def _load(target: Union[str, Callable]) -> Callable:
    if isinstance(target, str):
        from attnlab.doctor import load_function

        return load_function(target)
    return target


def _rank(rank: int, world: int, target: Union[str, Callable], probes: tuple, seed: int) -> list:
    """One rank: every probe forward and backward through the user's function; its shards of the output
    and of dQ, dK, dV, and its share of the sinks' gradient, per probe (or the error it raised)."""
    import torch.distributed as dist

    from attnlab.distributed import shard_sequence

    fn = _load(target)
    takes = _takes(fn)
    out = []
    for i, probe in enumerate(probes):
        _, causal, layout, sinks, h, hkv = probe
        t = _inputs(probe, world, seed + i)
        shards = [shard_sequence(t[n], rank, world, layout).requires_grad_() for n in ("q", "k", "v")]
        kw = {"group": dist.group.WORLD, "is_causal": causal}
        if "layout" in takes:
            kw["layout"] = layout
        if h != hkv:
            kw["enable_gqa"] = True
        s_leaf = t["sinks"].clone().requires_grad_() if sinks else None
        if sinks:
            kw["sinks"] = s_leaf
        try:
            o = fn(*shards, **kw)
            o.backward(shard_sequence(t["do"], rank, world, layout))
        except Exception as exc:  # noqa: BLE001 (a user's function: any failure is a probe's answer)
            out.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        out.append((o.detach(), *(s.grad for s in shards), s_leaf.grad if s_leaf is not None else None))
    return out


# ---------------------------------------------------------------- the models (one process, float64)
def _where(world: int, n: int, layout: str) -> tuple[Tensor, Tensor, Tensor]:
    """(L,) each, in position order: the rank that holds each position, its row in that rank's shard,
    and the position the rank order would give it (rank * n + row)."""
    from attnlab.distributed import positions

    L = n * world
    rank, row = torch.empty(L, dtype=torch.long), torch.empty(L, dtype=torch.long)
    for r in range(world):
        pos = positions(r, world, n, layout)
        rank[pos], row[pos] = r, torch.arange(n)
    return rank, row, rank * n + row


def _attend(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, sinks: Optional[Tensor]) -> Tensor:
    """Attention with a (L, S) keep mask and optional per-head sinks, float64, grouped heads h // r."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~keep, float("-inf"))  # (B, H, L, S)
    cols = [s] + ([sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)] if sinks is not None else [])
    lse = torch.logsumexp(torch.cat(cols, dim=-1), dim=-1, keepdim=True)
    return torch.exp(s - lse) @ v


def _merged_base2(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, owner: Tensor, world: int,
                  sinks: Optional[Tensor] = None) -> Tensor:
    """Each key/value shard's partial (o_j, lse_j), merged with exp2 where exp belongs (a sink is one more
    term of the merge, with nothing to add to the output)."""
    parts, lses = [], []
    for j in range(world):
        mine = keep & (owner[None, :] == j)
        r = q.shape[1] // k.shape[1]
        s = (q @ k.repeat_interleave(r, 1).transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~mine, float("-inf"))
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - lse).nan_to_num(0.0)
        parts.append(p @ v.repeat_interleave(r, 1))
        lses.append(lse)
    if sinks is not None:
        lses.append(sinks.view(1, -1, 1, 1).expand_as(lses[0]))
    lse = torch.cat(lses, dim=-1)  # (B, H, L, W [+ 1])
    w = torch.exp2(lse - torch.logsumexp(lse * math.log(2.0), dim=-1, keepdim=True) / math.log(2.0))
    w = w.nan_to_num(0.0)
    return sum(w[..., j:j + 1] * parts[j] for j in range(world))


def _run_model(name: str, t: dict, probe: tuple, world: int) -> Optional[tuple]:
    """``name``'s (out, dq, dk, dv, dsinks) on a probe's inputs (``"right"``: the right ones); None where
    a fault's model is the right answer there."""
    _, causal, layout, sinks, _, _ = probe
    L = t["q"].shape[2]
    n = L // world
    owner, row, rank_order = _where(world, n, layout)
    pos = torch.arange(L)
    right = (pos[:, None] >= pos[None, :]) if causal else torch.ones(L, L, dtype=torch.bool)
    keep, sink_t = right, t["sinks"]
    if name == "cp_sinks_dropped" or name == "cp_sinks_per_rank":
        if not sinks:
            return None
        sink_t = None if name == "cp_sinks_dropped" else t["sinks"] + math.log(world)
    elif name == "cp_causal_offset":
        if not causal:
            return None
        keep = row[:, None] >= row[None, :]
    elif name == "cp_layout":
        if not causal or layout == "contiguous":
            return None
        keep = rank_order[:, None] >= rank_order[None, :]
    elif name == "cp_missing_shard":
        keep = right & (owner[None, :] != (owner[:, None] + 1) % world)
    elif name not in ("right", "cp_lse_merge", "cp_heads", "cp_grad_reduce"):
        raise ValueError(name)
    leaves = {n_: t[n_].clone().requires_grad_() for n_ in ("q", "k", "v")}
    s_leaf = sink_t.clone().requires_grad_() if sink_t is not None else None
    if name == "cp_lse_merge":
        o = _merged_base2(leaves["q"], leaves["k"], leaves["v"], keep, owner, world, s_leaf)
    else:
        o = _attend(leaves["q"], leaves["k"], leaves["v"], keep, s_leaf)
    if name == "cp_heads":  # heads gathered strided where they were scattered in groups: the output only
        H = o.shape[1]
        per = H // world
        perm = torch.tensor([(h % per) * world + h // per for h in range(H)])
        return o.detach()[:, perm], None, None, None, None
    if name == "cp_grad_reduce":  # each key shard's gradient from its own rank's queries only
        dk, dv = torch.zeros_like(t["k"]), torch.zeros_like(t["v"])
        for r in range(world):
            rows = owner == r
            gk, gv = torch.autograd.grad((o[:, :, rows] * t["do"][:, :, rows]).sum(), (leaves["k"], leaves["v"]),
                                         retain_graph=True)
            dk[:, :, rows], dv[:, :, rows] = gk[:, :, rows], gv[:, :, rows]
        return o.detach(), None, dk, dv, None
    wrt = [leaves["q"], leaves["k"], leaves["v"]] + ([s_leaf] if s_leaf is not None else [])
    got = torch.autograd.grad(o, wrt, t["do"])
    ds = got[3] if s_leaf is not None and sinks else (torch.zeros_like(t["sinks"]) if sinks else None)
    return o.detach(), got[0], got[1], got[2], ds


MODELS = ("cp_sinks_dropped", "cp_sinks_per_rank", "cp_causal_offset", "cp_layout", "cp_missing_shard",
          "cp_lse_merge", "cp_heads", "cp_grad_reduce")
_SAID = {
    "cp_sinks_dropped": ("cp_sinks", "the sinks are dropped: the output is attention without them"),
    "cp_sinks_per_rank": ("cp_sinks", "each rank adds the sinks to its share: the output is attention with "
                                      "every sink counted W times (sink + log W)"),
    "cp_causal_offset": ("cp_causal_offset", "the causal mask compares each shard's local rows (0..n-1), "
                                             "not absolute positions"),
    "cp_layout": ("cp_layout", "the zigzag shards are taken in rank order: the mask (or merge) treats rank r's "
                               "rows as positions r*n .. (r+1)*n - 1"),
    "cp_missing_shard": ("cp_missing_shard", "each rank's queries miss the key/value shard of the next rank "
                                             "(a ring one step short)"),
    "cp_lse_merge": ("cp_lse_merge", "the shards' partial results are merged with exp2 of natural-unit "
                                     "log-sum-exps"),
    "cp_heads": ("cp_heads", "the output's heads are in the wrong slots: scattered in contiguous groups, "
                             "gathered strided (or the other way)"),
    "cp_grad_reduce": ("cp_grad_reduce", "dK and dV hold only the local queries' share: the other ranks' "
                                         "contributions are not reduced back"),
}


def _close(a: Optional[Tensor], b: Optional[Tensor]) -> bool:
    """float32's tolerance (a user's function may compute in float32 on float64 inputs)."""
    from attnlab.testing import tolerance

    if a is None or b is None:  # no gradient came back: right only where the model's is zero
        other = b if a is None else a
        return other is None or not bool(other.abs().gt(0).any())
    tol = tolerance(torch.float32)
    return a.shape == b.shape and bool(((a.double() - b.double()).abs() <= tol.atol + tol.rtol * b.abs()).all())


def _matches(got: tuple, want: tuple) -> bool:
    return all(w is None or _close(g, w) for g, w in zip(got, want))


def _assemble(parts: list[Tensor], world: int, layout: str) -> Tensor:
    from attnlab.distributed import positions

    n = parts[0].shape[2]
    order = torch.cat([positions(r, world, n, layout) for r in range(world)])
    return torch.cat(parts, dim=2).index_select(2, torch.argsort(order))


def diagnose_context_parallel(fn: Union[str, Callable], world: int = 2, *, seed: int = 0,
                              timeout: float = 120.0) -> DoctorReport:
    """Run a context-parallel attention on ``world`` gloo ranks and name what is wrong with it.

    Args:
        fn: the function (a module-level one, picklable) or ``"pkg.mod:fn"`` / ``"file.py:fn"``, with
            the ring's signature (see the module's docstring). Each rank imports and calls it: only
            code you trust.
        world: how many ranks (2 or 4 on a laptop).
        seed: the probes' inputs.
        timeout: seconds for all the ranks (a hang is a failure naming the collective each rank was in).

    Returns:
        A :class:`attnlab.doctor.DoctorReport`: ``ok`` when every probe's output and gradients match one
        process in float64; otherwise the ``cp_*`` finding whose model reproduces every probe, or
        ``unknown``. Probes the function cannot take (no ``layout=``: zigzag; no ``sinks=``) are listed
        in ``not_probed``.

    Raises:
        attnlab.distributed.testing.RanksFailed: a rank died or hung.
    """
    from attnlab.distributed.testing import run_ranks

    if world < 2:
        raise ValueError(f"diagnose_context_parallel: world must be at least 2, got {world}")
    takes = _takes(_load(fn))
    probes = tuple(p for p in CP_PROBES if ("layout" in takes or p[2] == "contiguous")
                   and ("sinks" in takes or not p[3]) and ("enable_gqa" in takes or p[4] == p[5]))
    not_probed = ([] if "layout" in takes else ["the zigzag layout (no layout= argument)"]) + \
        ([] if "sinks" in takes else ["sinks (no sinks= argument)"]) + \
        ([] if "enable_gqa" in takes else ["grouped heads (no enable_gqa= argument)"])
    ranks = run_ranks(_rank, world, args=(fn, probes, seed), timeout=timeout)
    gathered, failures, worst = [], [], 0.0
    for i, probe in enumerate(probes):
        answers = [r[i] for r in ranks]
        bad = next((a for a in answers if isinstance(a, str)), None)
        if bad is not None:
            failures.append(Finding("unknown", f"probe '{probe[0]}' raised {bad}"))
            gathered.append(None)
            continue
        full = [_assemble([a[j] for a in answers], world, probe[2]) if answers[0][j] is not None else None
                for j in range(4)]
        ds = answers[0][4]
        full.append(sum(a[4] for a in answers) if ds is not None else None)
        gathered.append(tuple(full))
    rights = [_run_model("right", _inputs(p, world, seed + i), p, world) for i, p in enumerate(probes)]
    wrong = [i for i, g in enumerate(gathered) if g is not None and not _matches(g, rights[i])]
    for i in wrong:
        worst = max(worst, float((gathered[i][0].double() - rights[i][0]).abs().max()))
    if not wrong and not failures:
        return ContextParallelReport(True, 0.0, [], len(probes), not_probed)
    findings = list(failures)
    if wrong:
        findings.append(_explain(gathered, rights, probes, world, seed) or Finding(
            "unknown", f"probes {', '.join(repr(probes[i][0]) for i in wrong)} differ from one process "
                       "(max |error| {:.3g}) in a way no context-parallel model reproduces".format(worst)))
    return ContextParallelReport(False, worst if wrong else float("inf"), findings, len(probes), not_probed)


def _explain(gathered: list, rights: list, probes: tuple, world: int, seed: int) -> Optional[Finding]:
    """The first model that reproduces every probe that ran, and differs from the right answer somewhere."""
    for name in MODELS:
        differs, fits = False, True
        for i, probe in enumerate(probes):
            if gathered[i] is None:
                continue
            model = _run_model(name, _inputs(probe, world, seed + i), probe, world)
            want = rights[i] if model is None else model
            if not _matches(gathered[i], want):
                fits = False
                break
            differs = differs or model is not None
        if fits and differs:
            code, message = _SAID[name]
            return Finding(code, message)
    return None
