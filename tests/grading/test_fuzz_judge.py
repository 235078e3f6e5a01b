"""The fuzz tier past the sandbox's door (issue 61): what learner code returns and prints,
generated, through the real child; whole classes; the files a learner can hand in; labs 01-05.

Properties, whatever hypothesis makes:

* **what leaves the child is the value's bytes, and nothing of the learner's runs after their
  function returned**: tensor subclasses with ``__torch_function__``, objects whose ``__class__``
  lies, subclasses of str/int/float/list/dict, NaN and huge payloads, views, tensors that need a
  gradient, nesting past the limit, torch's methods rebound to print and return garbage. The
  learner's function prints ``END`` as its last act and every hook prints ``HOOK``: no ``HOOK``
  may follow ``END``; the grader sees each plain value exactly (NaN for NaN), and anything else
  as unsupported;
* **a whole class**: each learner's score depends only on their own file (the solution scores
  100 and the stub 0 beside any third learner); a learner's folder holds ``results.json`` and
  ``feedback.html`` and no seed; every graded name is distinct to the eye; nothing printed holds
  a control or bidi character;
* **what a learner hands in** (hard links, device files, sparse files, FIFOs, symbolic links) is
  read or refused with a reason, never another exception, and never more than the cap is read;
* **labs 01-05**: any exercise function replaced by one that returns a hostile value loses its
  exercise's points (all but a check of a constant beside it), and the grade never raises.

Unlike the rest of the suite, these draw new examples on every run: the seed is printed in
pytest's header (``fuzz seed: N``), and ``ATTNLAB_FUZZ_SEED=N`` replays a run.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from attnlab import labs
from attnlab.grading import Limits, grade
from attnlab.grading.output import UNSAFE
from attnlab.grading.sandbox import Call
from attnlab.grading.submission import Unreadable, read_submission

from helpers import hostile_inputs as hi
from helpers.ci import fuzz_seed
from helpers.procs import needs_sandbox
from test_fuzz_intake import assert_clean_output

ROOT = Path(__file__).resolve().parents[2]
FUZZ_SEED = fuzz_seed()
FAST = Limits(timeout_s=3.0)
LARGE = 10 if os.environ.get("HYPOTHESIS_PROFILE") == "large" else 1  # make test-large: ten times as many


def fuzz(examples: int) -> settings:
    """New examples each run from :data:`FUZZ_SEED` (printed in pytest's header), ``examples`` of them."""
    return settings(derandomize=False, deadline=None, print_blob=True, database=None,
                    max_examples=examples * LARGE,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])

# ------------------------------------------------------------------ what learner code returns
CHILD = r'''
import json
import torch


def hook(*args, **kwargs):
    print("HOOK", flush=True)
    return torch.zeros(1)


class Sub(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        print("HOOK", flush=True)
        return super().__torch_function__(func, types, args, kwargs or {})


class Liar:
    @property
    def __class__(self):
        print("HOOK", flush=True)
        return torch.Tensor

    def __repr__(self):
        print("HOOK", flush=True)
        return "tensor([1.])"

    __str__ = __repr__

    def __len__(self):
        print("HOOK", flush=True)
        return 1


class StrSub(str):
    def __str__(self):
        print("HOOK", flush=True)
        return "forged"

    def __getitem__(self, i):
        print("HOOK", flush=True)
        return "forged"


class IntSub(int):
    def __repr__(self):
        print("HOOK", flush=True)
        return "0"


class ListSub(list):
    def __iter__(self):
        print("HOOK", flush=True)
        return iter([])

    def __getitem__(self, i):
        print("HOOK", flush=True)
        return []


class DictSub(dict):
    def items(self):
        print("HOOK", flush=True)
        return []


FILLS = {"randn": lambda n: torch.randn(n), "nan": lambda n: torch.full((n,), float("nan")),
         "huge": lambda n: torch.full((n,), 3.0e38), "inf": lambda n: torch.full((n,), float("-inf")),
         "tiny": lambda n: torch.full((n,), 1e-45)}


def build(spec):
    kind = spec[0]
    if kind == "tensor":
        _, shape, dtype, fill = spec
        n = 1
        for d in shape:
            n *= d
        return FILLS[fill](n).reshape(shape).to(getattr(torch, dtype))
    if kind == "view":
        t = build(spec[1])
        return t.transpose(0, -1) if t.dim() > 1 else t[::2]
    if kind == "grad":
        t = build(spec[1])
        return (t.float() * 1.0).requires_grad_(True) * 2 if t.is_floating_point() else t
    if kind == "subclass":
        return build(spec[1]).as_subclass(Sub)
    if kind == "liar":
        return Liar()
    if kind == "strsub":
        return StrSub(spec[1])
    if kind == "intsub":
        return IntSub(spec[1])
    if kind == "listsub":
        return ListSub(build(s) for s in spec[1])
    if kind == "dictsub":
        return DictSub({k: build(s) for k, s in spec[1].items()})
    if kind == "list":
        return [build(s) for s in spec[1]]
    if kind == "tuple":
        return tuple(build(s) for s in spec[1])
    if kind == "dict":
        return {k: build(s) for k, s in spec[1].items()}
    if kind == "deep":
        value = 1
        for _ in range(spec[1]):
            value = [value]
        return value
    return spec[1]  # "plain": a JSON value as it is


def make(spec_json, patch):
    torch.manual_seed(0)  # the test builds the same values with the same seed
    value = build(json.loads(spec_json))
    if patch:  # torch's own methods rebound, as a file past the static rule could
        for name in ("detach", "clone", "cpu", "contiguous", "numpy", "reshape", "view", "tolist", "__repr__",
                     "__reduce_ex__", "element_size", "data_ptr", "stride"):
            setattr(torch.Tensor, name, hook)
    print("END", flush=True)
    return value
'''

SHAPES = st.lists(st.integers(1, 4), min_size=1, max_size=3)
TENSOR = st.tuples(st.just("tensor"), SHAPES, st.sampled_from(["float32", "float64", "bfloat16", "float16"]),
                   st.sampled_from(["randn", "nan", "huge", "inf", "tiny"])).map(list)
HOSTILE_STR = st.lists(st.sampled_from(list("ab \n") + hi.HOSTILE_TEXT), max_size=6).map("".join)
PLAIN = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), HOSTILE_STR,
                  st.floats(allow_nan=True, allow_infinity=True)).map(lambda v: ["plain", v])
LEAF = st.one_of(TENSOR, TENSOR.map(lambda t: ["view", t]), TENSOR.map(lambda t: ["grad", t]),
                 TENSOR.map(lambda t: ["subclass", t]), st.just(["liar"]), HOSTILE_STR.map(lambda s: ["strsub", s]),
                 st.integers(0, 9).map(lambda n: ["intsub", n]), PLAIN, st.integers(3, 9).map(lambda n: ["deep", n]))
KEYS = st.lists(st.sampled_from(list("kx") + hi.HOSTILE_TEXT[:2]), min_size=1, max_size=3).map("".join)
SPEC = st.recursive(LEAF, lambda inner: st.one_of(
    st.lists(inner, max_size=4).map(lambda xs: ["list", xs]),
    st.lists(inner, max_size=4).map(lambda xs: ["tuple", xs]),
    st.dictionaries(KEYS, inner, max_size=3).map(lambda d: ["dict", d]),
    st.lists(inner, max_size=2).map(lambda xs: ["listsub", xs]),
    st.dictionaries(KEYS, inner, max_size=2).map(lambda d: ["dictsub", d])), max_leaves=6)


def expected(spec, depth: int = 0):
    """What the grader must see for ``spec`` (:func:`attnlab.grading.sandbox.server._portable`'s
    rules): ``("unsupported",)`` for anything whose type is not exactly a plain one."""
    kind = spec[0]
    if depth > 5:
        return ("unsupported",)
    if kind in ("tensor", "view", "grad"):
        return ("tensor", spec)
    if kind in ("subclass", "liar", "strsub", "intsub", "listsub", "dictsub"):
        return ("unsupported",)
    if kind in ("list", "tuple"):
        items = [expected(s, depth + 1) for s in spec[1][:64]]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k[:200]: expected(s, depth + 1) for k, s in list(spec[1].items())[:64]}
    if kind == "deep":
        return _deep(spec[1], depth)
    return ("plain", spec[1])


def _deep(n: int, depth: int):
    if depth > 5:
        return ("unsupported",)
    return ("plain", 1) if n == 0 else [_deep(n - 1, depth + 1)]


def _same_tensor(got, want: torch.Tensor) -> bool:
    return (isinstance(got, torch.Tensor) and type(got) is torch.Tensor and got.dtype == want.dtype
            and got.shape == want.shape and torch.equal(got.isnan(), want.isnan())
            and torch.equal(got.nan_to_num(0.0, 0.0, 0.0), want.nan_to_num(0.0, 0.0, 0.0)))


def check(got, want, built, path="value") -> None:
    from attnlab.grading.sandbox import Unsupported, clean_text

    if isinstance(want, tuple) and want[:1] == ("unsupported",):
        assert isinstance(got, Unsupported), f"{path}: {got!r} should be unsupported"
    elif isinstance(want, tuple) and want[:1] == ("tensor",):
        assert _same_tensor(got, built.detach()), f"{path}: {got!r} is not {built!r}"
    elif isinstance(want, tuple) and want[:1] == ("plain",):
        v = want[1]
        if isinstance(v, str):
            v = clean_text(v[:4000])
        assert (got == v) or (isinstance(v, float) and math.isnan(v) and math.isnan(got)), f"{path}: {got!r} != {v!r}"
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{path}: {got!r}"
        for i, (g, w, b) in enumerate(zip(got, want, built)):
            check(g, w, b, f"{path}[{i}]")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{path}: {got!r}"
        for k in want:
            check(got[k], want[k], built[k], f"{path}[{k!r}]")


@pytest.fixture(scope="module")
def child_box(tmp_path_factory):
    from attnlab.grading.sandbox import Sandbox

    path = tmp_path_factory.mktemp("fuzz-child") / "attention.py"
    path.write_text(CHILD)
    with Sandbox(path, FAST, mode="none") as box:
        yield box


def _build_here(spec):
    """The same value built in this process (no patching, the same seed), for comparing tensors."""
    namespace: dict = {}
    exec(compile(CHILD, "<child>", "exec"), namespace)  # the test's own text, not a learner's
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return namespace["build"](spec)


@pytest.mark.subprocess
@seed(FUZZ_SEED)
@fuzz(60)
@given(spec=SPEC, patch=st.booleans())
def test_what_leaves_the_child_is_the_values_bytes_and_no_learner_code_runs_after_it_returns(child_box, spec, patch):
    """Seeded tensors: the child builds with torch.manual_seed(0) too, so both sides hold the same values."""
    spec_json = json.dumps(spec)
    outcome = child_box.run([Call("make", (spec_json, patch))], policy=False)
    assert outcome.status == "ok", (FUZZ_SEED, outcome.status, outcome.message)
    after = outcome.output.split("END", 1)[1] if "END" in outcome.output else ""
    assert "HOOK" not in after, (FUZZ_SEED, spec, outcome.output[-400:])
    assert not UNSAFE.search(outcome.output), outcome.output[-200:]
    check(outcome.results[0]["value"], expected(spec), _build_here(spec))


# ------------------------------------------------------------------ a whole class
SOLUTION01 = (ROOT / "labs/track1/01-attention/solutions/attention.py").read_text()
STUB01 = (ROOT / "labs/track1/01-attention/attention.py").read_text()
EX01 = [ex.function for ex in labs.find_lab("01").exercises()]
# return values a file past the static rule may write: each is a value no exercise accepts
RETURNS = st.sampled_from([
    "torch.full((2, 3), float('nan'))", "[1, 2, 3]", "{'naive': 1}", "'\\x1b]0;owned\\x07' * 300", "None",
    "torch.zeros(0)", "(torch.ones(2), torch.ones(2))", "[[[[[[[1]]]]]]]", "torch.full((3,), 3e38)",
    "torch.ones(2, 2).bool()"])
RAISES = st.sampled_from(["ValueError('\\x1b[2J\\u202e' * 50)", "RuntimeError('x' * 100000)", "KeyError(0)"])
NAMES = st.sampled_from(["eve", "ann\u034f", "b\u043eb", "carl\u3164", "Eve (2)", "\u202eeve", "eve\u200b",
                         "zoë", "ANN", "dave"])


@st.composite
def third_learner(draw) -> tuple[str, str]:
    """A third learner's name (invisible code points, look-alikes, bidi) and file: the solution with
    one exercise function replaced by one that returns a hostile value, raises hostile text, or
    prints it."""
    function = draw(st.sampled_from(EX01))
    how = draw(st.sampled_from(["return", "raise", "print"]))
    body = {"return": f"    return {draw(RETURNS)}", "raise": f"    raise {draw(RAISES)}",
            "print": "    print('\\x1b]0;owned\\x07\\u202e' * 500)\n    return None"}[how]
    start = SOLUTION01.index(f"def {function}(")
    end = SOLUTION01.index("\n\n\n", start)
    return draw(NAMES), SOLUTION01[:start] + f"def {function}(*args, **kwargs):\n{body}" + SOLUTION01[end:]


@pytest.mark.sandbox
@pytest.mark.subprocess
@seed(FUZZ_SEED)
@fuzz(6)
@given(third=third_learner())
def test_each_learners_score_depends_only_on_their_own_file(third):
    from attnlab.grading.classroom import batch
    from attnlab.grading.classroom.names import identity

    needs_sandbox()
    name, text = third
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "class"
        for learner, body in (("ann", SOLUTION01), ("bob", STUB01), (name, text)):
            (folder / learner).mkdir(parents=True)
            (folder / learner / "attention.py").write_text(body)
        out = Path(tmp) / "out"
        result = batch.grade_class(folder, out, seed=FUZZ_SEED, limits=FAST, total_timeout_s=30, jobs=2)
        totals = {r.learner: r.total for r in result.rows}
        if identity(name) != identity("ann"):
            assert totals["ann"] == 100, (FUZZ_SEED, name, totals)
        if identity(name) != identity("bob"):
            assert totals["bob"] == 0, (FUZZ_SEED, name, totals)
        assert len({identity(r.learner) for r in result.rows}) == len(result.rows), [r.learner for r in result.rows]
        for row in result.rows:
            mine = out / row.folder
            assert sorted(p.name for p in mine.iterdir()) == ["feedback.html", "results.json"], row.folder
            assert not any(str(row.seed) in p.read_text(encoding="utf-8") for p in mine.iterdir())
            assert tmp not in (mine / "results.json").read_text(encoding="utf-8")
        assert_clean_output(out)


# ------------------------------------------------------------------ what a learner hands in
KINDS = st.sampled_from(["hard_link", "sparse", "device", "fifo", "symlink", "plain", "empty", "huge_line"])


@pytest.mark.subprocess
@seed(FUZZ_SEED)
@fuzz(40)
@given(kind=KINDS, name=st.sampled_from(["attention.py", "a b.py", "\u202e.py", "x" * 200 + ".py"]),
       size=st.integers(0, 3 * 2**20))
def test_what_a_learner_hands_in_is_read_or_refused_with_a_reason(kind, name, size):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "class"
        folder.mkdir()
        path = folder / name
        if kind == "hard_link":
            other = Path(tmp) / "backup.py"
            other.write_bytes(b"x = 1\n" * (size // 6 % 1000))
            os.link(other, path)
        elif kind == "sparse":
            with open(path, "wb") as f:
                f.truncate(size * 4096)  # a hole up to 12 GiB: no byte of it is ever read
        elif kind == "device":
            path.symlink_to("/dev/zero")
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink":
            path.symlink_to(ROOT / "labs/track1/01-attention/solutions/attention.py")
        elif kind == "huge_line":
            path.write_bytes(b"#" * size)
        else:
            path.write_bytes(b"x = 1\n" * (size // 6 % 5000) if kind == "plain" else b"")
        try:
            data = read_submission(path, within=folder)
        except Unreadable as exc:
            assert str(exc), kind
            assert kind in ("sparse", "device", "fifo", "symlink", "huge_line"), (FUZZ_SEED, kind, exc)
            return
        assert kind in ("hard_link", "plain", "empty", "sparse", "huge_line"), (FUZZ_SEED, kind)
        assert len(data.data) <= 2**20


# ------------------------------------------------------------------ labs 01-05
LAB_CASES = [(lab.name, function) for lab in labs.LABS for function in dict.fromkeys(ex.function
                                                                                     for ex in lab.exercises())]


@pytest.mark.slow
@pytest.mark.subprocess
@seed(FUZZ_SEED)
@fuzz(8)
@given(case=st.sampled_from(LAB_CASES), value=RETURNS)
def test_in_every_lab_a_function_that_returns_a_hostile_value_scores_nothing(case, value):
    name, function = case
    lab = labs.find_lab(name)
    solution = (ROOT / "labs/track1" / lab.name / "solutions" / lab.file).read_text().rstrip("\n") + "\n"
    # an exercise's function, or its class (lab 04 ex5 and lab 05 ex6 grade the autograd Function itself)
    start = solution.index(f"def {function}(") if f"def {function}(" in solution else solution.index(f"class {function}(")
    end = solution.find("\n\n\n", start)
    end = len(solution) - 1 if end < 0 else end
    source = solution[:start] + f"def {function}(*args, **kwargs):\n    return {value}" + solution[end:]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / lab.file
        path.write_text(source)
        report = grade(path, lab=lab, sandbox="none", seed=FUZZ_SEED, limits=FAST, total_timeout_s=60)
    own = [r for r in report.results if r.exercise.function == function]
    # its exercises lose the points of every check that reads it (a check of a constant beside it, lab 01's
    # EXERCISE_2_ANSWER, still counts: CI's fuzz seed 3520220067 found an 'all zero' property wrong)
    assert own and sum(r.score for r in own) < sum(r.max_score for r in own), \
        (FUZZ_SEED, lab.name, function, value, report.to_text()[-1500:])
    assert not UNSAFE.search(report.to_text()), (FUZZ_SEED, lab.name, function)
