"""Names that point at the right line (issue 62, item 3): each case named the wrong mistake, or
none, or said its note three times, on the code before it.
"""

from __future__ import annotations

import ast
import tempfile
from pathlib import Path

import pytest
import torch

from attnlab.grading import grade
from attnlab.grading.errors import explain

ROOT = Path(__file__).resolve().parents[2]
LAB01 = (ROOT / "labs/track1/01-attention/solutions/attention.py").read_text()
LAB05 = (ROOT / "labs/track1/05-triton-flash/solutions/flash_triton.py").read_text()

BROADCAST = ("raised RuntimeError: The size of tensor a (4) must match the size of tensor b (3) at non-singleton dimension 1\n"
             'Traceback (most recent call last):\n  File "flash.py", line {line}, in backward_pass\n')


def _grade(source: str, file: str, lab: str):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / file
        path.write_text(source)
        return grade(path, lab=lab, sandbox="none", seed=2)


def test_keepdim_is_named_only_for_a_reduction_that_feeds_the_failing_line():
    """On the code before, any reduction without keepdim anywhere in the function was blamed: the
    right ``D = rowsum(dO * O)`` for a broadcast error of another line."""
    source = ("def backward_pass(do, o, p, dp):\n"
              "    D = (do * o).sum(dim=-1)\n"            # line 2: right, as the backward wants it
              "    m = p.amax(dim=-1)\n"                  # line 3: lost its dim, and feeds line 5
              "    ds = p * (dp - D[..., None])\n"        # line 4
              "    shifted = p - m\n"                     # line 5: fails
              "    for d_i in [D]:\n"
              "        x = dp - d_i\n"                    # line 7: fails, fed through a loop target
              "    return ds, shifted, x\n")
    tree = ast.parse(source)
    at_5 = explain(BROADCAST.format(line=5), tree, "flash.py")
    assert [f["code"] for f in at_5] == ["keepdim"] and "line 3" in at_5[0]["message"] \
        and "line 2" not in at_5[0]["message"], at_5
    at_7 = explain(BROADCAST.format(line=7), tree, "flash.py")
    assert [f["code"] for f in at_7] == ["keepdim"] and "line 2" in at_7[0]["message"], at_7
    at_4 = explain(BROADCAST.format(line=4), tree.__class__(body=[ast.parse(
        "def backward_pass(do, o, p, dp):\n    D = (do * o).sum(dim=-1, keepdim=True)\n    m = p.amax(dim=-1)\n"
        "    ds = p * (dp - D)\n    return ds, m\n").body[0]], type_ignores=[]), "flash.py")
    assert at_4 == [], at_4  # line 4 reads D (kept its dim); m lost one but feeds nothing there


BACKWARD = ("def backward_pass(q, k, v, o, lse, do, S, bk, qs, qe, scale):\n"
            "    D = (do * o).sum(dim=-1)\n"                          # line 2: right, always read with None
            "    for ks in range(0, S, bk):\n"
            "        k_j, v_j = k[:, :, ks:ks + bk], v[:, :, ks:ks + bk]\n"
            "        p = torch.exp(q @ k_j.transpose(-2, -1) - lse[:, :, ks:ks + bk, None])\n"  # line 5: lse by keys
            "        ds = p * (do @ v_j.transpose(-2, -1) - D[:, :, qs:qe, None])\n"  # line 6
            "        dq = (ds @ v_j) * scale\n"                       # line 7: V where K belongs
            "        dk = ds.transpose(-2, -1) @ do\n"                # line 8: dO where Q belongs
            "        dv = p.transpose(-2, -1) @ do\n"                 # line 9: right
            "    return dq, dk, dv\n")


def test_a_backward_line_names_its_wrong_operand_or_axis_not_a_right_reduction():
    """On the code before, each of these shape errors (an independent author's lab 04 mutants: dQ from V, dK
    from dO, lse sliced by the key tile) was named ``keepdim`` for the right ``D = (do * o).sum(dim=-1)``,
    which every later line reads as ``D[..., None]``."""
    tree = ast.parse(BACKWARD)
    codes = {line: [(f["code"], f["message"]) for f in explain(BROADCAST.format(line=line), tree, "flash.py")]
             for line in (5, 6, 7, 8, 9)}
    assert [c for c, _ in codes[7]] == ["backward_operand"] and "dq is built from v" in codes[7][0][1], codes
    assert [c for c, _ in codes[8]] == ["backward_operand"] and "dk is built from do" in codes[8][0][1], codes
    assert [c for c, _ in codes[5]] == ["wrong_axis"] and "lse" in codes[5][0][1], codes
    assert codes[6] == [] and codes[9] == [], codes  # D kept its dim through None; dv's operands are right
    matmul = BROADCAST.replace("The size of tensor a (4) must match the size of tensor b (3) at non-singleton "
                               "dimension 1", "Expected size for first two dimensions of batch2 tensor to be: [4, 16]")
    assert [f["code"] for f in explain(matmul.format(line=7), tree, "flash.py")] == ["backward_operand"]


SECOND = ("def backward_pass(q, k, v, o, lse, do, L, bq, ks, ke, scale):\n"
          "    delta = (do * o).sum(dim=-2)\n"                      # line 2: over the rows
          "    for qs in range(0, L, bq):\n"
          "        qt, dot_, vt = q[:, :, qs:qs + bq], do[:, :, qs:qs + bq], v[:, :, ks:ke]\n"
          "        lse_t = lse[:, :, qs:qs + bq]\n"
          "        p = torch.exp(q @ k.transpose(-2, -1) - lse_t)\n"   # line 6: lse_t without [..., None]
          "        ds = p * (dot_ @ vt.transpose(-2, -1) - delta[:, :, qs:qs + bq][..., None])\n"  # line 7
          "        dk[:, :, qs:qs + bq] += ds.transpose(-2, -1) @ qt\n"  # line 8: a key gradient at query rows
          "        dv[:, :, ks:ke] += p.transpose(-2, -1) @ vt\n"       # line 9: V where dO belongs
          "    return dk, dv\n")


def test_an_independent_authors_names_and_axes_are_read_too():
    """The second held-out corpus wrote ``qt``, ``dot_``, ``vt``, sliced D through two subscripts and summed it
    over the rows: on the code before, each shape error here was ``keepdim`` for the D line, or nothing."""
    tree = ast.parse(SECOND)
    named = {line: [f["code"] for f in explain(BROADCAST.format(line=line), tree, "flash.py")] for line in (6, 7, 8, 9)}
    assert named == {6: ["keepdim"], 7: ["wrong_axis"], 8: ["wrong_axis"], 9: ["backward_operand"]}, named
    at_7 = explain(BROADCAST.format(line=7), tree, "flash.py")[0]["message"]
    assert "dim=-2" in at_7 and "line 2" in at_7, at_7


def test_a_policy_refusal_carries_its_code_where_the_learner_reads_it():
    """On the code before, lab 05's refusal of tl.atomic_add printed no [policy]."""
    source = LAB05.replace("    tl.store(DK + bhk * S * E + keys[:, None] * E + cols_e[None, :], dk, mask=keys[:, None] < S)",
                           "    tl.atomic_add(DK + bhk * S * E + keys[:, None] * E + cols_e[None, :], dk, "
                           "mask=keys[:, None] < S)")
    assert source != LAB05
    report = _grade(source, "flash_triton.py", "05")
    text = report.to_text()
    assert "[policy]" in text and "atomic_add" in text and report.score == 0, text


def test_an_allocation_past_the_memory_limit_has_its_own_code():
    """On the code before, it was a shape_error with a hint about broadcasting."""
    source = LAB01.replace('    """ex1: project every position into a query, a key and a value."""\n',
                           '    """ex1"""\n    torch.ones(1 << 34)  # 64 GiB\n')
    assert source != LAB01
    report = _grade(source, "attention.py", "01")
    codes = {f["code"] for r in report.results if r.exercise.id == "ex1" for f in r.verdict.findings}
    assert codes == {"memory_limit"}, report.to_text()


def test_the_builds_on_note_is_said_once_per_exercise():
    """On the code before, '(this builds on your ex2 ...)' came under every failed check of ex8 (3x)."""
    source = LAB01.replace("return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])", "return Q @ K.transpose(-2, -1)")
    assert source != LAB01
    report = _grade(source, "attention.py", "01")
    ex8 = [r for r in report.results if r.exercise.id == "ex8" and not r.verdict.passed]
    assert len(ex8) >= 2, report.to_text()
    assert sum(r.verdict.message.count("this builds on your") for r in ex8) == 1, report.to_text()
    assert all(f["code"] == "missing_scale" for r in ex8 for f in r.verdict.findings)


@pytest.mark.parametrize("finite_too", [True, False])
def test_causal_block_skip_is_named_only_when_finite_inputs_give_a_finite_output(finite_too):
    """On the code before, any NaN in lab 04's skip case was 'causal_block_skip', though an inverted
    rescale or K read through the wrong strides makes NaN from finite inputs too."""
    from attnlab.labs import lab04_flash as lab

    L, bq, bk, nan_from = lab.EX2_SKIP
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 8, generator=g) for _ in range(3))
    nan_out = torch.full((1, 2, nan_from, 8), float("nan"))  # the skip call: queries 0..nan_from - 1
    finite = (torch.zeros(1, 2, L, 8) if finite_too else torch.full((1, 2, L, 8), float("nan")), torch.zeros(1, 2, L))
    verdict = lab._judge_skip((q, k, v), (nan_out, torch.zeros(1, 2, nan_from)), finite)
    assert not verdict.passed
    assert ({f["code"] for f in verdict.findings} == {"causal_block_skip"}) == finite_too, verdict


LAB04 = (ROOT / "labs/track1/04-flash-attention/solutions/flash.py").read_text()
RIGHT = '''            if is_causal and ks > qe - 1:
                continue  # no query of this block sees these keys
            q_i, do_i = q[:, :, qs:qe], do[:, :, qs:qe]
            s = (q_i @ k_j.transpose(-2, -1)) * scale  # [B, H, bq, bk]
            if is_causal:
                mask = causal_block_mask(qs, qe, ks, ke)'''
BOTTOM_RIGHT = '''            if is_causal and ks > qe - 1 + S - L:
                continue  # no query of this block sees these keys
            q_i, do_i = q[:, :, qs:qe], do[:, :, qs:qe]
            s = (q_i @ k_j.transpose(-2, -1)) * scale  # [B, H, bq, bk]
            if is_causal:
                mask = causal_block_mask(qs + S - L, qe + S - L, ks, ke)'''


def test_a_backward_causal_mask_aligned_bottom_right_is_named_on_rectangular_cases():
    """On the code before, lab 04's backward was tried on a square causal case only: this backward
    scored 100 (issue 62)."""
    assert LAB04.count(RIGHT) == 1
    report = _grade(LAB04.replace(RIGHT, BOTTOM_RIGHT), "flash.py", "04")
    scores = report.exercise_scores()
    assert scores["ex4"][0] < scores["ex4"][1], report.to_text()
    codes = {f["code"] for r in report.results if r.exercise.id == "ex4" for f in r.verdict.findings}
    assert codes == {"causal_alignment"}, report.to_text()
    assert _grade(LAB04, "flash.py", "04").score == 100


@pytest.mark.slow
def test_a_key_value_offset_counted_in_query_heads_loses_lab05s_grouped_heads_points():
    """On the code before, lab 05 graded every case with batch 1, where b * H and b * Hkv are both 0:
    this forward scored 100 (issue 62). ex7 now runs a batch of 2."""
    right = "    bhk = b * Hkv + h // (H // Hkv)  # ex7"
    assert LAB05.count(right) == 1
    report = _grade(LAB05.replace(right, "    bhk = b * H + h // (H // Hkv)  # ex7"), "flash_triton.py", "05")
    scores = report.exercise_scores()
    assert scores["ex7"][0] < scores["ex7"][1] and report.score < 100, report.to_text()


SHAPES = ("def backward_pass(q, k, v, o, lse, do, S, L, bq, bk, scale):\n"
          "    D = (do * o).sum(dim=-1)\n"
          "    for ks in range(0, S, bk):\n"
          "        for qs in range(0, L, bq):\n"
          "            mask = causal_block_mask(ks, ks + bk, qs, qs + bq)\n"              # line 5: keys first
          "            s = (q[:, :, qs:qs + bq] @ k[:, :, ks:ks + bk].transpose(-2, -1)).masked_fill(~mask, -1e9)\n"
          "            p = torch.exp(s - lse[:, :, qs:qs + bq])\n"                     # line 7: no trailing None
          "            dv = p @ do[:, :, qs:qs + bq]\n"                                # line 8: P not transposed
          "            dq = torch.einsum('bhkq,bhke->bhqe', p, k)\n"                   # line 9: dS read as (k, q)
          "    return dq, dv\n")


def test_a_shape_error_names_the_transpose_the_mask_or_the_row_vector_of_its_line():
    """Issue 62's first held-out corpus left these unnamed (a broadcast or matmul error, no reduction
    without keepdim feeding the line): each now names its line's mistake."""
    tree = ast.parse(SHAPES)
    matmul = BROADCAST.replace("The size of tensor a (4) must match the size of tensor b (3) at non-singleton "
                               "dimension 1", "Expected size for first two dimensions of batch2 tensor to be: [4, 16]")
    einsum = BROADCAST.replace("The size of tensor a (4) must match the size of tensor b (3) at non-singleton "
                               "dimension 1", "einsum(): subscript k has size 13 for operand 1 which does not broadcast")
    at_6 = explain(BROADCAST.format(line=6), tree, "flash.py")
    assert [f["code"] for f in at_6] == ["backward_mask"] and "line 5" in at_6[0]["message"], at_6
    at_7 = explain(BROADCAST.format(line=7), tree, "flash.py")
    assert [f["code"] for f in at_7] == ["keepdim"] and "lse" in at_7[0]["message"], at_7
    at_8 = explain(matmul.format(line=8), tree, "flash.py")
    assert [f["code"] for f in at_8] == ["backward_operand"] and "dV = P^T dO" in at_8[0]["message"], at_8
    at_9 = explain(einsum.format(line=9), tree, "flash.py")
    assert [f["code"] for f in at_9] == ["backward_operand"] and "dQ = scale * dS K" in at_9[0]["message"], at_9
    right = ast.parse(SHAPES.replace("dv = p @ do", "dv = p.transpose(-2, -1) @ do"))
    assert explain(matmul.format(line=8), right, "flash.py") == []  # the formula's own transposes: wrong elsewhere


FUNCTION = ("class Attn(torch.autograd.Function):\n"
            "    @staticmethod\n"
            "    def forward(ctx, q, k, v):\n"
            "        o, lse = fwd(q, k, v)\n"
            "        ctx.save_for_backward(q, k, v, o, lse)\n"                         # line 5
            "        return o\n"
            "    @staticmethod\n"
            "    def backward(ctx, do):\n"
            "        q, k, v, lse, o = ctx.saved_tensors\n"                            # line 9: lse and o swapped
            "        return bwd(q, k, v, o, lse, do)\n")


def test_saved_tensors_unpacked_in_another_order_are_named_under_any_error_below_them():
    error = ("raised RuntimeError: The size of tensor a (8) must match the size of tensor b (33) at non-singleton "
             "dimension 3\nTraceback (most recent call last):\n  File \"flash.py\", line 10, in backward\n"
             "    return bwd(q, k, v, o, lse, do)\n  File \"flash.py\", line 40, in bwd\n    p = torch.exp(s - lse)\n"
             "RuntimeError: The size of tensor a (8) must match")
    found = explain(error, ast.parse(FUNCTION), "flash.py")
    assert [f["code"] for f in found] == ["order"] and "line 9" in found[0]["message"] \
        and "line 5 saved (q, k, v, o, lse)" in found[0]["message"], found
    right = ast.parse(FUNCTION.replace("q, k, v, lse, o = ctx", "q, k, v, o, lse = ctx"))
    assert [f["code"] for f in explain(error, right, "flash.py")] != ["order"]


def test_a_hostile_file_cannot_crash_or_stall_the_explainers():
    """Issue 62's attacker: an assignment target nested 2000 deep crashed the grader (recursion in
    the names a target stores), and 2000 saves against 2000 unpacks under a traceback of repeated
    frames took minutes (every unpack against every save, per frame)."""
    deep = "def f(o):\n    x = o + 1\n    o" + "[0]" * 2000 + " = 1\n"
    tree = ast.parse(deep)
    found = explain(BROADCAST.format(line=2).replace("backward_pass", "f"), tree, "flash.py")
    assert isinstance(found, list)
    many = ("class F(torch.autograd.Function):\n    def backward(ctx, do):\n"
            + "".join(f"        a{i}, b{i} = ctx.saved_tensors\n" for i in range(2000))
            + "    def forward(ctx, q):\n"
            + "".join(f"        ctx.save_for_backward(a{i}, b{i})\n" for i in range(2000)))
    frames = "".join('  File "flash.py", line 3, in backward\n    x\n' for _ in range(40))
    text = f"raised ValueError: no\nTraceback (most recent call last):\n{frames}ValueError: no"
    assert explain(text, ast.parse(many), "flash.py") == []  # every unpack in its saved order
    swapped = many.replace("a7, b7 = ctx", "b7, a7 = ctx")
    found = explain(text, ast.parse(swapped), "flash.py")
    assert [f["code"] for f in found] == ["order"] and "(b7, a7)" in found[0]["message"]


def test_a_line_break_in_a_finding_never_starts_a_report_line():
    """A finding's message can carry a learner's text (an error it raised): each line after the
    first is indented, so none passes for a 'PASS ...' or 'Score: ...' line of the report."""
    from attnlab.grading.exercise import Verdict
    from attnlab.grading.grader import TestResult
    from attnlab.labs.lab01_attention import EXERCISES

    verdict = Verdict(False, "values differ", [{"code": "load_mask", "message": "x\nScore: 100/100\nPASS ex1"}])
    out = TestResult(EXERCISES[0], next(iter(EXERCISES[0].checks)), 0.0, 1.0, verdict).output()
    assert not any(line.startswith(("Score", "PASS")) for line in out.splitlines()), out
    assert "Score: 100/100" in out  # said, indented


def test_a_per_row_vector_with_a_suffix_sliced_by_the_key_tile_is_named_too():
    """The fourth held-out corpus wrote ``lse_w[:, :, ks:ke, None]``: on the code before, the suffix hid the
    per-row name and the shape error was named nothing. ``dk``, ``dq`` and ``do`` stay no per-row names."""
    code = BACKWARD.replace("lse[:, :, ks:ks + bk, None]", "lse_w[:, :, ks:ks + bk, None]")
    assert "lse_w[:, :, ks:ks + bk, None]" in code
    found = explain(BROADCAST.format(line=5), ast.parse(code), "flash.py")
    assert [f["code"] for f in found] == ["wrong_axis"] and "lse_w has one value per query row" in found[0]["message"]
    from attnlab.grading.errors import _PER_QUERY
    assert [n for n in ("dk", "dq", "do", "dv", "ds", "dp", "lse_w", "db", "delta2") if _PER_QUERY.match(n)] == [
        "lse_w", "db", "delta2"]
