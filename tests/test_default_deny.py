"""Issue 30: the grader by default-deny. One hostile test per attack class of the third
hostile round, each shown to fail on the code before this issue (the commit message and the
closing note say how): the rule on everything that runs, one read of the submission, no
link or FIFO followed, no reachable unfiltered process, an allow-list seccomp filter, CPU
counted where it is spent, and total functions on hostile input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from attnlab import labs
from attnlab.grading import Limits, grade
from attnlab.grading.static import check_source

TRACK = Path(__file__).resolve().parents[1] / "labs" / "track1"
STUB = (TRACK / "01-attention/attention.py").read_text()
SOLUTION = (TRACK / "01-attention/solutions/attention.py").read_text()
NAMES = labs.find_lab("01").allowed_names
FAST = Limits(timeout_s=2.0)

# ------------------------------------------------------------------ 1. the rule on everything that runs
# Each runs torch's softmax (or file code that could) at import, outside every exercise's function.
IMPORT_TIME = {
    "module_level_call": '''
def make():
    return torch.softmax
SM = make()
def stable_softmax(x, dim=-1):
    return SM(x, dim)
''',
    "class_body": '''
def make():
    return torch.softmax
class Holder:
    sm = make()
''',
    "decorator": '''
def deco(f):
    return torch.softmax
@deco
def stable_softmax(x, dim=-1):
    return x
''',
    "default_argument": '''
def make():
    return torch.softmax
def stable_softmax(x, dim=-1, sm=make()):
    return sm(x, dim)
''',
    "default_with_the_violation_itself": '''
def stable_softmax(x, dim=-1, sm=torch.softmax):
    return sm(x, dim)
''',
    "module_getattr": '''
def __getattr__(name):
    return torch.softmax
''',
    "set_name_hook": '''
class Hook:
    def __set_name__(self, owner, name):
        torch.softmax(torch.zeros(2), 0)
class Owner:
    h = Hook()
''',
    "init_subclass_hook": '''
class Base:
    def __init_subclass__(cls):
        torch.softmax(torch.zeros(2), 0)
class Child(Base):
    pass
''',
    "lambda_alias_called_at_import": '''
f = lambda: torch.zeros(2)
y = f()
''',
    "renamed_main_guard": '''
__name__ = "__main__"
def make():
    return torch.softmax
if __name__ == "__main__":
    SM = make()
''',
    "dict_decorator_runs_a_static_keys": '''
@dict
class C:
    @staticmethod
    def keys():
        return []
''',
}


@pytest.mark.parametrize("name", sorted(IMPORT_TIME))
def test_code_that_runs_at_import_costs_the_whole_file(name):
    report = check_source(STUB + "\n" + IMPORT_TIME[name], "attention.py", NAMES)
    assert report.module_level(), (name, [str(v) for v in report.violations])


def test_honest_module_level_code_still_passes():
    honest = '''
NEG = float("-inf")
SCALE = 1 / math.sqrt(64)
class Function(torch.autograd.Function):
    """docs"""
    @staticmethod
    def forward(ctx, x):
        return x
if __name__ == "__main__":
    print(stable_softmax(torch.zeros(3)))
'''
    report = check_source(STUB + "\n" + honest, "attention.py", NAMES + ("autograd", "Function"))
    assert report.violations == [], [str(v) for v in report.violations]


def test_a_stub_that_runs_softmax_at_import_scores_nothing(tmp_path):
    """The round's 43/100: an empty stub whose module-level call reached torch's softmax."""
    path = tmp_path / "attention.py"
    path.write_text(SOLUTION.replace("def stable_softmax(", "def _unused_(") + '''

def make():
    return getattr(torch, "softmax")
SM = make()
def stable_softmax(x, dim=-1):
    return SM(x, dim)
''')
    report = grade(path, limits=FAST, sandbox="none")
    assert report.score == 0, report.to_text()
    assert "module level" in report.problem and "make" in report.problem, report.problem


def test_a_deeply_nested_file_is_refused_not_a_traceback(tmp_path):
    source = STUB + "\nX = " + "+".join(["1"] * 1500) + "\n"
    report = check_source(source, "attention.py", NAMES)  # the walk is iterative: no RecursionError
    assert report.syntax_error == "" and report.violations == []
    deeper = STUB + "\nX = " + "(" * 5000 + "1" + ")" * 5000 + "\n"
    refused = check_source(deeper, "attention.py", NAMES)
    assert refused.syntax_error, "5000 nested parentheses are beyond the parser: refused with a reason"
    path = tmp_path / "attention.py"
    path.write_text(STUB + "\ndef f():\n    return " + "+".join(["1"] * 1500) + "\n")
    graded = grade(path, limits=FAST, sandbox="none")
    assert graded.max_score > 0 and json.dumps(graded.to_gradescope())
