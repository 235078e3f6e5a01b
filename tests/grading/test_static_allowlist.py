"""The from-scratch rule as an allow-list (issue 23): constructs, builtins and names that are
not on the lab's lists are refused with their line, so the five ways a stub reached arbitrary
code past the old deny-list are refused without a rule written for each; every lab's solution
and stubs pass, and each lab's own names are ones its files use."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from attnlab import labs
from attnlab.grading.static import ALLOWED_BUILTINS, COMMON_ATTRIBUTES, check_source

TRACK = Path(__file__).resolve().parents[2] / "labs" / "track1"
SOLUTION = (TRACK / "01-attention/solutions/attention.py").read_text()
NAMES = labs.find_lab("01").allowed_names

BYPASSES = [  # (the attack, the line it is on in the function, words of the refusal)
    ("string_annotation", '''
def project_qkv(X: "print(1)", W_Q, W_K, W_V):
    import typing
    typing.get_type_hints(project_qkv)
''', 2, "a string annotation"),
    ("get_type_hints", '''
def project_qkv(X, W_Q, W_K, W_V):
    import typing
    return typing.get_type_hints(project_qkv)
''', 4, ".get_type_hints reaches"),
    ("pickle_through_serialization", '''
def project_qkv(X, W_Q, W_K, W_V):
    return torch.serialization.pickle.loads(b"x")
''', 3, ".serialization reaches"),
    ("match_class_pattern", '''
def project_qkv(X, W_Q, W_K, W_V):
    match torch:
        case object(sys=s):
            return s
''', 3, "a match statement"),
    ("getattr_alias", '''
def project_qkv(X, W_Q, W_K, W_V):
    g = getattr
    return g(torch, "o" + "ps")
''', 3, "the builtin getattr is not among"),
    ("shared_object", '''
def project_qkv(X, W_Q, W_K, W_V):
    torch.zeros(8).numpy().tofile("/tmp/x.so")
    torch.ops.load_library("/tmp/x.so")
''', 3, ".numpy reaches"),
    ("load_library", '''
def project_qkv(X, W_Q, W_K, W_V):
    torch.ops.load_library("/tmp/x.so")
''', 3, ".ops reaches"),
    ("type_of_object", '''
def project_qkv(X, W_Q, W_K, W_V):
    return type(X).mro()
''', 3, "the builtin type is not among"),
    ("unlisted_name", '''
def project_qkv(X, W_Q, W_K, W_V):
    return torch.cuda.is_available()
''', 3, ".cuda is not among the names this lab allows"),
    ("from_import", '''
from torch.serialization import pickle
''', 2, "reaches serialization"),
]


@pytest.mark.parametrize("name,attack,line,words", BYPASSES, ids=[b[0] for b in BYPASSES])
def test_a_way_past_the_old_check_is_refused_with_its_line(name, attack, line, words):
    prefix = SOLUTION + "\n\n# ---- hostile part ----\n"
    source = prefix + attack
    offset = prefix.count("\n")  # the attack's line n (its first, empty line is 1) is offset + n
    report = check_source(source, "attention.py", NAMES)
    hits = [v for v in report.violations if words in v.message]
    assert hits and any(v.line == offset + line for v in hits), [str(v) for v in report.violations]
    assert report.refusals({"compare_with_sdpa"})  # anywhere in the file: the whole file is refused


@pytest.mark.parametrize("lab", labs.LABS, ids=lambda lab: lab.name)
def test_the_solution_and_the_stubs_pass(lab):
    for path in (TRACK / lab.name / lab.file, TRACK / lab.name / "solutions" / lab.file):
        report = check_source(path.read_bytes(), path.name, lab.allowed_names, lab.modules, lab.decorators)
        assert [v for v in report.violations if v.kind != "attention"] == [], [str(v) for v in report.violations]


@pytest.mark.parametrize("lab", labs.LABS, ids=lambda lab: lab.name)
def test_each_labs_own_names_are_used_by_its_files(lab):
    """The lab-specific list is as small as its files allow: every name on it is used."""
    used = set()
    for path in (TRACK / lab.name / lab.file, TRACK / lab.name / "solutions" / lab.file):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.alias):
                used.update(node.name.split("."))
    assert set(lab.allowed_names) <= used, set(lab.allowed_names) - used
    assert not set(lab.allowed_names) & COMMON_ATTRIBUTES  # declared once


def test_another_labs_names_are_not_allowed():
    """Lab 04's autograd names are lab 04's: in lab 01 they are refused."""
    source = "import torch\n\ndef project_qkv(X, W_Q, W_K, W_V):\n    return torch.autograd.grad(X, W_Q)\n"
    assert any(".autograd is not among" in v.message for v in check_source(source, "attention.py", NAMES).violations)
    assert not check_source(source, "flash.py", labs.find_lab("04").allowed_names).violations


def test_allowed_builtins_hold_nothing_that_reaches_the_interpreter():
    assert not ALLOWED_BUILTINS & {"getattr", "setattr", "type", "object", "vars", "globals", "eval", "exec",
                                   "compile", "open", "__import__", "help", "input", "memoryview", "breakpoint"}


# --------------------------------------------------------------------------- lab 05: Triton's names
TRITON_LAB = labs.find_lab("05")
KERNEL = """
import triton
import triton.language as tl


@triton.jit
def kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, tl.exp(tl.load(X + i, mask=i < N, other=0.0)))
"""


def _lab05(source: str) -> list[str]:
    report = check_source(source, "flash_triton.py", TRITON_LAB.allowed_names, TRITON_LAB.modules,
                          TRITON_LAB.decorators)
    return [str(v) for v in report.violations]


def test_a_plain_triton_kernel_passes_lab05_and_no_other_lab():
    assert _lab05(KERNEL) == []
    refused = [str(v) for v in check_source(KERNEL, "attention.py", labs.find_lab("04").allowed_names).violations]
    assert any("import of 'triton'" in v for v in refused) and any("@triton.jit" in v for v in refused), refused


@pytest.mark.parametrize("line,why", [
    ("tl.inline_asm_elementwise('mov', '=r', [x], dtype=tl.float32, is_pure=True, pack=1)", "assembly"),
    ("tl.extra.cuda.libdevice.exp(x)", "extern"),
    ("triton.runtime.driver.active", "launchers"),
    ("triton.compiler.compile", "compiles"),
    ("tl.atomic_add(X, x)", "not among the triton.language names"),
    ("tl.device_print('x', x)", "prints"),
    ("tl.softmax(x)", "softmax"),
])
def test_triton_names_that_reach_outside_are_refused_with_the_line(line, why):
    source = KERNEL + f"\n\ndef helper(X):\n    x = tl.load(X)\n    return {line}\n"
    found = _lab05(source)
    assert any(why in v and f"line {len(KERNEL.splitlines()) + 5}" in v for v in found), found


@pytest.mark.parametrize("source", [
    "import triton.language as tl\ntl = __import__('os')\n",  # rebinding the alias: judged as any name
    "import torch\nimport triton.language as tl\n\n\ndef f():\n    tl = torch\n    return tl.load('x.pt')\n",
    "import triton\nfrom triton import runtime\n",
    "import triton.runtime\n",
    "from triton.language import inline_asm_elementwise\n",
])
def test_the_triton_allow_list_cannot_be_sidestepped(source):
    assert _lab05(source), source
