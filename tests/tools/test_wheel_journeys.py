"""The three journeys from a wheel installed into a new environment, with no checkout in
sight (issue 32's done-when): a learner who hands in a notebook, an instructor with a messy
class who builds and tries a Gradescope bundle without a clone, an engineer with meta tensors.
The environment sees this one's torch, numpy and jaxtyping through a .pth file; attnlab itself
comes from the wheel, and every command runs from a folder outside the checkout."""

from __future__ import annotations

import io
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from attnlab.grading.classroom import autograder

pytestmark = [pytest.mark.subprocess, pytest.mark.slow, pytest.mark.sandbox]

REPO = Path(__file__).resolve().parents[2]
SOLUTION = REPO / "labs" / "track1" / "01-attention" / "solutions" / "attention.py"
MASKS = REPO / "labs" / "track1" / "02-masks" / "solutions" / "masks.py"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(run, home)``: ``run(*argv)`` runs a command of the wheel's environment in ``home``."""
    work = tmp_path_factory.mktemp("wheel-journey")
    wheel = autograder.build_wheel(work / "dist")  # from the checkout, as a release would be built
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    venv_site = next(venv.glob("lib/python*/site-packages"))
    here = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (venv_site / "host.pth").write_text("\n".join(dict.fromkeys(p for p in here if Path(p).is_dir())) + "\n")
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], check=True)
    home = work / "home"
    home.mkdir()
    env = {**os.environ, "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)

    def run(*argv: str, input_text: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "attnlab"), *argv] if argv[0] != "python" else [str(py), *argv[1:]],
                              cwd=home, env=env, capture_output=True, text=True, timeout=900, input=input_text)

    where = run("python", "-c", "import attnlab; print(attnlab.__file__)").stdout
    assert str(venv) in where, where  # the wheel's attnlab, not this checkout's
    return run, home


def test_a_learner_hands_in_a_notebook(installed):
    run, home = installed
    got = run("labs", "get", "01", "lab01")
    assert got.returncode == 0, got.stderr
    cells = SOLUTION.read_text().split("\n\n\n")
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
          "cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                     "source": c.splitlines(keepends=True)} for c in cells + ["print(causal_mask(3))"]]}
    (home / "lab01" / "attention.ipynb").write_text(json.dumps(nb))
    got = run("grade", "lab01/attention.ipynb", "--no-images", "--seed", "1")
    assert got.returncode == 0 and "Score: 100/100" in got.stdout and "Traceback" not in got.stderr, got.stdout


def test_an_instructor_grades_a_messy_class_and_builds_a_bundle_without_a_clone(installed):
    run, home = installed
    cls = home / "class"
    for learner, name, src in (("ann", "attention.py", SOLUTION), ("Ned", "Attention.py", SOLUTION),
                               ("olga", "attention (1).py", SOLUTION), ("zed", "masks.py", MASKS)):
        (cls / learner).mkdir(parents=True)
        shutil.copy(src, cls / learner / name)
    (cls / "empty").mkdir()
    (cls / "hank").mkdir()
    cells = SOLUTION.read_text().split("\n\n\n")
    (cls / "hank" / "attention.ipynb").write_text(json.dumps({
        "nbformat": 4, "nbformat_minor": 5, "metadata": {},
        "cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                   "source": c.splitlines(keepends=True)} for c in cells]}))
    (cls / "ivy").mkdir()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.write(SOLUTION, "hand-in/attention.py")
    (cls / "ivy" / "lab.zip").write_bytes(buf.getvalue())
    got = run("grade", "class", "--out", "graded", "--seed", "3")
    assert got.returncode == 0, got.stderr[-2000:]
    grades = (home / "graded" / "grades.csv").read_text()
    for learner in ("ann", "Ned", "olga", "ivy", "hank"):
        assert f"\n{learner},100,100," in grades, grades
    assert "skipped empty: the folder is empty" in got.stdout and "skipped zed: a lab 02-masks" in got.stdout

    got = run("autograder", "--lab", "01", "--out", "autograder-01.zip", "--test", str(SOLUTION))
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    assert "score 100/100" in got.stdout and "what the learner reads on Gradescope" in got.stdout
    names = zipfile.ZipFile(home / "autograder-01.zip").namelist()
    assert any(n.startswith("attnlab-") and n.endswith(".whl") for n in names), names

    got = run("labs", "get", "01", "key", "--solution")
    assert got.returncode == 0 and (home / "key" / "attention.py").read_text() == SOLUTION.read_text()
    assert "warning: attention.py is the instructor's solution" in got.stderr


def test_an_engineer_runs_meta_tensors_through_every_path(installed):
    run, home = installed
    code = ("import torch; from attnlab import dispatch, tiled, decoding, flex\n"
            "q = torch.empty(2, 4, 3, 8, device='meta'); k = torch.empty(2, 4, 9, 8, device='meta')\n"
            "for f in (lambda: dispatch.attention(q, k, k), lambda: tiled.flash_attention(q, k, k, is_causal=True),\n"
            "          lambda: decoding.decode_attention(q, k, k), lambda: flex.flex_attention(q, k, k)):\n"
            "    out = f(); assert out.is_meta and tuple(out.shape) == (2, 4, 3, 8)\n"
            "print('meta ok')")
    got = run("python", "-c", code)
    assert got.returncode == 0 and "meta ok" in got.stdout, got.stderr


def test_the_shipped_solutions_are_out_of_the_sandboxs_reach(installed):
    """A wheel ships the solutions (for 'labs get NN --solution') under <prefix>/share/attnlab;
    the sandbox binds the prefix read-only, and covers that folder with an empty tmpfs. Raw
    code (no static check) looks for the solution there."""
    run, home = installed
    code = ("import sys, os, torch\n"
            "from pathlib import Path\n"
            "from attnlab.grading.sandbox import Sandbox, Limits, Call\n"
            "target = os.path.join(sys.prefix, 'share', 'attnlab', 'labs', 'track1', '01-attention', 'solutions',"
            " 'attention.py')\n"
            "assert os.path.isfile(target), target  # on the host: shipped\n"
            "src = ('import os, sys\\n'\n"
            "       'def probe():\\n'\n"
            "       '    p = os.path.join(sys.prefix, \"share\", \"attnlab\")\\n'\n"
            "       '    return [os.path.exists(os.path.join(p, \"labs\")), os.listdir(p) if os.path.isdir(p) else None]\\n')\n"
            "Path('probe.py').write_text(src)\n"
            "with Sandbox(Path('probe.py'), Limits(timeout_s=5.0), mode='bwrap', source=src.encode()) as box:\n"
            "    o = box.run([Call('probe')], policy=False)\n"
            "print('sandbox sees', o.status, o.results)\n")
    got = run("python", "-c", code)
    assert got.returncode == 0, got.stderr[-2000:]
    assert "sandbox sees ok [{'value': [False, []]}]" in got.stdout, got.stdout
