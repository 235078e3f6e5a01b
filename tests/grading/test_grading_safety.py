"""The grader's safety features that are not about one hostile file: the static
from-scratch check, the seed, results.json under interruption, and life without bwrap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnlab import labs

from attnlab.grading import Limits, grade
from attnlab.grading.sandbox import pool
from attnlab.grading.static import check_source
from helpers.procs import own_processes

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

LAB = Path(__file__).resolve().parents[2] / "labs/track1/01-attention"
SOLUTION = (LAB / "solutions/attention.py").read_text()
STUB = (LAB / "attention.py").read_text()
FAST = Limits(timeout_s=2.0)


# --------------------------------------------------------------------------- the static check
@pytest.mark.parametrize("code,line,words", [
    ("import os", 1, "import of 'os'"),
    ("import attnlab.functional", 1, "import of 'attnlab.functional'"),
    ("from attnlab import masks", 1, "import of 'attnlab'"),
    ("from . import helper", 1, "relative import"),
    ("x = 1\ny = __import__('os')", 2, "__import__ is not allowed"),
    ("def f():\n    return eval('1')", 2, "eval is not allowed"),
    ("def f():\n    exec('x = 1')", 2, "exec is not allowed"),
    ("def f():\n    return compile('1', 'f', 'eval')", 2, "compile is not allowed"),
    ("def f():\n    return open('/etc/passwd').read()", 2, "open is not allowed"),
    ("def f(name):\n    return getattr(torch, name)", 2, "not a literal string"),
    ("def f():\n    return getattr(torch, 'softmax')", 2, "torch's softmax"),
    ("def f():\n    return ().__class__", 2, "private and dunder"),
    ("def f():\n    return torch._C", 2, "private and dunder"),
    ("def f():\n    return torch.sys.modules", 2, ".sys leads out of torch"),
    ("def f(x):\n    return x.softmax(-1)", 2, "torch's softmax"),
    ("def f(x):\n    return torch.nn.functional.log_softmax(x, -1)", 2, "torch's softmax"),
    ("from torch.nn.functional import softmax as s", 1, "import of softmax"),
    ("def f(q, k, v):\n    return torch.nn.functional.scaled_dot_product_attention(q, k, v)", 2,
     "scaled_dot_product"),
    ("def f():\n    return torch.nn.MultiheadAttention(4, 1)", 2, "multi_head_attention"),
    ("def f():\n    return '/x/solutions/attention.py'", 2, "naming attnlab or its solutions"),
])
def test_static_check_names_the_rule_and_the_line(code, line, words):
    report = check_source("import torch\n" + code)
    assert any(v.line == line + 1 and words in v.message for v in report.violations), \
        [str(v) for v in report.violations]


def test_static_check_accepts_the_stub_and_the_solution():
    names = labs.find_lab("01").allowed_names
    assert check_source(STUB, allowed_attributes=names).violations == []
    only = check_source(SOLUTION, allowed_attributes=names).violations  # compare_with_sdpa calls SDPA, allowed in ex9
    assert [(v.function, v.kind) for v in only] == [("compare_with_sdpa", "attention")]
    assert check_source(SOLUTION, allowed_attributes=names).refusals({"compare_with_sdpa"}) == []


def test_a_violation_anywhere_refuses_the_whole_file(tmp_path):
    """Complete mediation (issue 47): a reach graph once decided which exercises a violation
    cost, and missed helpers reached through an alias or a class attribute."""
    path = tmp_path / "attention.py"
    path.write_text(SOLUTION.replace("    return weights @ V", "    return eval('weights @ V')"))
    report = grade(path, limits=FAST, sandbox="auto")
    assert report.score == 0 and all(s == 0 for s, _ in report.exercise_scores().values()), report.to_text()
    assert "line" in report.to_text() and "eval is not allowed" in report.to_text()


# --------------------------------------------------------------------------- the seed
def test_inputs_change_per_run_and_the_seed_reproduces_a_run(tmp_path):
    path = tmp_path / "attention.py"
    path.write_text(SOLUTION.replace("return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])",
                                     "return Q @ K.transpose(-2, -1)"))

    def message(report):
        return [r.verdict.message for r in report.results if r.exercise.id == "ex2" and not r.verdict.passed]

    a, b = grade(path, limits=FAST, seed=11), grade(path, limits=FAST, seed=11)
    c = grade(path, limits=FAST)
    assert a.seed == b.seed == 11 and message(a) == message(b)
    assert c.seed != 11 and "seed" not in c.to_gradescope()["extra_data"]  # the learner sees a run id only
    assert len({a.run_id, b.run_id, c.run_id}) == 3 and c.to_gradescope()["extra_data"]["run"] == c.run_id
    assert str(c.seed) not in c.to_text() and c.run_id in c.to_text()
    assert a.score == c.score  # the same mistake costs the same points whatever the inputs


# --------------------------------------------------------------------------- results.json
def run_cli(tmp_path, *args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "attnlab", "grade", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_results_json_is_valid_when_the_grader_is_interrupted(tmp_path):
    slow = tmp_path / "attention.py"
    slow.write_text(STUB + "\n\ndef stable_softmax(scores, dim=-1):\n    while True:\n        pass\n")
    out = tmp_path / "results.json"
    proc = run_cli(tmp_path, str(slow), "--json", str(out), "--no-images", "--timeout", "3")
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until an exercise or two are graded
        if out.exists() and any(t["output"] != "not graded: the grading run was interrupted"
                                for t in json.loads(out.read_text())["tests"]):
            break
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    data = json.loads(out.read_text())
    assert data["score"] == 0 and data["max_score"] == 100 and "interrupted" in data["output"]
    outputs = [t["output"] for t in data["tests"]]
    assert any("not implemented yet" in o for o in outputs)  # what was graded is there
    assert any("not graded" in o for o in outputs)  # what was not is marked, at 0 points
    time.sleep(0.3)
    assert own_processes("/server.py") == []  # this test's own tree only: other gradings may run


@pytest.mark.usefixtures("bwrap")
def test_sigkill_of_the_grader_leaves_a_valid_report_and_nothing_running(tmp_path):
    slow = tmp_path / "attention.py"
    slow.write_text(STUB + "\n\ndef project_qkv(X, W_Q, W_K, W_V):\n    while True:\n        pass\n")
    out = tmp_path / "results.json"
    private_tmp = tmp_path / "tmp"  # the grader's temporary files go here: only this test's are counted
    private_tmp.mkdir()
    proc = run_cli(tmp_path, str(slow), "--json", str(out), "--no-images", "--timeout", "20", "--untrusted",
                   env={**os.environ, "TMPDIR": str(private_tmp)})
    deadline = time.time() + 60
    while time.time() < deadline and not out.exists():
        time.sleep(0.05)
    time.sleep(4)  # the sandbox is up and ex1 spins
    proc.kill()
    proc.wait()
    data = json.loads(out.read_text())
    assert data["score"] == 0 and len(data["tests"]) == 35
    time.sleep(0.5)  # --die-with-parent: the sandbox follows its parent
    assert own_processes("/server.py") == []  # this test's own tree only: other gradings may run
    assert list(private_tmp.iterdir()) == []


# --------------------------------------------------------------------------- without bwrap
def no_bwrap_env() -> dict:
    return {**os.environ, "ATTNLAB_BWRAP": ""}


def test_without_bwrap_your_own_file_runs_and_says_it_is_not_sandboxed(tmp_path):
    proc = run_cli(tmp_path, str(LAB / "solutions/attention.py"), "--no-images", env=no_bwrap_env())
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "NOT in an OS sandbox" in stderr and "apt-get install bubblewrap" in stderr
    assert stderr.count("NOT in an OS sandbox") == 1
    assert "Score: 100/100" in stdout and "not in an OS sandbox" in stdout


def test_without_bwrap_untrusted_code_is_refused_unless_told_otherwise(tmp_path, monkeypatch):
    proc = run_cli(tmp_path, str(LAB / "attention.py"), "--untrusted", env=no_bwrap_env())
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "refusing to run untrusted code" in stderr and "--no-sandbox" in stderr
    proc = run_cli(tmp_path, str(LAB / "attention.py"), "--untrusted", "--no-sandbox", "--no-images",
                   env=no_bwrap_env())
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Score: 0/100" in stdout
    monkeypatch.setenv("ATTNLAB_BWRAP", "")
    with pytest.raises(pool.SandboxUnavailable, match="bubblewrap"):
        grade(LAB / "attention.py", untrusted=True)
    with pytest.raises(pool.SandboxUnavailable):
        grade(LAB / "attention.py", sandbox="bwrap")


def test_help_explains_the_sandbox():
    out = subprocess.run([sys.executable, "-m", "attnlab", "grade", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    for words in ("bubblewrap", "--untrusted", "--no-sandbox", "--seed", "NOT" if False else "own file"):
        assert words.lower() in out.lower(), words


def test_the_static_check_survives_parallel_grading():
    """Class grading checks submissions from several threads: CPython 3.11's ast.parse is not
    thread-safe ("SystemError: AST constructor recursion depth mismatch", seen once in a local
    run grading lab variants two at a time), so check_source serialises it. The race is rare and
    could not be reproduced on demand without the lock; this runs the parallel path hard."""
    from concurrent.futures import ThreadPoolExecutor

    from attnlab.grading import static

    source = (Path(__file__).resolve().parents[2] / "labs/track1/01-attention/solutions/attention.py").read_text()

    def many(_):
        return [static.check_source(source).syntax_error for _ in range(40)]

    with ThreadPoolExecutor(max_workers=6) as pool:
        errors = [e for batch in pool.map(many, range(6)) for e in batch]
    assert errors == [""] * 240
