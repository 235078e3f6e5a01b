"""The kernel layer's online softmax and tile backward (attnlab.kernels.online), on their own.

Both pure paths (tiled, base 2; flex, natural units) run through these; the parity suites
check the paths end to end. Here: the state after any split of the keys equals one softmax,
in both units and both in-place and out-of-place; empty rows give 0 and -inf; the tile
backward equals autograd's gradients of one tile; the merge of two halves equals the whole.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import kernels
from attnlab.kernels import online
from attnlab.testing import assert_close


def reference(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(s) @ v and logsumexp(s), natural units, float64."""
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("units", ["natural", "base2"])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("split", [1, 3, 7, 16])
def test_the_state_after_any_split_is_one_softmax(units, inplace, split):
    g = torch.Generator().manual_seed(split)
    s = torch.randn(2, 3, 5, 16, generator=g, dtype=torch.float64) * 4  # (B, H, n, S) scores, natural units
    s[0, 0, 1] = float("-inf")  # a row that sees no key
    s[1, 2, 3, :9] = float("-inf")  # a row that sees only the last keys
    v = torch.randn(2, 3, 16, 4, generator=g, dtype=torch.float64)
    exp, log, k = (torch.exp, torch.log, 1.0) if units == "natural" else (torch.exp2, torch.log2, math.log2(math.e))
    state = online.start((2, 3, 5), 4, s)
    for j0 in range(0, 16, split):
        tile = (s[..., j0:j0 + split] * k).clone()  # the caller's own scores, in the state's units
        state = online.update(*state, tile, v[..., j0:j0 + split, :], exp, inplace=inplace)
    out, lse = online.finish(*state, log)
    want_out, want_lse = reference(s[..., :], v)
    want_out[0, 0, 1] = 0.0  # SDPA: a row with no key gives 0
    assert_close(out, want_out, msg="output")
    assert torch.isneginf(lse[0, 0, 1]) and lse.isfinite().sum() == lse.numel() - 1
    finite = torch.isfinite(want_lse)
    assert_close(lse[finite] / k, want_lse[finite], msg="lse")


def test_a_broken_rescale_is_caught():
    """The check above is not vacuous: dropping the rescale of the old state (alpha) is wrong
    as soon as a later key block raises a row's max."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1, 1, 4, 8, generator=g, dtype=torch.float64)
    s[..., 4:] += 5  # the second block raises every row's max
    v = torch.randn(1, 1, 8, 3, generator=g, dtype=torch.float64)
    m_i, l_i, acc = online.start((1, 1, 4), 3, s)
    m_i, l_i, acc = online.update(m_i, l_i, acc, s[..., :4].clone(), v[..., :4, :], torch.exp)
    stale = (m_i.clone(), l_i.clone(), acc.clone())
    m_i, l_i, acc = online.update(m_i, l_i, acc, s[..., 4:].clone(), v[..., 4:, :], torch.exp)
    good, _ = online.finish(m_i, l_i, acc, torch.log)
    m_new = torch.maximum(stale[0], s[..., 4:].amax(-1, keepdim=True))
    p = torch.exp(s[..., 4:] - m_new)
    bad = (stale[2] + p @ v[..., 4:, :]) / (stale[1] + p.sum(-1, keepdim=True))  # alpha forgotten
    want, _ = reference(s, v)
    assert_close(good, want)
    assert (bad - want).abs().max() > 1e-3


def test_the_tile_backward_is_autograds():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)  # (Nb, n, E)
    k = torch.randn(2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)  # (Nb, bk, E)
    v = torch.randn(2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)  # (Nb, bk, Ev)
    scale = 0.37
    s = (q @ k.transpose(1, 2)) * scale
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    out = torch.exp(s - lse) @ v
    do = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    want = torch.autograd.grad((out * do).sum() + (lse * dlse).sum(), (q, k, v))
    with torch.no_grad():
        p = torch.exp(s - lse)
        delta = (do * out).sum(-1, keepdim=True)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        online.backward_tile(p, q, k, v, do, delta, scale, dq, dk, dv, dlse)
    for got, exp, name in zip((dq, dk, dv), want, ("dq", "dk", "dv")):
        assert_close(got, exp, msg=name)


def test_two_halves_merge_into_the_whole():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(3, 2, 7, 10, generator=g, dtype=torch.float64) * 3  # base-2 scores
    v = torch.randn(3, 2, 10, 4, generator=g, dtype=torch.float64)

    def attend(lo: int, hi: int):
        state = online.start((3, 2, 7), 4, s)
        return online.finish(*online.update(*state, s[..., lo:hi].clone(), v[..., lo:hi, :]))

    out, lse2 = attend(0, 4)
    o2, l2 = attend(4, 10)
    kernels.merge_(out, lse2, o2, l2)
    whole, whole_lse = attend(0, 10)
    assert_close(out, whole)
    assert_close(lse2, whole_lse)


def test_a_bad_tile_size_names_its_caller():
    assert kernels.block_size(None, 256, "block_q") == 256 and kernels.block_size(8, 256, "block_q") == 8
    with pytest.raises(ValueError, match="ring_attention: block_k must be a positive int, got 0"):
        kernels.block_size(0, 256, "block_k", "ring_attention")
    with pytest.raises(ValueError, match="flash_attention: block_q must be a positive int, got True"):
        kernels.block_size(True, 256, "block_q")


def _attnlab_imports(tree) -> set[str]:
    """The attnlab modules a module imports at run time (not under ``if TYPE_CHECKING``)."""
    import ast

    typing_only = {id(n) for top in ast.walk(tree) if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
                   for n in ast.walk(top)}
    found = set()
    for n in ast.walk(tree):
        if id(n) in typing_only:
            continue
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("attnlab"):
            found |= {f"{n.module}.{a.name}" for a in n.names}
        elif isinstance(n, ast.Import):
            found |= {a.name for a in n.names if a.name.startswith("attnlab")}
    return found


def test_the_ring_and_the_tiled_path_share_the_kernel_layer_only():
    """The ring (distributed/ring.py) reaches the tiles and the mask blocks through attnlab.kernels only,
    never through tiled.py or flex (an allow-list: the kernel layer, the argument checks and the package's
    own layouts; Ulysses and USP go through the front door, dispatch, as any caller does);
    tiled.py keeps the public function, its autograd.Function and the op pair that stands for it
    under tracing only; the kernel layer
    imports nothing above it at run time."""
    import ast
    from pathlib import Path

    import attnlab

    root = Path(attnlab.__file__).parent
    imported = _attnlab_imports(ast.parse((root / "distributed" / "ring.py").read_text()))
    outside = {m for m in imported if m != "attnlab.kernels" and not m.startswith(
        ("attnlab.kernels.", "attnlab._validation.", "attnlab.distributed.layout."))}
    assert not outside and "attnlab.kernels.mask_blocks" in imported, imported
    for path in sorted((root / "kernels").glob("*.py")):
        above = {m for m in _attnlab_imports(ast.parse(path.read_text())) if not m.startswith("attnlab.kernels")}
        assert all(m.startswith("attnlab._validation.") for m in above), (path.name, above)
    tiled_tree = ast.parse((root / "tiled.py").read_text())
    defs = {n.name for n in tiled_tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    # and the custom op pair that stands for the Function under torch.compile (issue 50): the two
    # ops, their fakes (each named _) and the forward op's autograd; the Function's forward and
    # backward are one pair of functions both use (_forward, _backward, what they share: _Saved,
    # _operands, _widen_if, and the sinks' fold)
    assert defs == {"flash_attention", "native_status", "_FlashAttention", "_flash_attention_op",
                    "_flash_attention_backward_op", "_", "_op_setup_context", "_op_backward", "_Saved", "_forward",
                    "_backward", "_operands", "_widen_if", "_fold_sinks"}, defs
