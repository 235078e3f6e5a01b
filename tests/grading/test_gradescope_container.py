"""Every lab's bundle in a real container, as Gradescope runs it (issue 47, item 10).

Gradescope runs ``run_autograder`` as root in a Docker container: Docker's default seccomp profile
(no ``unshare``, so bwrap cannot make its namespaces) and capabilities, 768 MB of memory, half a CPU.
``tools/gradescope_container.py`` does exactly that with podman, an image built here by debootstrap
from Debian's packages, and Docker's own profile from Debian's package of Docker's sources. The
image and the requirements' layer are cached under /var/cache/attnlab-container (the first run on a
machine builds them: about 2.5 minutes, then about 20 s a lab).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.labs import LABS
from helpers.ci import cannot_run

pytestmark = [pytest.mark.container, pytest.mark.sandbox, pytest.mark.subprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gradescope_container", REPO / "tools" / "gradescope_container.py")
ct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ct)

MEMORY_BYTES = 768 * 2**20


@pytest.fixture(scope="module")
def podman():
    try:
        return ct.Podman()
    except ct.Unavailable as exc:
        cannot_run(f"no container runtime here: {exc}")


def _solution(lab) -> Path:
    return REPO / "labs" / "track1" / lab.name / "solutions" / lab.file


@pytest.mark.parametrize("lab", [lab.name[:2] for lab in LABS])
def test_every_labs_solution_scores_100_in_gradescopes_container(podman, lab, tmp_path):
    """As root under Docker's profile bwrap cannot start, so the grader must choose mode 'user' by
    its self-test, say why, and grade the solution 100 within 768 MB and half a CPU."""
    the_lab = next(x for x in LABS if x.name.startswith(lab))
    bundle = tmp_path / "autograder.zip"
    assert main(["autograder", "--lab", lab, "--out", str(bundle)]) == 0
    image = ct.bundle_image(podman, bundle)
    try:
        data, printed = ct.run_submission(podman, image, [_solution(the_lab)])
    finally:
        ct.remove_image(podman, image)
    assert data["score"] == 100, (data.get("output"), printed[-2000:])
    sandbox = data["extra_data"]["sandbox"]
    assert sandbox["made_by"] == "user", sandbox
    assert "bwrap cannot run here" in sandbox["chosen"] and "namespace" in sandbox["chosen"], sandbox["chosen"]
    peak = re.search(r"peak memory: (\d+)", printed)
    assert peak is not None, printed[-500:]
    assert int(peak.group(1)) < MEMORY_BYTES, f"peak {int(peak.group(1)) / 2**20:.0f} MB"


def test_a_stub_in_the_container_gets_its_named_row_not_a_crash(podman, tmp_path):
    """The learner's unfinished file in the same container: a valid results.json below 100, each
    failed check with its own row (never the grader's failure)."""
    the_lab = LABS[0]
    bundle = tmp_path / "autograder.zip"
    assert main(["autograder", "--lab", "01", "--out", str(bundle)]) == 0
    image = ct.bundle_image(podman, bundle)
    try:
        data, printed = ct.run_submission(podman, image, [REPO / "labs" / "track1" / the_lab.name / the_lab.file])
    finally:
        ct.remove_image(podman, image)
    assert data["score"] < 100, data.get("output")
    assert "grader failed" not in data["output"], data["output"]
    assert any(t["score"] < t["max_score"] for t in data["tests"]), data["tests"][:3]


def test_a_container_that_drops_setuid_says_what_it_lacks_and_how_to_give_it(podman, tmp_path):
    """A hardened runtime (``--cap-drop SETUID,SETGID``): neither bwrap nor mode 'user' can run, and
    results.json says which capabilities are missing and the flag that gives them back. Before, the
    whole reason was Python's "Exception occurred in preexec_fn", twice, and "run it as root"."""
    bundle = tmp_path / "autograder.zip"
    assert main(["autograder", "--lab", "01", "--out", str(bundle)]) == 0
    image = ct.bundle_image(podman, bundle)
    caps = tuple(c for c in ct.DOCKER_CAPS if c not in ("SETUID", "SETGID"))
    try:
        data, printed = ct.run_submission(podman, image, [_solution(LABS[0])], caps=caps)
    finally:
        ct.remove_image(podman, image)
    assert data["score"] == 0, data["output"]
    out = data["output"]
    assert "CAP_SETUID and CAP_SETGID" in out and "--cap-add SETUID --cap-add SETGID" in out, out
    assert "preexec_fn" not in out and "run run_autograder as root" not in out, out
