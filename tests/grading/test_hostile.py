"""The hostile-submission suite: every file in tests/hostile/ is graded with the real
OS sandbox, and each must earn exactly its honest score, leave a valid results.json, no
process, no changed file outside the sandbox, no secret in the report, in bounded time.

Needs bwrap (``make test`` installs it); under CI=true a missing bwrap fails the suite
instead of skipping it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import attnlab
from helpers.ci import cannot_run
from helpers.procs import made_by, own_processes
from attnlab.grading import Limits, grade
from attnlab.grading.sandbox import pool
from attnlab.labs.lab01_attention import EXERCISES
from attnlab.grading.sandbox import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

HERE = Path(__file__).resolve().parent
HOSTILE = HERE.parent / "hostile"
LAB = HERE.parents[1] / "labs/track1/01-attention"
STUB = (LAB / "attention.py").read_text()
SOLUTION = (LAB / "solutions/attention.py").read_text()
PACKAGE = Path(attnlab.__file__).resolve().parent
LIMITS = Limits(timeout_s=2.0)
TOTAL_S = 10.0
WALL_BOUND_S = 45.0  # the total limit plus the sandbox's start and the judging, with room for a loaded machine
SERVER_MARK = "/server.py"  # the runner: /runner/server.py in bwrap, the package file without it
TEMPLATE_MARK = "/runner/template.py"

if pool.bwrap_path() is None:
    cannot_run("bwrap is not installed (make test installs bubblewrap): the hostile suite runs sandboxed", module=True)


def header(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        m = re.match(r"# (class|base|expect|static): (.+)", line)
        if not m:
            break
        fields[m.group(1)] = m.group(2).strip()
    return fields


FILES = sorted(HOSTILE.glob("*.py"))


def test_the_suite_covers_every_class():
    classes = {header(f.read_text())["class"] for f in FILES}
    assert len(FILES) >= 25
    assert classes >= {"false-pass", "damage", "leak", "network", "hang", "crash", "memory", "leftovers",
                       "terminal"}


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (bytecode caches aside: the grader's own
    imports may write them; the sandbox mounts the package read-only either way)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def server_processes(ignore: frozenset = frozenset()) -> list[str]:
    """Sandbox servers, class templates (and their forks) and bwrap processes of this test
    process's own tree (tests/procs.own_processes), but the spare one started ahead (no
    learner code has run in it: see pool.keep_spare) and ``ignore`` (a class template's own
    processes, while it is in use)."""
    return own_processes(SERVER_MARK, TEMPLATE_MARK, "bwrap ", pool.bwrap_path() or "/nonexistent", ignore=ignore)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class World:
    root: Path
    home: Path
    subs: Path
    mine: Path
    token: str
    secret: str
    env_secret: str
    port: int
    results: Path

    def snapshot(self) -> dict:
        return {"home": digest(self.home), "subs": digest(self.subs), "package": digest(PACKAGE)}


@pytest.fixture
def world(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    secret = "SECRET-" + secrets.token_hex(8)
    (home / ".bashrc").write_text("# the grader's shell\n")
    (home / "secret.txt").write_text(secret + "\n")
    monkeypatch.setenv("HOME", str(home))
    env_secret = "ENVSECRET-" + secrets.token_hex(8)
    monkeypatch.setenv("HOSTILE_TEST_SECRET", env_secret)
    subs = tmp_path / "submissions"
    (subs / "alice").mkdir(parents=True)
    (subs / "alice" / "attention.py").write_text(SOLUTION)
    (subs / "mallory").mkdir()
    return World(tmp_path, home, subs, subs / "mallory", secrets.token_hex(6), secret, env_secret, free_port(),
                 tmp_path / "out" / "results.json")


def materialise(path: Path, w: World) -> tuple[Path, dict[str, str]]:
    text = path.read_text()
    meta = header(text)
    for key, value in {"@HOME@": str(w.home), "@NEIGHBOUR@": str(w.subs / "alice" / "attention.py"),
                       "@PKG_PARENT@": str(PACKAGE.parent), "@SELF_DIR@": str(w.mine), "@TOKEN@": w.token,
                       "@PORT@": str(w.port), "@RESULTS@": str(w.results)}.items():
        text = text.replace(key, value)
    base = {"stub": STUB, "solution": SOLUTION, "none": ""}[meta["base"]]
    target = w.mine / "attention.py"
    target.write_text(base + "\n\n# ---- hostile part ----\n" + text if base else text)
    return target, meta


def host_leftovers(token: str) -> list[str]:
    return [str(p) for folder in ("/tmp", "/dev/shm", "/var/tmp") for p in Path(folder).glob(f"*{token}*")]


@pytest.fixture(params=["bwrap", "template"])
def launcher(request):
    """Every hostile file is graded in a bwrap of its own, and in a sandbox forked from the
    class template (what 'attnlab grade DIR' uses): yields the template's own processes
    (its bwrap, that bwrap's init, the template), which must be all that is left of it."""
    with made_by(request.param) as own:
        yield request.param, own


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_hostile_submission(path, world, launcher):
    how, template_own = launcher
    target, meta = materialise(path, world)
    before = world.snapshot()
    listener = socket.socket()
    listener.bind(("127.0.0.1", world.port)) if "network_connect" in path.name else None
    if "network_connect" in path.name:
        listener.listen(5)
        listener.settimeout(0.2)
    reached: list[str] = []
    stop = threading.Event()

    def knock() -> None:  # network_bind: try to reach the port it opened, from the host, while it runs
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", world.port), timeout=0.2):
                    reached.append("connected")
            except OSError:
                pass
            time.sleep(0.05)

    knocker = threading.Thread(target=knock, daemon=True)
    if "network_bind" in path.name:
        knocker.start()
    t0 = time.perf_counter()
    report = grade(target, limits=LIMITS, total_timeout_s=TOTAL_S, sandbox="bwrap", untrusted=True)
    elapsed = time.perf_counter() - t0
    stop.set()
    text = report.to_text(colour=False)
    data = json.loads(json.dumps(report.to_gradescope()))  # what results.json holds

    # the honest score, and a valid Gradescope report
    assert report.score == float(meta["expect"]), text
    assert report.sandboxed
    assert report.launcher == how or (report.launcher == "" and report.problem)  # '': refused before running
    assert data["score"] == sum(t["score"] for t in data["tests"]) == report.score
    assert data["max_score"] == 100 and len(data["tests"]) == sum(len(ex.checks) for ex in EXERCISES)
    for t in data["tests"]:
        assert set(t) == {"name", "score", "max_score", "output", "tags", "visibility"}
        assert 0 <= t["score"] <= t["max_score"]
    # bounded time, nothing left running, nothing changed outside the sandbox
    assert elapsed < WALL_BOUND_S
    time.sleep(0.3)  # a survivor would have had time to act
    assert server_processes(ignore=template_own) == []
    assert world.snapshot() == before
    assert host_leftovers(world.token) == []
    assert not world.results.exists()
    # no secret, no terminal control in what the learner or the instructor reads
    blob = text + json.dumps(data, ensure_ascii=False)
    for secret in (world.secret, world.env_secret, str(world.home), "-m pytest"):
        assert secret not in blob, secret
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", text + "".join(t["output"] for t in data["tests"]))
    # the network: nothing reached the host
    if "network_connect" in path.name:
        with pytest.raises(OSError):
            listener.accept()
    listener.close()
    assert reached == []
    if meta.get("static") == "refused":
        # The allow-list refuses this file before it runs: that is its honest score above. Its code
        # still goes through the OS sandbox here, straight (import and ex1's calls), so the fence it
        # was written against is still tested: nothing left running, nothing changed outside.
        assert "allows" in text or "reaches" in text, text
        calls, _ = EXERCISES[0].prepare(torch.Generator().manual_seed(0))
        with Sandbox(target, LIMITS, mode="bwrap") as box:
            box.run([], policy=False)
            box.run(calls, policy=False)
        time.sleep(0.3)
        assert server_processes(ignore=template_own) == []
        assert world.snapshot() == before
        assert host_leftovers(world.token) == []


def test_a_daemon_cannot_rewrite_results_json_after_the_grader_wrote_it(world):
    """Through the CLI, as an instructor runs it: the file is written atomically and
    nothing of the submission lives on to change it."""
    target, _ = materialise(HOSTILE / "fp_rewrite_results.py", world)
    world.results.parent.mkdir()
    proc = subprocess.run([sys.executable, "-m", "attnlab", "grade", str(target), "--json", str(world.results),
                           "--untrusted", "--no-images", "--timeout", "2", "--no-colour"],
                          capture_output=True, text=True, timeout=120, cwd=world.root)
    assert proc.returncode == 1, proc.stderr
    first = world.results.read_text()
    assert json.loads(first)["score"] == 0
    time.sleep(1.5)
    assert world.results.read_text() == first
    assert server_processes() == []
    assert [p.name for p in world.results.parent.iterdir()] == ["results.json"]  # no temporary file left


def test_escape_sequences_never_reach_the_terminal(world):
    target, _ = materialise(HOSTILE / "terminal_escapes.py", world)
    proc = subprocess.run([sys.executable, "-m", "attnlab", "grade", str(target), "--untrusted", "--no-images",
                           "--timeout", "2"], capture_output=True, text=True, timeout=120, cwd=world.root)
    assert "\x1b" not in proc.stdout and "\r" not in proc.stdout and "\x07" not in proc.stdout
    score_lines = [line for line in proc.stdout.splitlines() if line.startswith("Score:")]
    assert len(score_lines) == 1 and score_lines[0].startswith("Score: 0/100"), proc.stdout


def test_a_neighbour_keeps_full_marks_after_a_hostile_file_ran(world):
    target, _ = materialise(HOSTILE / "fp_neighbour.py", world)
    assert grade(target, limits=LIMITS, sandbox="bwrap").score == 0
    assert grade(world.subs / "alice" / "attention.py", limits=LIMITS, sandbox="bwrap").score == 100


def test_the_next_learner_is_graded_by_an_untouched_grader(world):
    target, _ = materialise(HOSTILE / "fp_edit_installed_checks.py", world)
    grade(target, limits=LIMITS, sandbox="bwrap")
    assert grade(LAB / "attention.py", limits=LIMITS, sandbox="bwrap").score == 0


@pytest.mark.parametrize("name", ["write_home", "write_own_folder"])
def test_the_suite_sees_the_damage_when_the_sandbox_is_off(name, world):
    """The checksums above are not vacuous: the same file, run without the OS sandbox
    (process limits only), does change files outside. Only files whose targets are this
    test's own temporary folders are run this way."""
    target, _ = materialise(HOSTILE / f"{name}.py", world)
    before = world.snapshot()
    with Sandbox(target, LIMITS, mode="none") as box:  # straight: the static check would refuse it first
        box.run([], policy=False)
    assert world.snapshot() != before
