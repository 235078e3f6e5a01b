"""Gradescope with and without bwrap: the bundle in three simulated roots, and mode 'user'.

Mode 'user' (no bwrap: the learner as a fresh unprivileged uid) needs root; so do the
Gradescope containers it is for, and CI. Where the tests do not run as root they check
the refusal instead.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.grading.classroom import autograder
from attnlab.grading.sandbox import Call, Limits, Sandbox, pool
from helpers.ci import cannot_run
from helpers.procs import crippled_bwrap, needs_sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

REPO = Path(__file__).resolve().parents[2]
SOLUTION_01 = REPO / "labs/track1/01-attention/solutions/attention.py"
STUB_01 = REPO / "labs/track1/01-attention/attention.py"


def uid_processes(uid: int) -> list[str]:
    """Every live process of ``uid`` on the machine (a fresh random uid's are this test's only),
    as 'pid state'; a zombie (killed, not yet reaped by this test's subreaper) runs nothing."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fields = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
                found.append(f"{proc.name} {fields['State'].strip()}")
        except (OSError, ValueError, KeyError):
            continue
    return found


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """One bundle, set up once in a simulated Gradescope root (offline, from its wheel)."""
    work = tmp_path_factory.mktemp("gradescope-modes")
    bundle = work / "autograder.zip"
    assert main(["autograder", "--out", str(bundle)]) == 0
    root = autograder.SimulatedRoot(bundle, work)
    setup = root.setup()
    assert setup.returncode == 0, setup.stderr[-2000:]
    fakes = work / "fakebin"
    fakes.mkdir()
    return root, root.env, crippled_bwrap(fakes)


@pytest.mark.parametrize("where", ["bwrap works", "bwrap absent", "bwrap cannot run the full sandbox"])
def test_the_bundle_gives_the_solution_100_in_each_root(simulated, where):
    """The three Gradescope roots: the solution scores 100 in each, and results.json says which
    sandbox graded it. Without bwrap the learner runs as a fresh unprivileged uid; the old
    bundle ran it as root beside results.json (--no-sandbox), or scored everyone 0 where its
    simple probe passed and the full sandbox could not start."""
    needs_sandbox()
    root, env, fake = simulated
    root.env = dict(env)
    if where == "bwrap absent":
        root.env["ATTNLAB_BWRAP"] = ""
    elif where == "bwrap cannot run the full sandbox":
        root.env["ATTNLAB_BWRAP"] = str(fake)
    run = root.run(SOLUTION_01)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(root.results.read_text())
    if where != "bwrap works" and os.geteuid() != 0:  # Gradescope runs as root; here the bundle must refuse
        assert data["score"] == 0 and "cannot isolate learner code" in data["output"], data.get("output")
        return
    assert data["score"] == 100, data.get("output")
    sandbox = data["extra_data"]["sandbox"]
    if where == "bwrap works":
        assert sandbox["os_sandbox"] is True and sandbox["made_by"] == "bwrap"
    else:
        assert sandbox["os_sandbox"] is False and sandbox["made_by"] == "user", sandbox
        assert "bwrap cannot run here" in sandbox["chosen"] and "fresh unprivileged uid" in sandbox["chosen"]
    run = root.run(STUB_01)  # and the stub still scores 0 there
    assert json.loads(root.results.read_text())["score"] == 0


def test_no_sandbox_at_all_is_the_instructors_problem_with_a_reason(monkeypatch, tmp_path):
    """Where neither bwrap nor a user of its own can run (not root), nothing of the learner's runs:
    results.json has 0 points and says why, for the instructor, not as failed checks."""
    monkeypatch.setenv("ATTNLAB_BWRAP", "")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "attention.py").write_text(SOLUTION_01.read_text())
    data = autograder.run_gradescope(tmp_path, "01")
    assert data["score"] == 0 and "not a mistake in your code" in data["output"]
    assert "cannot isolate learner code" in data["output"] and "not root" in data["extra_data"]["sandbox"]["chosen"]
    assert json.loads((tmp_path / "results" / "results.json").read_text())["score"] == 0


LEFT_BEHIND = '''
import os, time

def leave_a_daemon(results, secret):
    """A daemon in a session of its own that keeps trying to write results.json; and a read of
    attnlab's package."""
    try:
        open(secret).read()
        read = "read"
    except OSError as exc:
        read = exc.strerror
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while True:
                try:
                    with open(results, "w") as f:
                        f.write('{"score": 100}')
                except OSError:
                    pass
                time.sleep(0.01)
        os._exit(0)
    time.sleep(0.3)
    try:
        with open(results, "w") as f:
            f.write('{"score": 100}')
        wrote = "wrote"
    except OSError as exc:
        wrote = exc.strerror
    return repr((os.getuid(), read, wrote))
'''


def test_without_bwrap_the_learner_is_a_fresh_uid_that_leaves_nothing(tmp_path):
    """Mode 'user' with its folders out of reach, as run_gradescope sets it up: the learner's
    uid is fresh and not root, cannot read attnlab's package or write the results folder, and
    every process of that uid (a setsid daemon included) is dead once the sandbox closes.
    A grader that is not root cannot make such a user: there the mode is refused."""
    import attnlab

    if os.geteuid() != 0:
        with pytest.raises(pool.SandboxUnavailable, match="needs root"):
            pool.resolve_mode("user")
        return

    results = tmp_path / "results"
    results.mkdir()
    package = Path(attnlab.__file__).resolve().parent
    path = tmp_path / "attention.py"
    path.write_text(textwrap.dedent(LEFT_BEHIND))
    pool.keep_spare(False)
    try:
        with autograder.out_of_reach([results, package]):
            assert os.stat(package).st_mode & 0o777 == 0o700
            with Sandbox(path, Limits(timeout_s=10.0), mode="user") as box:
                outcome = box.run([Call("leave_a_daemon", (str(results / "results.json"),
                                                          str(package / "__init__.py")))], policy=False)
                uid = box._server.uid  # noqa: SLF001 (the test looks at its own sandbox's uid)
                assert box.launcher == "user"
            assert outcome.status == "ok", (outcome.message, outcome.results)
            inside_uid, read, wrote = eval(outcome.results[0]["value"])  # noqa: S307
            time.sleep(0.2)
            assert uid_processes(uid) == []  # the daemon is gone: nothing can write after the grader
    finally:
        pool.keep_spare(True)
    assert inside_uid == uid and uid >= 1 << 30
    # the package is unreadable (0700), or not even there: where the Python installation lies
    # under a folder others cannot enter (a clone in a 0700 mktemp), mode 'user' shows the
    # server only the installation, bound into a skeleton of that folder
    assert read in ("Permission denied", "No such file or directory") and wrote == "Permission denied"
    assert not (results / "results.json").exists()
    assert os.stat(package).st_mode & 0o777 != 0o700  # restored


def test_mode_user_is_refused_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pool.SandboxUnavailable, match="needs root"):
        pool.resolve_mode("user")


IMAGE = r"""
set -e
# what a Gradescope image gives run_autograder: root, a mount and pid namespace of its own, a
# fresh /proc, /tmp and a minimal /dev. The simulated root (under the host's /tmp) is carried in.
mount -t tmpfs tmpfs /mnt
i=0; for p in $CARRY; do mkdir /mnt/$i; mount --bind "$p" /mnt/$i; i=$((i+1)); done
mount -t tmpfs -o size=512m tmpfs /tmp
i=0; for p in $CARRY; do mkdir -p "$p"; mount --move /mnt/$i "$p"; i=$((i+1)); done
mkdir /tmp/.dev && mount -t tmpfs -o mode=755 tmpfs /tmp/.dev
for d in null zero full random urandom tty; do touch /tmp/.dev/$d; mount --bind /dev/$d /tmp/.dev/$d; done
mkdir /tmp/.dev/pts /tmp/.dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /tmp/.dev/pts && ln -s pts/ptmx /tmp/.dev/ptmx
mount -t tmpfs tmpfs /tmp/.dev/shm
mount --move /tmp/.dev /dev
exec bash "$RUN"
"""


@pytest.mark.parametrize("where", ["bwrap works", "bwrap absent"])
def test_run_autograder_in_a_gradescope_like_image_gives_the_solution_100(simulated, where):
    """The round's simulated image (run_autograder as root in a mount namespace of its own, fresh
    /proc, /dev and /tmp, the venv set up by the bundle's setup.sh) scored the solution 0 in both
    modes, with no cause; here each mode must grade it 100, and say which mode it was."""
    import shutil
    import subprocess

    needs_sandbox()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        cannot_run("needs root and unshare (util-linux); CI runs as root with them")
    root, env, _ = simulated
    sub = root.root / "submission"
    shutil.rmtree(sub, ignore_errors=True)
    sub.mkdir(parents=True)
    shutil.copyfile(SOLUTION_01, sub / "attention.py")
    root.results.unlink(missing_ok=True)
    import sys

    # what lies under the host's /tmp and must survive the image's fresh one: the simulated root, and
    # this checkout with its venv when it was cloned there (a CI clone may be)
    carry = [str(root.root.parent)] + [str(p) for p in {REPO, Path(sys.prefix).resolve()}
                                       if str(p).startswith("/tmp/") and not str(p).startswith(str(root.root.parent))]
    run_env = {**env, "CARRY": " ".join(carry), "RUN": str(root.source / "run_autograder")}
    if where == "bwrap absent":
        run_env["ATTNLAB_BWRAP"] = ""
    proc = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private",
                           "bash", "-c", IMAGE], env=run_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    data = json.loads(root.results.read_text())
    assert data["score"] == 100, data["output"]
    assert data["extra_data"]["sandbox"]["made_by"] == ("bwrap" if where == "bwrap works" else "user")


@pytest.mark.parametrize("where", ["bwrap works", "bwrap absent"])
def test_the_lab05_bundle_installs_triton_and_grades_without_a_gpu(tmp_path, where):
    """Lab 05's bundle pins triton (its file imports it) and grades the Triton solution 100 with
    the interpreter, in bwrap and as a fresh uid (mode 'user' sets TRITON_INTERPRET=1 too)."""
    needs_sandbox()
    if where == "bwrap absent" and os.geteuid() != 0:
        cannot_run("mode 'user' needs root (the refusal is tested above); CI runs as root")
    bundle = tmp_path / "autograder.zip"
    assert main(["autograder", "--lab", "05", "--out", str(bundle)]) == 0
    import zipfile

    requirements = zipfile.ZipFile(bundle).read("requirements.txt").decode()
    assert "triton==" in requirements, requirements
    root = autograder.SimulatedRoot(bundle, tmp_path)
    setup = root.setup()
    assert setup.returncode == 0, setup.stderr[-2000:]
    if where == "bwrap absent":
        root.env["ATTNLAB_BWRAP"] = ""
    run = root.run(REPO / "labs/track1/05-triton-flash/solutions/flash_triton.py")
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(root.results.read_text())
    assert data["score"] == 100, data.get("output")
    assert data["extra_data"]["sandbox"]["made_by"] == ("bwrap" if where == "bwrap works" else "user")


def test_two_bundles_built_at_once_from_one_checkout_both_get_a_wheel(tmp_path):
    """pip builds in the checkout's own build/ folder: two bundles made at once (two test workers)
    broke each other ("pip wheel ... returned non-zero exit status 1"); one build at a time now."""
    from concurrent.futures import ThreadPoolExecutor

    dests = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for d in dests:
        d.mkdir()
    with ThreadPoolExecutor(len(dests)) as pool_:
        wheels = list(pool_.map(autograder.build_wheel, dests))
    for d, whl in zip(dests, wheels):
        assert whl.parent == d and whl.stat().st_size > 100_000, whl
