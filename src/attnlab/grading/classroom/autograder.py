"""``attnlab autograder --out autograder.zip``: the same grader as a Gradescope autograder.

Gradescope runs ``setup.sh`` once to build the image and ``run_autograder`` for each
submission, in its own container, with the learner's files in
``/autograder/submission/`` and the results expected in
``/autograder/results/results.json`` (the schema ``attnlab grade --json`` writes). The
bundle holds:

* ``setup.sh``: installs bubblewrap (the OS sandbox), creates ``/autograder/venv`` and
  installs CPU-only torch and the pinned requirements, then this attnlab from its wheel;
* ``run_autograder``: :func:`run_gradescope` (``attnlab grade --gradescope /autograder``):
  grades ``/autograder/submission/<the lab's file>`` (or the submission's only ``.py`` file)
  into ``/autograder/results/results.json``, in the strongest sandbox that passes its
  self-test here (:func:`choose_sandbox`): bwrap; else, where bwrap cannot run in the
  container (the usual case), the learner as a fresh unprivileged uid
  (:mod:`attnlab.grading.sandbox.user`), with the bundle, attnlab's package and the results
  folder unreadable to it while it runs; else nothing runs, and results.json says why, for
  the instructor, with 0 points (never as the learner's failed checks);
* ``requirements.txt``: torch, numpy, jaxtyping and the lab's own imports (lab 05: triton),
  pinned to the versions this bundle was made with; ``attnlab-<version>-py3-none-any.whl``; ``README.txt``.

For tests and offline builds ``setup.sh`` reads ``AUTOGRADER_ROOT`` (default ``/autograder``),
``ATTNLAB_VENV`` (an existing environment to install into), ``ATTNLAB_PIP_ARGS`` (replaces
the CPU-torch index arguments, e.g. ``--no-index --find-links DIR``) and
``ATTNLAB_SKIP_APT=1``; ``run_autograder`` reads the first two. :func:`try_bundle`
(``attnlab autograder --test FILE``) uses them to run a bundle in a simulated Gradescope
root on this machine, offline, before an instructor uploads it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import attnlab

if TYPE_CHECKING:
    from attnlab.labs import Lab

__all__ = ["build_bundle", "try_bundle", "SimulatedRoot", "SETUP_SH", "RUN_AUTOGRADER", "run_gradescope",
           "choose_sandbox", "find_submission", "out_of_reach"]

SETUP_SH = r"""#!/usr/bin/env bash
# attnlab autograder: Gradescope runs this once, as root, when it builds the image.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="${AUTOGRADER_ROOT:-/autograder}"
if [ "${ATTNLAB_SKIP_APT:-0}" != 1 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-pip bubblewrap >/dev/null
fi
VENV="${ATTNLAB_VENV:-$ROOT/venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP_ARGS="${ATTNLAB_PIP_ARGS:---extra-index-url https://download.pytorch.org/whl/cpu}"
# shellcheck disable=SC2086  (PIP_ARGS is a list of arguments)
"$VENV/bin/python" -m pip install --quiet $PIP_ARGS -r "$HERE/requirements.txt"
"$VENV/bin/python" -m pip install --quiet $PIP_ARGS --no-deps --force-reinstall "$HERE"/attnlab-*.whl
"$VENV/bin/python" -m attnlab.kernels.native || true   # build the native kernels once, into the image
echo "attnlab autograder installed into $VENV"
"""

RUN_AUTOGRADER = r"""#!/usr/bin/env bash
# attnlab autograder: Gradescope runs this once per submission, in its own container, as root.
# 'attnlab grade --gradescope' chooses the sandbox by a self-test of each exact one (bwrap, else
# a fresh unprivileged uid, else it refuses and says why in results.json), grades the
# submission, kills every process the learner left, and writes results.json last.
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PY="${ATTNLAB_VENV:-$ROOT/venv}/bin/python"
export PYTHONDONTWRITEBYTECODE=1   # no bytecode written into the installed package while grading
cd /
"$PY" -B -m attnlab grade --gradescope "$ROOT" --lab "@LAB@" --no-colour
exit 0   # the score is in results.json; a failing grade is not a failed autograder run
"""

README = """attnlab {version} autograder for Gradescope.

Upload this zip as the autograder of a programming assignment (Ubuntu base image). Learners
submit {file} (lab track1/{lab}: {title}). Each submission is graded by `attnlab grade`
in its own container; results.json carries the score, one test per check with the named
mistakes as tags, and a run id (extra_data.run). Each submission's inputs are drawn fresh from the
OS's secrets: no learner can know them in advance.
"""


def choose_sandbox() -> tuple[str, str]:
    """The sandbox for this container, chosen by a self-test of each exact one the grader
    would use: ``('bwrap', how)``, ``('user', how)`` (root only) or ``('', why neither runs)``."""
    from attnlab.grading.sandbox import self_test

    ok, how = self_test("bwrap")
    if ok:
        return "bwrap", how
    if os.geteuid() != 0:
        return "", (f"bwrap cannot run here ({how}), and the grader is not root, so it cannot run the learner as "
                    f"a user of its own either")
    ok_user, how_user = self_test("user")
    if ok_user:
        return "user", f"bwrap cannot run here ({how}), so {how_user}"
    return "", f"bwrap cannot run here ({how}), and neither can an unprivileged user of its own ({how_user})"


def find_submission(folder: Path, file: str) -> Path:
    """The learner's file in Gradescope's ``submission/`` by the rule class grading uses
    (:func:`attnlab.grading.intake.choose`: the lab's file, another case, an LMS re-download, a
    notebook, the only .py file, a zip archive), else ``folder/file`` (which then does not
    exist, and is graded as 'no file'). Looks only (``lstat``): a link is never taken for a
    file, and the one read (no link followed below ``folder``) refuses what is not a regular file."""
    return choose_submission(folder, file)[0]


def choose_submission(folder: Path, file: str) -> tuple[Path, str]:
    """:func:`find_submission` and how the file was chosen, in words ('' for the lab's file)."""
    from attnlab import labs
    from attnlab.grading import intake

    wanted = folder / file
    if os.path.lexists(wanted):
        return wanted, ""
    choice = intake.choose(folder, file, tuple(f for f in labs.LAB_FILES if f != file))
    return (choice.path, choice.how) if choice.path is not None else (wanted, "")


@contextmanager
def out_of_reach(paths: list[Path]) -> Iterator[None]:
    """Each path made 0700 (its owner, root, only) while the learner's uid runs; restored after."""
    saved = []
    try:
        for p in paths:
            if p.exists():
                saved.append((p, p.stat().st_mode & 0o7777))
                os.chmod(p, 0o700)
        yield
    finally:
        for p, mode in saved:
            os.chmod(p, mode)


def run_gradescope(root: os.PathLike, lab: str) -> dict:
    """What ``run_autograder`` does: grade ``root/submission`` for ``lab`` and write
    ``root/results/results.json``. The sandbox is :func:`choose_sandbox`'s; in mode 'user'
    the bundle (``root/source``), attnlab's own package and the results folder are out of
    the learner's reach while it runs, and every process of its uid is killed before
    results.json is written, last, by this process. Returns what was written.

    Total: whatever the submission holds and whatever fails in the grader, a valid results.json
    is written (the grader's own failure: "the grader failed on this submission", 0 points)."""
    from attnlab import labs
    from attnlab.grading.grader import not_graded
    from attnlab.grading.output import write_json

    root = Path(root)
    the_lab = labs.find_lab(lab)
    results = root / "results"
    results.mkdir(parents=True, exist_ok=True)
    try:
        data = _graded_on_gradescope(root, the_lab, results)
    except Exception as exc:  # the grader's failure, never the learner's: still a results.json
        why = (f"the grader failed on this submission ({type(exc).__name__}); for the instructor: grade it again, "
               "or report this")
        try:
            data = not_graded(root / "submission" / the_lab.file, why, lab=the_lab).to_gradescope()
        except Exception:
            data = {"score": 0.0, "output": why, "tests": [], "extra_data": {}}
    write_json(results / "results.json", data, indent=1)
    return data


def _graded_on_gradescope(root: Path, the_lab: "Lab", results: Path) -> dict:
    """:func:`run_gradescope`'s grading: the report as Gradescope's dict."""
    from attnlab.grading.grader import grade, not_graded

    submission, chosen_as = choose_submission(root / "submission", the_lab.file)
    mode, how = choose_sandbox()
    if not mode:
        fix = ("use a base image where bubblewrap can run, or run run_autograder as root" if os.geteuid() != 0
               else "give the container what the reason above names, or use a base image where bubblewrap can run")
        report = not_graded(submission, f"the grader cannot isolate learner code in this container: {how}. For the "
                                        f"instructor: {fix}", lab=the_lab)
    else:
        share = Path(sys.prefix) / "share" / "attnlab"  # the wheel's lab materials and solutions
        hidden = [results, root / "source", Path(attnlab.__file__).resolve().parent, share] if mode == "user" else []
        with out_of_reach(hidden):
            # root opens the learner's file only through read_submission: beneath submission/, no link followed
            report = grade(submission, lab=the_lab, sandbox=mode, untrusted=True, within=root / "submission",
                           note=f"graded {chosen_as}" if chosen_as else "")  # its processes: all dead now
    data = report.to_gradescope()
    data["extra_data"]["sandbox"]["chosen"] = how
    return data


def _pin(name: str) -> str:
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return name
    return f"{name}=={version.split('+')[0]}"  # torch 2.13.0+cpu -> torch==2.13.0 (the CPU index serves it)


def _project_root() -> Optional[Path]:
    root = Path(attnlab.__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def build_wheel(dest: Path) -> Path:
    """attnlab's wheel in ``dest``: built from its source checkout, or, in a plain ``pip install``
    (no checkout), packed again from the installed distribution's own files
    (:func:`repack_installed`)."""
    root = _project_root()
    if root is None:
        return repack_installed(dest)
    import fcntl

    # pip builds in the checkout's own build/ and egg-info folders: two bundles built at once (two
    # test workers, two terminals) broke each other's wheel, so one build at a time per checkout
    with open(root / "pyproject.toml", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "-w", str(dest), str(root)], check=True, capture_output=True, text=True)
    wheels = sorted(dest.glob("attnlab-*.whl"))
    if not wheels:
        raise RuntimeError(f"attnlab autograder: pip wheel left no attnlab wheel in {dest}")
    return wheels[-1]


def repack_installed(dest: Path) -> Path:
    """A wheel of the installed attnlab, made from the files its RECORD lists (the package, the
    labs' materials under ``share/``, the dist-info), with a fresh RECORD: what an instructor who
    only ran ``pip install attnlab`` bundles. Compiled caches (``__pycache__``) are left out."""
    import base64
    import hashlib

    dist = importlib.metadata.distribution("attnlab")
    name, version = "attnlab", dist.version
    info, data = f"{name}-{version}.dist-info", f"{name}-{version}.data"
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    record: list[str] = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for f in dist.files or []:
            rel = f.as_posix()
            if "__pycache__" in rel or rel.endswith((".pyc", "RECORD", "INSTALLER", "direct_url.json", "REQUESTED")):
                continue
            path = Path(dist.locate_file(f)).resolve()
            if not path.is_file():
                continue
            if rel.startswith("../"):  # data files: <prefix>/share/... is ../../../share/... from site-packages
                parts = Path(rel).parts
                if "share" not in parts:
                    continue
                arc = f"{data}/data/" + "/".join(parts[parts.index("share"):])
            elif rel.startswith((f"{name}/", f"{info}/")):
                arc = rel
            else:
                continue
            body = path.read_bytes()
            z.writestr(arc, body)
            h = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={h},{len(body)}")
        record.append(f"{info}/RECORD,,")
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    if not any(r.startswith(f"{name}/__init__.py,") for r in record):
        wheel.unlink()
        raise RuntimeError("attnlab autograder: this attnlab install has no package files to pack (an editable "
                           "install without its checkout?); pass --wheel with the attnlab wheel to bundle")
    return wheel


def build_bundle(out: os.PathLike, wheel: Optional[os.PathLike] = None, lab: "Lab | str" = "01") -> Path:
    """Write the autograder zip of lab ``lab`` (its name or number) to ``out``; returns its path."""
    from attnlab import labs

    the_lab = labs.find_lab(lab)
    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        whl = Path(wheel) if wheel is not None else build_wheel(Path(tmp))
        if not whl.is_file() or not whl.name.startswith("attnlab-") or whl.suffix != ".whl":
            raise ValueError(f"attnlab autograder: --wheel must be an attnlab-*.whl file, got {whl}")
        # the lab's own imports too (lab 05: triton, run by its interpreter: no GPU, no CUDA)
        needed = dict.fromkeys(("torch", "numpy", "jaxtyping", *the_lab.needs))
        requirements = "\n".join(_pin(n) for n in needed) + "\n"
        tmp_zip = out.with_name(f".{out.name}.tmp")
        with zipfile.ZipFile(tmp_zip, "w", zipfile.ZIP_DEFLATED) as z:
            run = RUN_AUTOGRADER.replace("@LAB@", the_lab.name).replace("@FILE@", the_lab.file)
            for name, text in (("setup.sh", SETUP_SH), ("run_autograder", run)):
                info = zipfile.ZipInfo(name)
                info.external_attr = 0o755 << 16  # executable when unpacked
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, text)
            z.writestr("requirements.txt", requirements)
            z.writestr("README.txt", README.format(version=attnlab.__version__, file=the_lab.file, lab=the_lab.name,
                                                 title=the_lab.title))
            z.write(whl, whl.name)
        os.replace(tmp_zip, out)
    return out


class SimulatedRoot:
    """A bundle unpacked under ``work`` as Gradescope lays it out (``autograder/source``,
    ``submission``, ``results``), with a fresh venv that sees this environment's packages
    (torch, numpy, jaxtyping) through a ``.pth`` file, so ``setup.sh`` runs offline
    (``--no-index``, no apt) and installs attnlab from the bundled wheel."""

    def __init__(self, bundle: os.PathLike, work: os.PathLike):
        import site
        import sysconfig

        work = Path(work)
        self.root = work / "autograder"
        self.source = self.root / "source"
        with zipfile.ZipFile(bundle) as z:
            self.names = set(z.namelist())
            z.extractall(self.source)
        for name in ("setup.sh", "run_autograder"):
            os.chmod(self.source / name, 0o755)
        self.venv = work / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.venv)], check=True)
        venv_site = next(self.venv.glob("lib/python*/site-packages"))
        here = [sysconfig.get_paths()["purelib"], *site.getsitepackages(),
                *(p for p in sys.path if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages"))]
        (venv_site / "host.pth").write_text("\n".join(dict.fromkeys(p for p in here if Path(p).is_dir())) + "\n")
        self.env = {**os.environ, "AUTOGRADER_ROOT": str(self.root), "ATTNLAB_VENV": str(self.venv),
                    "ATTNLAB_PIP_ARGS": "--no-index", "ATTNLAB_SKIP_APT": "1"}
        self.results = self.root / "results" / "results.json"

    def setup(self) -> subprocess.CompletedProcess:
        """Run the bundle's ``setup.sh`` (the venv has no pip: this environment's, seen through
        host.pth, installs into it)."""
        return subprocess.run(["bash", str(self.source / "setup.sh")], capture_output=True, text=True, env=self.env,
                              timeout=1200)

    def run(self, submission: Optional[os.PathLike] = None) -> subprocess.CompletedProcess:
        """Put ``submission`` (alone) in ``submission/`` and run ``run_autograder``; without one,
        run it on what ``submission/`` already holds."""
        sub = self.root / "submission"
        if submission is not None:
            shutil.rmtree(sub, ignore_errors=True)
            sub.mkdir(parents=True)
            shutil.copyfile(submission, sub / Path(submission).name)
        self.results.parent.mkdir(parents=True, exist_ok=True)
        self.results.unlink(missing_ok=True)
        return subprocess.run(["bash", str(self.source / "run_autograder")], capture_output=True, text=True,
                              env=self.env, timeout=1200)


def try_bundle(bundle: os.PathLike, submission: os.PathLike, work: os.PathLike,
               progress=lambda text: None) -> dict:
    """Run ``bundle`` on ``submission`` the way Gradescope would, in a :class:`SimulatedRoot`
    under ``work``, and return the results.json it wrote.

    Raises:
        RuntimeError: setup.sh or run_autograder failed, or no results.json was written
            (the message holds the end of its output).
    """
    root = SimulatedRoot(bundle, work)
    progress("setup.sh (installing the bundled wheel offline)")
    setup = root.setup()
    if setup.returncode != 0:
        raise RuntimeError(f"setup.sh failed (exit {setup.returncode}):\n{(setup.stdout + setup.stderr)[-1500:]}")
    progress("run_autograder (grading the submission)")
    run = root.run(submission)
    if run.returncode != 0 or not root.results.is_file():
        raise RuntimeError(f"run_autograder failed (exit {run.returncode}):\n{(run.stdout + run.stderr)[-1500:]}")
    return json.loads(root.results.read_text())
