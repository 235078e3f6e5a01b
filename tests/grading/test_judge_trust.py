"""The judge trusts nothing the learner's process can touch (issue 61).

Each attack of the issue is a test here that failed on the code before it (the score or the
value it names, measured on that code, is in its docstring), with the honest files beside it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from attnlab.grading import Limits, grade
from attnlab.grading.static import check_source

ROOT = Path(__file__).resolve().parents[2]
LAB01 = ROOT / "labs/track1/01-attention"
SOLUTION = (LAB01 / "solutions/attention.py").read_text()
FAST = Limits(timeout_s=2.0)


def _replace_function(source: str, name: str, new: str) -> str:
    start = source.index(f"def {name}(")
    end = source.index("\n\n\n", start)
    return source[:start] + new.strip() + source[end:]


def _grade(source: str, file: str = "attention.py", lab: str = "01", seed: int = 1):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / file
        path.write_text(source)
        return grade(path, lab=lab, sandbox="none", seed=seed)


def _compare_with_softmax_door(source: str, body: str) -> str:
    """compare_with_sdpa, the one function where torch's attention is written, with a side door."""
    head = source.index('"""ex9')
    head = source.index("\n", head) + 1
    return source[:head] + body + source[head:]


# the rebinding attack: clone arms a rebound detach, which the child's own serialisation then called
# after the recorder was off; detach computed the softmax through compare_with_sdpa's allowance
REBINDING = _compare_with_softmax_door(_replace_function(SOLUTION, "stable_softmax", '''
def _fix(self):
    return compare_with_sdpa(self, None, None, None)


def _arm(self):
    torch.Tensor.detach = _fix
    return self * 1


def stable_softmax(scores, dim=-1):
    torch.Tensor.clone = _arm
    return scores
'''), "    if W_Q is None:\n        return torch.softmax(X, dim=-1)\n")

# SDPA measured against itself: self_attention answers with compare_with_sdpa's SDPA
THROUGH_THE_EXEMPT_FUNCTION = _replace_function(
    _compare_with_softmax_door(SOLUTION, "    if W_Q is None:\n        return torch.nn.functional."
                                         "scaled_dot_product_attention(X, W_K, W_V, attn_mask=mask)\n"),
    "self_attention", '''
def self_attention(X, W_Q, W_K, W_V, mask=None):
    Q, K, V = project_qkv(X, W_Q, W_K, W_V)
    return compare_with_sdpa(Q, None, K, V, mask), None
''')


def test_a_file_that_rebinds_torchs_methods_is_refused_whole():
    """On the code before: 55/100 (ex12's row of weights computed by torch.softmax inside the
    child's serialisation, after the recorder was off). Now the stores are refused by the rule."""
    report = _grade(REBINDING)
    assert report.score == 0, report.to_text()
    assert "a store on torch.Tensor.detach" in report.problem and "a store on torch.Tensor.clone" in report.problem


@pytest.mark.parametrize("source, refused", [
    ("import torch\n\ndef f(x):\n    torch.Tensor.detach = f\n", "torch.Tensor.detach"),
    ("import torch\n\ndef f(x):\n    setattr(torch.Tensor, 'clone', f)\n", "torch.Tensor.clone"),
    ("import torch\n\ndef f(x):\n    delattr(torch.Tensor, 'clone')\n", "torch.Tensor.clone"),
    ("import torch\n\ndef f(x):\n    del torch.Tensor.clone\n", "torch.Tensor.clone"),
    ("import torch\n\ndef f(x):\n    T = torch.Tensor\n    T.clone = f\n", "T.clone"),
    ("import torch\n\ndef f(x):\n    T = getattr(torch, 'Tensor')\n    T.clone = f\n", "T.clone"),
    ("import torch\n\ndef f(x):\n    for T in (torch.Tensor,):\n        T.clone = f\n", "T.clone"),
    ("from torch import Tensor\n\ndef f(x):\n    Tensor.clone = f\n", "Tensor.clone"),
    ("import torch\n\ndef f(x):\n    x.exp().abs = f\n", "computed object"),
    ("import torch\n\ndef f(x):\n    [x][0].clone = f\n", "computed object"),
    ("import torch\n\ndef f(x):\n    x.__class__ = int\n", "__class__"),
    ("import math\n\ndef f(x):\n    math.sqrt = abs\n", "math.sqrt"),
    # an independent attacker's roads (issue 61): a class attribute, a chain, a parameter
    ("import torch\n\nclass Box:\n    T = torch.Tensor\n\ndef f(x):\n    T = Box.T\n    T.clone = f\n", "T.clone"),
    ("import torch\n\nclass Box:\n    T = torch.Tensor\n\ndef f(x):\n    Box.T.clone = f\n", "attribute of an attribute"),
    ("import torch\n\ndef poke(kls, g):\n    kls.clone = g\n\ndef f(x):\n    poke(torch.Tensor, x)\n", "kls.clone"),
    ("import torch\n\ndef poke(kls=None):\n    del kls.clone\n\ndef f(x):\n    poke(kls=torch.Tensor)\n", "kls.clone"),
    ("import torch\n\nclass B:\n    def poke(self, kls):\n        kls.clone = 1\n\ndef f(x):\n"
     "    B().poke(torch.Tensor)\n", "kls.clone"),
])
def test_a_store_on_what_the_file_did_not_make_is_refused_by_any_spelling(source, refused):
    messages = [v.message for v in check_source(source).violations]
    assert any(refused in m for m in messages), messages


@pytest.mark.parametrize("source", [
    "import torch\n\nclass F(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, q, causal):\n"
    "        ctx.causal = causal\n        ctx.save_for_backward(q)\n        return q\n",
    "import torch\n\nclass Box:\n    def __init__(self, s):\n        self.scale = s\n        self.scale += 1\n",
    "import torch\n\nclass Box:\n    count = 0\n\ndef f(x):\n    Box.count = Box.count + 1\n    b = Box()\n"
    "    b.seen = x\n    return x\n",
    "import torch\n\ndef keep(ctx, dtype):\n    ctx.dtype = dtype\n\ndef f(ctx):\n    keep(ctx, torch.float32)\n",
])
def test_stores_on_what_the_file_made_stay_allowed(source):
    stores = [v for v in check_source(source).violations if "a store on" in v.message or "a delete on" in v.message]
    assert stores == []


@pytest.mark.subprocess
def test_rebound_methods_never_shape_what_leaves_the_child(tmp_path):
    """Whatever the file rebinds (here past the static rule, run straight in the sandbox), the answer
    is its tensor's own bytes, copied by functions the child captured before the file ran, and the
    rebinding is reported. On the code before: the value was the rebound detach's zeros."""
    from attnlab.grading.sandbox import Call, Sandbox

    path = tmp_path / "attention.py"
    path.write_text("import torch\n\n\ndef zeros(self, *a, **k):\n    return torch.zeros(3)\n\n\n"
                    "def answer():\n    for name in ('detach', 'clone', 'cpu', 'contiguous', 'numpy', 'reshape', 'view'):\n"
                    "        setattr(torch.Tensor, name, zeros)\n    return torch.ones(3)\n")
    with Sandbox(path, FAST, mode="none") as box:
        outcome = box.run([Call("answer")])
    assert outcome.status == "ok", outcome
    assert torch.equal(outcome.results[0]["value"], torch.ones(3))
    assert "torch.Tensor.detach (rebound by the file)" in outcome.violations, outcome.violations


@pytest.mark.subprocess
def test_a_tensor_subclass_or_a_lying_object_is_unsupported_and_runs_nothing(tmp_path):
    """A returned subclass with its own __torch_function__, or an object whose __class__ says
    Tensor, is an unsupported answer: none of its code runs in the child's serialisation."""
    from attnlab.grading.sandbox import Call, Sandbox, Unsupported

    path = tmp_path / "attention.py"
    path.write_text("import torch\n\n\nclass Sneaky(torch.Tensor):\n    @classmethod\n"
                    "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
                    "        return torch.softmax(torch.ones(3), 0)\n\n\n"
                    "class Liar:\n    __class__ = torch.Tensor\n\n\n"
                    "def answer():\n    return torch.ones(3).as_subclass(Sneaky)\n\n\n"
                    "def lie():\n    return [Liar(), {'k': Liar()}]\n")
    with Sandbox(path, FAST, mode="none") as box:
        sub = box.run([Call("answer")])
        lie = box.run([Call("lie")])
    assert sub.status == "ok" and isinstance(sub.results[0]["value"], Unsupported), sub
    assert "subclass of torch.Tensor" in sub.results[0]["value"].type_name
    assert not sub.violations, sub.violations  # the subclass's softmax never ran
    first, mapping = lie.results[0]["value"]
    assert isinstance(first, Unsupported) and first.type_name == "Liar" and mapping["k"].type_name == "Liar"


def test_the_exempt_function_may_not_be_named_in_the_file():
    """An alias carries the allowance: ``self_attention = compare_with_sdpa`` answered ex9 with SDPA."""
    for source in ("def compare_with_sdpa(x):\n    return 1\n\n\nself_attention = compare_with_sdpa\n",
                   "def compare_with_sdpa(x):\n    return 1\n\n\ndef f(x):\n    return compare_with_sdpa(x)\n"):
        assert any("named in the file" in v.message for v in check_source(source, exempt={"compare_with_sdpa"})
                   .violations), source
    assert not any("named in the file" in v.message for v in check_source(SOLUTION, exempt={"compare_with_sdpa"})
                   .violations)


def test_sdpa_reached_through_the_exempt_function_is_a_violation():
    """On the code before: 72/100, ex9 5/5 with SDPA measured against itself (ex9's child ran with
    no recorder). The allowance now belongs to the call path: every learner frame on it must be
    compare_with_sdpa's."""
    report = _grade(THROUGH_THE_EXEMPT_FUNCTION)
    scores = report.exercise_scores()
    assert scores["ex9"][0] == 0 and scores["ex8"][0] == 0, report.to_text()
    codes = {f["code"] for r in report.results if r.exercise.id == "ex9" for f in r.verdict.findings}
    assert "policy" in codes


FIXED_DIFFERENCE = """
def compare_with_sdpa(X, W_Q, W_K, W_V, mask=None):
    return {fixed}
"""

# compare_with_sdpa measuring a copy of self_attention, not the function by its name
MEASURES_A_COPY = """
def compare_with_sdpa(X, W_Q, W_K, W_V, mask=None):
    Q, K, V = project_qkv(X, W_Q, W_K, W_V)
    mine, _ = _copy(X, W_Q, W_K, W_V, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    return (mine - ref).abs().max().item()
"""


def test_a_fixed_number_for_the_difference_from_sdpa_scores_nothing():
    """On the code before: ex9 5/5 for ``return 0.0`` (a seventh attacker): a correct self_attention is
    ~1e-7 from SDPA, inside the check's tolerance. Now a third call runs compare_with_sdpa while
    self_attention answers a secret difference off, and only a real measurement finds it."""
    for fixed in ("0.0", "1e-7", "float(torch.zeros(()))"):
        report = _grade(_replace_function(SOLUTION, "compare_with_sdpa", FIXED_DIFFERENCE.format(fixed=fixed)))
        scores = report.exercise_scores()
        assert scores["ex9"][0] == 0 and scores["ex8"][0] == scores["ex8"][1], (fixed, report.to_text())
        assert "do not return a fixed number" in report.to_text()


def test_a_measurement_that_does_not_call_self_attention_by_name_is_told_so():
    """The brief asks for *your self_attention* against SDPA: a copy of it measured inside
    compare_with_sdpa is another function, and the feedback says to call it by name."""
    report = _grade(_replace_function(SOLUTION, "compare_with_sdpa", MEASURES_A_COPY) + "\n\n_copy = self_attention\n")
    assert report.exercise_scores()["ex9"][0] == 0, report.to_text()
    assert "call it by name" in report.to_text()


def test_an_untiled_forward_that_cleans_nan_takes_no_skip_points():
    """On the code before: lab 04's ex2 35/35 (a seventh attacker) for a forward that builds [L, S] and
    runs ``v.nan_to_num()``, so the NaN of the keys no query sees never reaches an output. Now one NaN at a
    key that later queries attend to must reach them: the skip check fails; ex3's memory cap as before."""
    report = _grade((ATTACKS / "lab04_untiled_forward_cleans_nan.py").read_text(), "flash.py", "04")
    checks = {(r.exercise.id, r.check): r.score for r in report.results}
    assert checks[("ex2", "skips_future_tiles")] == 0 and checks[("ex3", "no_L_by_S")] == 0, report.to_text()
    assert checks[("ex2", "output")] == 12, report.to_text()  # the answers are right: only the skip is taken
    assert "the NaN was cleaned" in report.to_text()  # the one NaN it must keep never reached a query


def test_the_solution_still_scores_100_with_the_recorder_on_in_ex9():
    report = _grade(SOLUTION)
    assert report.score == 100, report.to_text()


# ------------------------------------------------------------------ lab 05: answers traced to the kernels' stores
LAB05 = (ROOT / "labs/track1/05-triton-flash/solutions/flash_triton.py").read_text()
TORCH_ANSWER = '''
def _torch_answer(q, k, v, is_causal):
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    s = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if is_causal:
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(s.shape[-1] - s.shape[-2])
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    return (p / l @ v.float()).to(q.dtype), (m + torch.log(l)).squeeze(-1)
'''
COPY_KERNEL = '''


@triton.jit
def _copy_kernel(SRC, DST, n, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(DST + offs, tl.load(SRC + offs, mask=offs < n, other=0.0), mask=offs < n)
'''
FORWARD_HEAD = '''
def flash_forward(q, k, v, is_causal=False):
    B, H, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(B, H, L, dtype=torch.float32)
'''
FORGERIES = {
    # each required kernel launched once, on one row of one head; the answer is torch's
    "dummy_launch": FORWARD_HEAD + '''
    attn_fwd_kernel[(1, 1)](q, k, v, torch.empty_like(q), torch.empty_like(lse), H, Hkv, 1, S,
                            1.0 / math.sqrt(E), E=E, BQ=BLOCK_Q, BK=BLOCK_K, CAUSAL=is_causal)
    return _torch_answer(q, k, v, is_causal)
''',
    # the kernel writes the first row tile of each head; torch fills in the rest
    "partial_write": FORWARD_HEAD + '''
    attn_fwd_kernel[(1, B * H)](q, k, v, o, lse, H, Hkv, L, S, 1.0 / math.sqrt(E), E=E, BQ=BLOCK_Q, BK=BLOCK_K,
                                CAUSAL=is_causal)
    want_o, want_lse = _torch_answer(q, k, v, is_causal)
    o[:, :, BLOCK_Q:] = want_o[:, :, BLOCK_Q:]
    lse[:, :, BLOCK_Q:] = want_lse[:, :, BLOCK_Q:]
    return o, lse
''',
    # the kernel runs whole, then torch writes its own answer over the kernel's
    "torch_after": FORWARD_HEAD + '''
    attn_fwd_kernel[(triton.cdiv(L, BLOCK_Q), B * H)](q, k, v, o, lse, H, Hkv, L, S, 1.0 / math.sqrt(E), E=E,
                                                      BQ=BLOCK_Q, BK=BLOCK_K, CAUSAL=is_causal)
    want_o, want_lse = _torch_answer(q, k, v, is_causal)
    o.copy_(want_o)
    lse.copy_(want_lse)
    return o, lse
''',
    # the arithmetic in Python on values read out with tolist() (no ATen kernel computes), copied by a kernel of its own
    "python_math": FORWARD_HEAD + '''
    attn_fwd_kernel[(1, 1)](q, k, v, torch.empty_like(q), torch.empty_like(lse), H, Hkv, 1, S,
                            1.0 / math.sqrt(E), E=E, BQ=BLOCK_Q, BK=BLOCK_K, CAUSAL=is_causal)
    qs, ks, vs, out, lses = q.tolist(), k.tolist(), v.tolist(), [], []
    for b in range(B):
        for h in range(H):
            for i in range(L):
                s = [sum(x * y for x, y in zip(qs[b][h][i], ks[b][h // (H // Hkv)][j])) / math.sqrt(E)
                     for j in range(S if not is_causal else i + 1 + S - L)]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                out.append([sum(w[j] * vs[b][h // (H // Hkv)][j][e] for j in range(len(w))) / sum(w)
                            for e in range(E)])
                lses.append(m + math.log(sum(w)))
    want_o, want_lse = torch.tensor(out).reshape(B, H, L, E), torch.tensor(lses).reshape(B, H, L)
    _copy_kernel[(1,)](want_o, o, o.numel(), N=triton.next_power_of_2(o.numel()))
    _copy_kernel[(1,)](want_lse, lse, lse.numel(), N=triton.next_power_of_2(lse.numel()))
    return o, lse
''',
    # no arithmetic of torch's at all: the kernel's own answer, copied by torch into the tensors returned
    "torch_copies_the_kernels_answer": FORWARD_HEAD + '''
    tmp_o, tmp_lse = torch.empty_like(q), torch.empty_like(lse)
    attn_fwd_kernel[(triton.cdiv(L, BLOCK_Q), B * H)](q, k, v, tmp_o, tmp_lse, H, Hkv, L, S, 1.0 / math.sqrt(E), E=E,
                                                      BQ=BLOCK_Q, BK=BLOCK_K, CAUSAL=is_causal)
    o.copy_(tmp_o)
    lse.copy_(tmp_lse)
    return o, lse
''',
}


@pytest.mark.slow
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_lab05_answer_not_stored_by_the_learners_kernels_scores_zero(forgery):
    """On the code before, each of these scored 14/14 in ex1 (a launch was counted; that the answer
    came from it was never checked). Now every element of the answer must be the last store of the
    learner's kernels in that call, with the bytes it holds, and the call may run none of torch's
    arithmetic outside them."""
    source = _replace_function(LAB05, "flash_forward", TORCH_ANSWER + COPY_KERNEL + "\n\n" + FORGERIES[forgery])
    report = _grade(source, "flash_triton.py", "05")
    scores = report.exercise_scores()
    assert not report.problem, report.to_text()
    for ex in ("ex1", "ex2", "ex3"):
        assert scores[ex][0] == 0, (forgery, report.to_text())
    findings = [f for r in report.results if r.exercise.id == "ex1" for f in r.verdict.findings]
    assert {f["code"] for f in findings} == {"kernel_not_launched"}, report.to_text()
    why = findings[0]["message"]
    if forgery == "torch_copies_the_kernels_answer":  # the stores' record alone catches it (read as NaN)
        assert "not stored by your kernels" in why, why
    else:  # torch's arithmetic outside the kernels is named first
        assert "computed with torch outside your kernels" in why, why
    if forgery == "python_math":  # values read into Python are named, as well as the constants made of them
        assert "TensorBase.tolist" in why and "aten.lift_fresh.default" in why, why
    assert scores["ex4"] == (8, 8)  # its own kernel's answer still counts


def test_a_launcher_may_only_allocate_view_copy_and_convert():
    """The allow-list itself: what the four solutions' launchers and the interpreter dispatch passes,
    arithmetic (any of it, not a list of attention's ops) and values read into Python do not."""
    from attnlab.grading.sandbox.launchers import outside_kernels

    honest = ["aten.empty.memory_format", "aten.empty_like.default", "aten.zeros.default", "aten.new_empty.default",
              "aten.copy_.default", "aten.set_.source_Storage", "aten.detach.default", "aten.clone.default",
              "aten._to_copy.default", "aten.expand.default", "aten.view.default", "aten.transpose.int"]
    functions = ["TensorBase.contiguous", "TensorBase.data_ptr", "TensorBase.untyped_storage", "grad"]
    assert outside_kernels(honest, functions) == []
    for op in ("aten.mul.Tensor", "aten.add.Tensor", "aten.amin.default", "aten.where.self", "aten.div.Tensor",
               "aten.lift_fresh.default", "aten.fill_.Scalar", "aten._local_scalar_dense.default", "aten.full.default"):
        assert outside_kernels(honest + [op], functions) == [op]
    for fn in ("TensorBase.tolist", "Tensor.__repr__", "Tensor.__format__"):
        assert outside_kernels(honest, functions + [fn]) == [fn]


@pytest.mark.slow
@pytest.mark.parametrize("lab, file, function", [("04", "flash.py", "TiledAttention"),
                                                 ("05", "flash_triton.py", "TritonAttention")])
def test_the_autograd_exercise_grades_the_function_itself(lab, file, function):
    """A third attacker left the Function a stub and had the given attention_and_grads call the forward
    and backward directly, with made-up saved shapes: 100/100 in both labs on the code before (the child
    called that learner function). Now the child applies the Function itself, checks the output's node
    is that Function's, and reads the shapes its node saved: that file loses the exercise, and a file
    whose attention_and_grads is the old given one ((o * do).sum(): torch's arithmetic) still scores 100."""
    solution = (ROOT / f"labs/track1/{'04-flash-attention' if lab == '04' else '05-triton-flash'}/solutions/{file}")
    text = solution.read_text()
    new = "torch.autograd.grad(o, (q, k, v), grad_outputs=do)"
    old = "torch.autograd.grad((o * do).sum(), (q, k, v))"
    report = _grade(text.replace(new, old), file, lab)
    assert report.score == 100, report.to_text()
    attack = (ATTACKS / f"lab{lab}_no_autograd_function_fake_saved.py").read_text()
    report = _grade(attack, file, lab)
    ex = "ex5" if lab == "04" else "ex6"
    scores = report.exercise_scores()
    assert scores[ex][0] == 0 and report.score == 100 - scores[ex][1], report.to_text()


@pytest.mark.slow
def test_a_kernel_passed_a_python_object_is_no_kernels_answer():
    """The launcher's side of the third attacker's road: a list handed to a kernel (which the static rule
    cannot see, being an argument) is reported by the child at the launch, and the exercise scores 0."""
    source = LAB05.replace("BK: tl.constexpr,\n                    CAUSAL: tl.constexpr):\n    \"\"\"One program",
                           "BK: tl.constexpr,\n                    CAUSAL: tl.constexpr, BOX=None):\n    \"\"\"One program")
    source = source.replace("BK=BLOCK_K,\n                          CAUSAL=is_causal)\n    return o, lse",
                            "BK=BLOCK_K,\n                          CAUSAL=is_causal, BOX=[])\n    return o, lse")
    assert source.count("BOX") == 2
    report = _grade(source, "flash_triton.py", "05")
    scores = report.exercise_scores()
    assert scores["ex1"][0] == 0 and scores["ex4"] == (8, 8), report.to_text()
    why = [f["message"] for r in report.results if r.exercise.id == "ex1" for f in r.verdict.findings]
    assert why and "attn_fwd_kernel's argument BOX: list" in why[0], why


@pytest.mark.slow
def test_a_backward_autograd_computes_and_weights_kept_on_ctx_score_nothing():
    """A sixth attacker, lab 04: flash_backward returned torch.autograd.grad of a naive recompute (ex4 25/25,
    no backward written), and TiledAttention kept its [L, S] weights as ctx.values, never in
    save_for_backward (saves_lse_not_weights 3/3): 100/100. Now the call may not reach autograd (Call.forbid,
    a [policy] finding) and the harness reads the ctx's own attributes too. Its honest ex1-ex3 keep theirs."""
    report = _grade((ATTACKS / "lab04_autograd_backward_and_ctx_weights.py").read_text(), "flash.py", "04")
    scores = report.exercise_scores()
    assert scores["ex4"][0] == 0, report.to_text()
    saves = [r.verdict for r in report.results if r.exercise.id == "ex5" and r.check == "saves_lse_not_weights"]
    assert saves and not saves[0].passed and "[L, S] weights" in saves[0].message, report.to_text()
    codes = {f["code"] for r in report.results if r.exercise.id == "ex4" for f in r.verdict.findings}
    assert codes == {"policy"}, codes


@pytest.mark.slow
def test_an_honest_rewrite_with_type_as_scores_100():
    """Issue 62's independent author: TritonAttention.backward returning dq.type_as(q) (a conversion) was
    refused whole by the static allow-list, 0 points for a correct file."""
    old = "return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None"
    assert old in LAB05
    report = _grade(LAB05.replace(old, "return dq.type_as(q), dk.type_as(k), dv.type_as(v), None"), "flash_triton.py",
                    "05")
    assert report.score == 100, report.to_text()


@pytest.mark.slow
def test_the_lab05_solution_scores_100_with_every_answer_traced_to_its_stores():
    report = _grade(LAB05, "flash_triton.py", "05")
    assert report.score == 100, report.to_text()


# ------------------------------------------------------------------ inputs nobody can rebuild
def _draw(g: torch.Generator) -> torch.Tensor:
    return torch.randn(8, generator=g)


def test_the_seed_stream_has_the_keys_full_width():
    """On the code before, the inputs' generator was torch's manual_seed(seed * 1000 + i), which keeps
    32 bits: seeds 7 and 7 + 2**29 drew identical inputs. Now its whole MT19937 state is a KDF."""
    from attnlab.grading.inputs import inputs_generator, seed_key

    base = _draw(inputs_generator(seed_key(7), "ex1", "d" * 64))
    assert torch.equal(base, _draw(inputs_generator(seed_key(7), "ex1", "d" * 64)))  # reproducible
    for other in (7 + 2**29, 7 + 2**32, 7 + 2**40, 7 + 2**61):
        assert not torch.equal(base, _draw(inputs_generator(seed_key(other), "ex1", "d" * 64))), other
    assert not torch.equal(base, _draw(inputs_generator(seed_key(7), "ex2", "d" * 64)))
    assert not torch.equal(base, _draw(inputs_generator(seed_key(7), "ex1", "e" + "d" * 63)))
    key = bytes(32)
    assert not torch.equal(_draw(inputs_generator(key, "ex1", "")), _draw(inputs_generator(key[:31] + b"\1", "ex1", "")))


def test_two_gradings_of_different_bytes_draw_different_inputs(monkeypatch):
    """A regrade with the same seed of a file with a table of answers added draws other inputs."""
    from attnlab.grading import grader

    drawn: dict[str, list] = {}
    real = grader.inputs_generator

    def spy(key, exercise, digest):
        drawn.setdefault(digest, []).append(_draw(real(key, exercise, digest)))
        return real(key, exercise, digest)

    monkeypatch.setattr(grader, "inputs_generator", spy)
    _grade(SOLUTION, seed=5)
    _grade(SOLUTION + "\n\nTABLE = {'ex1': [0.25, 0.5]}\n", seed=5)
    _grade(SOLUTION, seed=5)
    first, second = list(drawn)
    assert len(drawn[first]) == 24 and len(drawn[second]) == 12  # the first file graded twice: the same inputs
    assert all(torch.equal(a, b) for a, b in zip(drawn[first][:12], drawn[first][12:]))
    assert not any(torch.equal(a, b) for a, b in zip(drawn[first], drawn[second]))


# ------------------------------------------------------------------ what lands in a learner's folder
def _class_folder(tmp_path: Path, entries: dict[str, str]) -> Path:
    folder = tmp_path / "class"
    for rel, text in entries.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


@pytest.mark.subprocess
def test_a_learners_folder_holds_nothing_their_inputs_could_be_derived_from(tmp_path):
    """On the code before, OUT/<learner>/row.json held the learner's seed, and a regrade into the same
    OUT with the same --seed drew the same inputs: a table of precomputed answers scored 100."""
    from attnlab.grading.classroom import batch

    folder = _class_folder(tmp_path, {"ann/attention.py": SOLUTION, "bob.py": SOLUTION})
    out = tmp_path / "out"
    result = batch.grade_class(folder, out, seed=3, sandbox="none", limits=FAST, total_timeout_s=20)
    assert {r.learner: r.total for r in result.rows} == {"ann": 100, "bob": 100}
    for row in result.rows:
        mine = out / row.folder
        assert sorted(p.name for p in mine.iterdir()) == ["feedback.html", "results.json"]
        for path in mine.iterdir():
            text = path.read_text(encoding="utf-8")
            assert str(row.seed) not in text and str(tmp_path) not in text, path  # no seed, no machine path
        assert (out / batch.ROWS_DIR / f"{row.folder}.json").is_file()
    assert (out / batch.PRIVATE_DIR).stat().st_mode & 0o777 == 0o700
    assert (out / batch.CLASS_KEY_FILE).stat().st_mode & 0o777 == 0o600
    data = json.loads((out / "ann" / "results.json").read_text())
    assert data["extra_data"]["file"] == "ann/attention.py"


@pytest.mark.subprocess
def test_an_instructors_hard_linked_backup_costs_no_learner_a_point(tmp_path):
    """On the code before, every file of a class kept beside a `cp -al` backup had 2 links and was
    refused ('submit a copy'): honest learners got 0."""
    from attnlab.grading.classroom import batch

    folder = _class_folder(tmp_path, {"ann/attention.py": SOLUTION, "bob.py": SOLUTION})
    backup = tmp_path / "backup"
    for path in folder.rglob("*.py"):
        target = backup / path.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(path, target)
    assert (folder / "bob.py").stat().st_nlink == 2
    result = batch.grade_class(folder, tmp_path / "out", seed=3, sandbox="none", limits=FAST, total_timeout_s=20)
    assert {r.learner: (r.total, r.status) for r in result.rows} == {"ann": (100, "graded"), "bob": (100, "graded")}


@pytest.mark.parametrize("invisible", ["\u034f", "\u3164", "\u200b", "\u2060", "\ufe0f", "\u115f", "\u00ad"])
def test_two_names_that_look_the_same_are_one_learner_twice(tmp_path, invisible):
    """On the code before, 'bob' and 'bob' + U+034F (or + U+3164) were two rows that both read 'bob'."""
    from attnlab.grading.classroom import batch

    folder = _class_folder(tmp_path, {"bob/attention.py": SOLUTION, f"bob{invisible}/attention.py": SOLUTION,
                                      "carl.py": SOLUTION})
    subs, skipped = batch.find_submissions(folder)
    graded = [s.learner for s in subs]
    assert "carl" in graded and len([n for n in graded if n.startswith("bob")]) <= 1, graded
    if batch.name_problem(f"bob{invisible}") is None:  # past the name rule: both entries go, one learner twice
        assert graded == ["carl"] and all("one learner" in s.reason for s in skipped) and len(skipped) == 2


def test_look_alike_letters_fold_to_one_identity_and_different_names_stay_apart():
    from attnlab.grading.classroom.names import identity

    assert identity("bob") == identity("b\u043eb") == identity("BOB") == identity("bob (1)") == identity("bob\u3164")
    assert identity("José") == identity("Jose\u0301") != identity("Jose")
    assert len({identity(n) for n in ("ann", "anna", "bob", "li wei", "liwei", "José", "Jose", "Zoë")}) == 8


# ------------------------------------------------------------------ fail closed
def _run_child(monkeypatch, tmp_path, limits: dict, broken: bool):
    """One task through the sandbox server's own fork-and-run, in this process, with the seccomp
    install made to fail (fault injection here, in the test): what the child sent back."""
    import dataclasses

    from attnlab.grading.sandbox import protocol, seccomp, server

    if broken:
        def refuse(*args, **kwargs):
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(seccomp, "install_compiled", refuse)
        monkeypatch.setattr(seccomp, "install", refuse)
    marker = tmp_path / "ran"
    path = tmp_path / "attention.py"
    source = f"def f():\n    open({str(marker)!r}, 'w').close()\n    return 1\n".encode()
    server.prepare(interpreter=False)  # what the zygote imports before any child
    server._load(source, str(path))
    request = {"calls": [{"function": "f", "args": (), "kwargs": {}}], "policy": True, "seccomp": "",
               "limits": {**dataclasses.asdict(FAST), **limits}}
    header, payload, _ = server._run_task(server._task(request), str(path), (), False, str(tmp_path))
    return protocol.decode_message(payload), marker.exists()


@pytest.mark.subprocess
def test_no_learner_code_runs_where_the_seccomp_filter_cannot_be_installed(monkeypatch, tmp_path):
    """On the code before, the child swallowed the OSError and ran the learner without the filter."""
    message, ran = _run_child(monkeypatch, tmp_path, {}, broken=True)
    assert message["status"] == "no_filter" and "seccomp filter could not be installed" in message["message"]
    assert not ran and message["results"] == []


@pytest.mark.subprocess
def test_the_instructors_flag_runs_it_unfiltered_and_says_so(monkeypatch, tmp_path):
    message, ran = _run_child(monkeypatch, tmp_path, {"seccomp_optional": True}, broken=True)
    assert message["status"] == "ok" and ran and "seccomp filter" in message["unfiltered"]
    monkeypatch.undo()
    healthy, ran = _run_child(monkeypatch, tmp_path, {}, broken=False)
    assert healthy["status"] == "ok" and ran and "unfiltered" not in healthy


def test_a_child_without_its_filter_is_the_grading_machines_problem_in_every_report():
    from attnlab.grading.sandbox.client import Sandbox
    from attnlab.grading.sandbox.protocol import encode_message

    payload = encode_message({"status": "no_filter", "message": "the sandbox's seccomp filter could not be "
                                                                "installed here (ENOSYS)", "results": [],
                              "violations": []})
    outcome = Sandbox._decode(None, payload, "", 0.1, 1)  # noqa: the decoder uses nothing of the sandbox
    assert outcome.environment and "seccomp" in outcome.environment and not outcome.results


# ------------------------------------------------------------------ an independent attacker's files
ATTACKS = Path(__file__).resolve().parents[1] / "hostile" / "issue61"


@pytest.mark.slow
@pytest.mark.parametrize("name, lab, file", [
    # self_attention = compare_with_sdpa, a global counter telling the two calls apart: ex9's 5 points with
    # SDPA measured against itself on the code before (52 against the honest parts' 47)
    ("ex9_alias_of_the_exempt_function", "01", "attention.py"),
    # Box.T.clone = ... (class Box: T = torch.Tensor) and poke(torch.Tensor, f): stores the rule missed
    ("store_through_a_class_attribute_or_a_parameter", "01", "attention.py"),
    # every answer computed with torch (bmm, exp, amax), each required kernel only copying it: 100/100
    ("lab05_kernels_that_copy_torchs_answer", "05", "flash_triton.py"),
    # compare_with_sdpa keeps SDPA's output in a module-level list, self_attention (called after it in
    # ex9's child) returns it: ex9's 5 points for SDPA measured against itself; self_attention now runs first
    ("ex9_sdpa_output_kept_for_self_attention", "01", "attention.py"),
    # a second attacker: every answer built from mul/add loops, an exp series, a Newton log and -amin(-x) (no op of
    # the deny-list that stood then), each kernel only copying it: 100/100; the launchers' torch is an allow-list now
    ("lab05_kernels_that_copy_a_torch_series_answer", "05", "flash_triton.py"),
    # a third attacker: kernels that append each loaded value (as str(), or bisected by `if`) to a list the launcher
    # passed, attention computed in Python on them, other kernels storing it: 100/100 and 82/100; now the static
    # rule for kernel bodies (grading/kernel_rules.py) refuses the file
    ("lab05_python_attention_via_interpreter_str", "05", "flash_triton.py"),
    ("lab05_python_attention_via_interpreter_bool", "05", "flash_triton.py"),
    # a fourth attacker: a grid function (kernel[grid_fn]) that tl.load-s and tl.store-s every value in Python once
    # the launch has patched tl in, the kernels empty; and values read from a kernel's error text (tl.max(v, v):
    # "axis [<the block>]") caught by try: 100/100 each; now refused on the source (kernel_rules._outside_kernels)
    ("lab05_grid_callable_python_attention", "05", "flash_triton.py"),
    ("lab05_exception_text_channel", "05", "flash_triton.py"),
    # a fifth attacker: a list as a kernel's default (box += [bits]), a list passed as num_warps (skipped by name),
    # and a kernel called through an alias with the interpreter's injected _implicit_cvt: 100, 100 and 8
    ("lab05_default_argument_list", "05", "flash_triton.py"),
    ("lab05_list_as_num_warps", "05", "flash_triton.py"),
    ("lab05_alias_direct_call_injected_global", "05", "flash_triton.py"),
])
def test_an_independent_attackers_files_score_nothing(name, lab, file):
    """Written by an attacker of the grader (a helper given the grader and its claims, after the
    defences above): each got through the code before this test."""
    report = _grade((ATTACKS / f"{name}.py").read_text(), file, lab)
    assert report.score == 0, report.to_text()


@pytest.mark.parametrize("name,lab,file,check", [
    # an eighth attacker (on the code with ex9's planted difference): compare_with_sdpa measured self_attention
    # against the file's own second attention, never SDPA (ex9 5/5); SDPA's answer is now moved too
    ("lab01_ex9_measures_itself_not_sdpa", "01", "attention.py", ("ex9", "returns_max_diff")),
    # flash_backward as a forward rebuilt on leaves and each node's grad_fn(g) called by hand (ex4 25/25); the
    # call now runs under no_grad, so no node is ever made
    ("lab04_backward_by_grad_fn_nodes", "04", "flash.py", ("ex4", "dq_dk")),
    # the [L, S] weights kept as ctx.grad = Keep(p), an instance of the file's own class (ex5 13/13); the harness
    # now opens the file's objects and classes, and the module's globals
    ("lab04_weights_kept_in_own_object_on_ctx", "04", "flash.py", ("ex5", "saves_lse_not_weights")),
    # every key tile visited, the unseen keys' V zeroed by torch.where (lab 04) or masked out of the loads with K's
    # NaN scores dropped by tl.where (lab 05): right outputs, the skip's 4 points; now the child counts the NaN
    # that reached a torch kernel (lab 04, Call.watch_nan) or a kernel's tl.load (lab 05, interpreter.nan_loads)
    ("lab04_visits_future_tiles_zeroes_their_v", "04", "flash.py", ("ex2", "skips_future_tiles")),
    ("lab05_visits_future_tiles_masks_v_load", "05", "flash_triton.py", ("ex2", "skips_future_tiles")),
    # a ninth attacker: each loop stopped at L, not at its block's own last query (the NaN lay only past the last
    # query); every tile visited with K and V cleaned through an int64 view (lab 04) or loaded as int32 bits
    # (lab 05); the backward's tiles visited and masked (lab 05 ex5); the weights saved flattened: 4, 4, 4, 2, 3
    ("lab04_ex2_call_wide_key_bound", "04", "flash.py", ("ex2", "skips_future_tiles")),
    ("lab05_ex2_call_wide_key_bound", "05", "flash_triton.py", ("ex2", "skips_future_tiles")),
    ("lab04_ex2_visits_all_tiles_int_view_clean", "04", "flash.py", ("ex2", "skips_future_tiles")),
    ("lab05_ex2_int_bits_loads_visit_all", "05", "flash_triton.py", ("ex2", "skips_future_tiles")),
    ("lab05_ex5_masks_instead_of_skipping", "05", "flash_triton.py", ("ex5", "skips_masked_tiles")),
    ("lab04_ex5_weights_saved_flattened", "04", "flash.py", ("ex5", "saves_lse_not_weights")),
])
def test_the_later_attackers_files_lose_the_points_they_took(name, lab, file, check):
    report = _grade((ATTACKS / f"{name}.py").read_text(), file, lab)
    scores = {(r.exercise.id, r.check): r.score for r in report.results}
    assert scores[check] == 0, report.to_text()


# ------------------------------------------------------------------ what a kernel may do (kernel_rules)
KERNEL_HEAD = '''
import math
import torch
import triton
import triton.language as tl

BOX = []
SCALE = 0.5


def helper(x):
    return x


@triton.jit
def other(x):
    return x * 2


@triton.jit
def kernel(X, Y, N: tl.constexpr, OBJ):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
'''
KERNEL_ROADS = {
    "append": "    OBJ.append(x)\n",
    "item_store": "    OBJ[0] = x\n",
    "attribute_store": "    OBJ.value = x\n",
    "module_list": "    BOX.append(x)\n",
    "module_list_read": "    y = BOX\n",
    "str": "    s = str(x)\n",
    "python_helper": "    y = helper(x)\n",
    "raise_value": "    raise ValueError(x)\n",
    "assert_value": "    assert False, x\n",
    "try": "    try:\n        y = x\n    except Exception:\n        y = x\n",
    "lambda": "    f = lambda: x\n",
    "comprehension": "    y = [x for _ in range(2)]\n",
    "nested_def": "    def inner():\n        return x\n",
    "math_call": "    y = math.exp(1.0)\n",
    "method": "    y = x.tolist()\n",
    "dict": "    y = {0: x}\n",
    "list_default": None,  # the head's signature with a list default, below
}
LAUNCHER_ROADS = {  # the code around the kernels (a fourth attacker's)
    "tl_outside": "def grid(meta):\n    return tl.load(meta['X'])\n",
    "kernel_called": "def peek(x):\n    return other(x)\n",
    "try": "def read(x):\n    try:\n        return x\n    except Exception as e:\n        return str(e)\n",
    "kernel_alias": "peek = other\n",
    "kernel_passed": "def launch(f):\n    return f\n\n\ndef go():\n    return launch(kernel)\n",
    "injected_global": "def ptr(t):\n    return _implicit_cvt(t)\n",
    "tl_by_name": "from triton.language import constexpr as box\n\n\ndef wrap(x):\n    return box(x)\n",
}


@pytest.mark.parametrize("road", sorted(LAUNCHER_ROADS))
def test_the_code_around_kernels_cannot_run_them_in_python(road):
    from attnlab import labs
    from attnlab.grading.static import check_source

    lab = labs.find_lab("05")
    source = KERNEL_HEAD + "    tl.store(Y + offs, x)\n\n\n" + LAUNCHER_ROADS[road]
    report = check_source(source, "flash_triton.py", lab.allowed_names, lab.modules, lab.decorators)
    assert [v for v in report.violations if v.function != "kernel"], road
    clean = check_source(KERNEL_HEAD + "    tl.store(Y + offs, x)\n", "flash_triton.py", lab.allowed_names, lab.modules,
                         lab.decorators)
    assert not clean.violations, clean.violations  # the control


@pytest.mark.slow
def test_a_grid_that_is_not_numbers_is_no_kernels_answer():
    """A grid function runs in Python with tl patched in: the launch is reported, the exercise scores 0."""
    source = LAB05.replace("    grid = (triton.cdiv(L, BLOCK_Q), B * H)\n",
                           "    grid = lambda meta: (triton.cdiv(L, BLOCK_Q), B * H)\n")
    assert source != LAB05
    report = _grade(source, "flash_triton.py", "05")
    scores = report.exercise_scores()
    assert scores["ex1"][0] == 0 and scores["ex4"] == (8, 8), report.to_text()
    why = [f["message"] for r in report.results if r.exercise.id == "ex1" for f in r.verdict.findings]
    assert why and "attn_fwd_kernel's grid: function" in why[0], why


def _kernel_refusals(body: str) -> list:
    from attnlab import labs
    from attnlab.grading.static import check_source

    lab = labs.find_lab("05")
    head = KERNEL_HEAD if body is not None else KERNEL_HEAD.replace("OBJ):", "OBJ=BOX):")
    source = head + (body or "") + "    tl.store(Y + offs, other(x) * SCALE)\n"
    report = check_source(source, "flash_triton.py", lab.allowed_names, lab.modules, lab.decorators)
    return [v for v in report.violations if v.function == "kernel"]


@pytest.mark.parametrize("road", sorted(KERNEL_ROADS))
def test_a_kernel_cannot_carry_a_value_out_to_python(road):
    """Each construct by which a kernel under the interpreter hands a value to Python (the third attacker
    appended str() of each loaded value to a list its launcher passed) is refused on the source, with its
    line; Triton's compiler refuses them all on a GPU."""
    assert _kernel_refusals(KERNEL_ROADS[road]), road


def test_a_kernel_of_loads_arithmetic_stores_and_jit_helpers_is_allowed():
    """The control: the head and tail above alone (a numeric constant, another kernel, tl's functions,
    .to(), range, the stub's raise) is no refusal, and neither are the four solutions (their grading
    tests score them 100)."""
    body = ("    for i in range(0, N, 1):\n        x = x + tl.exp(x.to(tl.float32)) * min(1.0, SCALE)\n"
            "    if N > 1:\n        raise NotImplementedError(\"TODO(ex1)\")\n")
    assert _kernel_refusals(body) == []
