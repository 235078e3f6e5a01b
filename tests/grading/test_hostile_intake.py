"""Hostile intake (issue 47): one learner's zip, notebook, folder or name never ends the class,
never takes another learner's row, and never reaches a person's terminal or file unescaped.

Each case here failed on the code before it: a traceback from ``zipfile`` (an encrypted member,
an unknown method, a bad CRC, a local name that differs, 1200 nested zips), a class stopped at
planning by a ``.py`` that is a zip, ``RecursionError`` from a folder nested 1200 deep,
``UnicodeEncodeError`` writing a name that is not UTF-8, ``José`` in NFC and NFD graded as one
learner, and another lab's file graded 0 under ``--lab``. The properties are fuzzed in
tests/grading/test_fuzz_intake.py.
"""

from __future__ import annotations

import io
import json
import os
import struct
import tempfile
import unicodedata
import zipfile
from pathlib import Path

import pytest

from attnlab import labs
from attnlab.grading import intake
from attnlab.grading.classroom import batch
from attnlab.grading.output import UNSAFE, sanitise, write_json, write_text
from attnlab.grading.submission import Unreadable

from helpers import hostile_inputs as hi

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = (ROOT / "labs/track1/01-attention/solutions/attention.py").read_bytes()
LAB05 = (ROOT / "labs/track1/05-triton-flash/flash_triton.py").read_bytes()


def zipped(members: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z:
        for name, body in members.items():
            z.writestr(name, body)
    return buf.getvalue()


def _headers(data: bytes) -> tuple[int, int]:
    """Offsets of the first local header and the first central directory header."""
    return data.index(b"PK\x03\x04"), data.index(b"PK\x01\x02")


def encrypted(data: bytes) -> bytes:
    b = bytearray(data)
    local, central = _headers(data)
    b[local + 6] |= 1  # general purpose flag bit 0: encrypted
    b[central + 8] |= 1
    return bytes(b)


def unknown_method(data: bytes) -> bytes:
    b = bytearray(data)
    local, central = _headers(data)
    struct.pack_into("<H", b, local + 8, 99)
    struct.pack_into("<H", b, central + 10, 99)
    return bytes(b)


def bad_crc(data: bytes) -> bytes:
    b = bytearray(data)
    local, _ = _headers(data)
    name_len, extra_len = struct.unpack_from("<HH", b, local + 26)
    b[local + 30 + name_len + extra_len] ^= 0xFF  # the member's first byte, stored
    return bytes(b)


def renamed_locally(data: bytes) -> bytes:
    b = bytearray(data)
    local, _ = _headers(data)
    b[local + 30] = ord("X")  # the local header's name differs from the central directory's
    return bytes(b)


def nested(depth: int) -> bytes:
    data = SOLUTION
    name = "attention.py"
    for i in range(depth):
        data, name = zipped({name: data}), f"layer{i}.zip"
    return data


@pytest.mark.parametrize("broken", [encrypted, unknown_method, bad_crc, renamed_locally],
                         ids=["encrypted", "unknown-method", "bad-crc", "local-name-differs"])
def test_a_broken_zip_member_is_unreadable_with_a_reason_not_a_traceback(broken):
    with pytest.raises(Unreadable, match="zip"):
        intake.prepare("attention.zip", broken(zipped({"attention.py": SOLUTION})))


@pytest.mark.parametrize("depth", [2, 1200])
def test_a_zip_inside_a_zip_is_refused(depth):
    with pytest.raises(Unreadable, match="zip archive inside"):
        intake.prepare("attention.zip", nested(depth))


def test_a_folder_nested_1200_deep_is_a_reason(tmp_path):
    deep = path = tmp_path / "alice"
    deep.mkdir()
    for _ in range(1200):  # one level at a time: os.makedirs recurses once per level
        path = path / "d"
        path.mkdir()
    try:
        choice = intake.choose(deep, "attention.py")
        assert choice.path is None and "nested more than" in choice.why
    finally:  # bottom up, one level at a time: shutil.rmtree (pytest's clean-up) recurses once per level
        while path != deep:
            path.rmdir()
            path = path.parent


def _class(tmp_path: Path, entries: dict[str, bytes]) -> Path:
    folder = tmp_path / "class"
    folder.mkdir()
    for rel, body in entries.items():
        path = folder / os.fsdecode(rel.encode("utf-8", "surrogateescape"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    return folder


def test_a_py_that_is_a_zip_costs_its_learner_not_the_class(tmp_path):
    folder = _class(tmp_path, {"alice.py": SOLUTION, "bob.py": unknown_method(zipped({"attention.py": SOLUTION}))})
    plan = batch.plan_class(folder)  # the lab is found from the files: bob's is read too
    assert [s.learner for s in plan.submissions] == ["alice", "bob"]


def test_a_name_that_is_not_utf8_is_written_escaped(tmp_path):
    folder = _class(tmp_path, {"alice/attention.py": SOLUTION, "caf\udce9/notes.txt": b"x", "d\udcff.txt": b"x"})
    plan = batch.plan_class(folder)
    text = "".join(f"{s.name}: {s.reason}\n" for s in plan.skipped)
    write_text(tmp_path / "skipped.txt", text)
    written = (tmp_path / "skipped.txt").read_text(encoding="utf-8")
    assert "caf\\xe9" in written and "d\\xff.txt" in written and not UNSAFE.search(written)
    write_json(tmp_path / "results.json", {"output": text})
    assert "caf\\xe9" in json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))["output"]


def test_one_learner_named_twice_is_graded_under_neither_entry(tmp_path):
    nfc, nfd = unicodedata.normalize("NFC", "José"), unicodedata.normalize("NFD", "José")
    assert nfc != nfd
    folder = _class(tmp_path, {f"{nfc}/attention.py": SOLUTION, f"{nfd}/attention.py": b"# a stub\n",
                               "Ann/attention.py": SOLUTION, "ann.py": SOLUTION,
                               "bo.py": SOLUTION, "bo (1).py": SOLUTION, "carl.py": SOLUTION})
    subs, skipped = batch.find_submissions(folder)
    assert [s.learner for s in subs] == ["carl"]
    reasons = {s.name: s.reason for s in skipped}
    assert sorted(reasons) == sorted([nfc, nfd, "Ann", "ann.py", "bo.py", "bo (1).py"])
    assert all("one learner" in r for r in reasons.values())


@pytest.mark.parametrize("entry", ["Flash_Triton.py", "flash_triton (1).py", "flash_triton.ipynb", "work.zip",
                                   "mine.py"])
def test_another_labs_file_is_skipped_under_lab_not_graded_zero(tmp_path, entry):
    body = LAB05
    if entry.endswith(".ipynb"):
        body = json.dumps({"cells": [{"cell_type": "code", "source": LAB05.decode()}], "nbformat": 4}).encode()
    elif entry.endswith(".zip"):
        body = zipped({"flash_triton.py": LAB05})
    folder = _class(tmp_path, {f"alice/{entry}": body, "bob/attention.py": SOLUTION})
    plan = batch.plan_class(folder, lab="01")
    assert [s.learner for s in plan.submissions] == ["bob"]
    (skip,) = [s for s in plan.skipped if s.name == "alice"]
    assert "another lab's file" in skip.reason and "05" in skip.reason


def test_the_sanitiser_escapes_what_a_terminal_acts_on_and_is_idempotent():
    hostile = "a\x1b]0;owned\x07b\x1b[2Jc\rd\u202ee\udcfff\u2066g\x9bh\ttab\nline"
    once = sanitise(hostile)
    assert not UNSAFE.search(once) and sanitise(once) == once
    assert once == "a\\x1b]0;owned\\x07b\\x1b[2Jc\\x0dd\\u202ee\\xfff\\u2066g\\x9bh\ttab\nline"
    assert sanitise("\x1b[31mred\x1b[0m\x1b[2J", colour=True) == "\x1b[31mred\x1b[0m\\x1b[2J"


def test_every_labs_file_is_known_to_the_other_labs_check():
    assert len(labs.LAB_FILES) == len(set(labs.LAB_FILES)) == len(labs.LABS)


def _gradescope_root(tmp_path: Path, files: dict[str, bytes]) -> Path:
    root = tmp_path / "autograder"
    sub = root / "submission"
    sub.mkdir(parents=True)
    for name, body in files.items():
        (sub / os.fsdecode(name.encode("utf-8", "surrogateescape"))).write_bytes(body)
    return root


def test_run_autograder_writes_results_json_whatever_the_grader_does(tmp_path, monkeypatch):
    from attnlab.grading.classroom import autograder

    def broken(*args, **kwargs):
        raise RuntimeError("the grader broke")

    monkeypatch.setattr(autograder, "choose_sandbox", broken)
    root = _gradescope_root(tmp_path, {"attention.py": SOLUTION})
    autograder.run_gradescope(root, "01")
    results = root / "results"
    data = json.loads((results / "results.json").read_text(encoding="utf-8"))
    assert data["score"] == 0 and "the grader failed on this submission (RuntimeError)" in data["output"]
    assert sorted(p.name for p in results.iterdir()) == ["results.json"]  # no temporary file left


def test_run_autograder_on_a_name_that_is_not_utf8_writes_escaped_results(tmp_path, monkeypatch):
    from attnlab.grading.classroom import autograder

    monkeypatch.setattr(autograder, "choose_sandbox", lambda: ("", "no sandbox in this test"))
    root = _gradescope_root(tmp_path, {"attenti\udcf3n.py": SOLUTION, "\x1b]0;owned\x07.py": SOLUTION})
    autograder.run_gradescope(root, "01")
    text = (root / "results" / "results.json").read_text(encoding="utf-8")
    data = json.loads(text)
    assert data["score"] == 0 and "cannot isolate" in data["output"]
    assert not any(UNSAFE.search(s) for s in hi.strings_in(data))



def test_a_learners_inputs_come_from_a_key_no_learner_has():
    """Issue 47: inputs came from crc32(seed:learner), the seed printed in the learner's own report,
    so a table of answers computed offline scored 100. Now an HMAC of the class's secret key."""
    key_a, key_b = b"a" * 32, b"b" * 32
    assert batch.learner_seed(key_a, 7, "alice") == batch.learner_seed(key_a, 7, "alice")
    seeds = {batch.learner_seed(k, s, n) for k in (key_a, key_b) for s in (7, 8) for n in ("alice", "bob")}
    assert len(seeds) == 8 and all(0 <= s < 2**62 for s in seeds)


def test_the_class_key_is_kept_with_the_gradebook_and_reproduces_only_with_it(tmp_path):
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    out_a.mkdir()
    out_b.mkdir()
    key = batch.class_key(out_a)
    assert len(key) == 32 and key == batch.class_key(out_a) != batch.class_key(out_b)
    assert (out_a / batch.CLASS_KEY_FILE).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("road", ["alias", "class_attribute"])
def test_a_violation_reached_through_an_alias_or_a_class_attribute_refuses_the_file(road):
    """Issue 47: the reach graph charged a helper reached through ``go = helper`` or
    ``class Box: sum = helper`` to no exercise (43/100 from a stub with torch's softmax)."""
    from attnlab.grading import grade

    helper = "\n\ndef helper(scores, dim=-1):\n    return torch.softmax(scores, dim)\n"
    road_text = ("go = helper\n\n\ndef stable_softmax(scores, dim=-1):\n    return go(scores, dim)\n"
                 if road == "alias" else
                 "class Box:\n    sum = helper\n\n\ndef stable_softmax(scores, dim=-1):\n    return Box.sum(scores, dim)\n")
    source = SOLUTION.decode().split("def stable_softmax")[0] + helper + "\n\n" + road_text + \
        "\n\ndef _rest():\n    pass\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "attention.py"
        path.write_text(source)
        report = grade(path, lab="01", sandbox="none", seed=1)
    assert report.score == 0 and "softmax" in report.problem and "in helper()" in report.problem, report.to_text()
    assert any(f["code"] == "policy" for r in report.results for f in r.verdict.findings)


TORCH_FORWARD = '''
def flash_forward(q, k, v, is_causal=False):
    """Given, replaced: plain torch arithmetic, no kernel launched."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    s = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if is_causal:
        L, S = s.shape[-2], s.shape[-1]
        keep = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    return (p / l @ v.float()).to(q.dtype), (m + torch.log(l)).squeeze(-1)
'''


def test_a_lab05_answer_made_without_the_learners_kernel_scores_zero_with_its_code():
    """Issue 47: replacing lab 05's launchers with plain torch arithmetic, so that no kernel of the
    learner's ever ran, scored 100/100 in a lab whose every point is for writing Triton kernels."""
    from attnlab.grading import grade

    solution = (ROOT / "labs/track1/05-triton-flash/solutions/flash_triton.py").read_text()
    start = solution.index("def flash_forward(")
    end = solution.index("\n\n\n", start)
    source = solution[:start] + TORCH_FORWARD.strip() + solution[end:]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "flash_triton.py"
        path.write_text(source)
        report = grade(path, lab="05", sandbox="none", seed=1)
    scores = report.exercise_scores()
    assert not report.problem, report.to_text()
    for ex in ("ex1", "ex2", "ex3", "ex6", "ex7"):  # every exercise whose answer needs the forward kernel
        assert scores[ex][0] == 0, report.to_text()
    codes = {f["code"] for r in report.results if r.exercise.id == "ex1" for f in r.verdict.findings}
    assert codes == {"kernel_not_launched"}, report.to_text()
    assert scores["ex4"] == (8, 8) and scores["ex5"][0] == scores["ex5"][1]  # its own kernels still count


def _notebook_of(*cells: str) -> bytes:
    return json.dumps({"cells": [{"cell_type": "code", "source": c} for c in cells], "nbformat": 4}).encode()


def test_a_notebook_set_up_like_the_walkthrough_leaves_its_environment_lines_out():
    """Issue 48: a notebook whose first cell sets os.environ['TRITON_INTERPRET'] = '1', as lab 05's
    walkthrough does, was refused as policy (0 points)."""
    made = intake.prepare("flash_triton.ipynb", _notebook_of(
        'import os\n\nos.environ["TRITON_INTERPRET"] = "1"  # before triton is imported', LAB05.decode()))
    assert b"os.environ" not in made.source and b"import os" not in made.source
    assert any("environment lines of cell 1" in n for n in made.notes), made.notes
    # os used for anything else is still the file's, and the rule still refuses it
    other = intake.prepare("attention.ipynb", _notebook_of("import os\nos.environ['X'] = '1'",
                                                           "def f():\n    return os.getcwd()"))
    assert b"os.getcwd()" in other.source


@pytest.mark.slow
def test_the_lab05_solution_as_a_walkthrough_style_notebook_scores_100():
    from attnlab.grading import grade

    solution = (ROOT / "labs/track1/05-triton-flash/solutions/flash_triton.py").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "flash_triton.ipynb"
        path.write_bytes(_notebook_of('import os\nos.environ["TRITON_INTERPRET"] = "1"', solution))
        report = grade(path, lab="05", sandbox="none", seed=1)
    assert report.score == 100, report.to_text()
