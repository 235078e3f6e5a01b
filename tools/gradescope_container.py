"""Run an autograder bundle the way Gradescope does: as root, in a Docker-like container.

Gradescope builds one image per assignment by running the bundle's ``setup.sh`` as root, and runs
``run_autograder`` for each submission in a fresh container of that image, as root, with Docker's
default seccomp profile and capabilities, 768 MB of memory and half a CPU (its defaults). This
tool does the same with podman, offline, with nothing pulled from a registry:

* **the base image** is Debian bookworm built here by ``debootstrap`` (Debian's packages:
  ``python3``, ``python3-venv``, ``bubblewrap``), imported into a podman store of its own under
  :data:`CACHE`. No network inside: ``setup.sh`` runs with ``ATTNLAB_SKIP_APT=1`` and installs the
  bundle's pinned requirements from a wheelhouse downloaded here (``pip download``);
* **the bundle's image** is that base after the bundle's own ``setup.sh``, committed. The venv
  with the requirements is cached as a layer keyed by ``requirements.txt`` and ``setup.sh`` (as
  Docker's build cache would), and ``setup.sh`` then runs again on it for each bundle;
* **each submission** runs in a fresh container of that image: ``--memory 768m --cpus 0.5``,
  Docker's capability set, and Docker's own default seccomp profile, read from Debian's
  ``golang-github-docker-docker-dev`` package (podman's default profile allows ``unshare``,
  Docker's does not: with podman's, bwrap gets further than it would on Gradescope).

Usage (root; ``make container`` installs podman, runc and debootstrap)::

    python tools/gradescope_container.py --lab 01 labs/track1/01-attention/solutions/attention.py
    python tools/gradescope_container.py --lab 05 --memory 512m my_flash_triton.py

It prints the results.json the bundle wrote. ``tests/grading/test_gradescope_container.py``
runs every lab's solution through it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

CACHE = Path(os.environ.get("ATTNLAB_CONTAINER_CACHE", "/var/cache/attnlab-container"))
SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "bubblewrap")
# Docker's default capability set (moby's oci/caps/defaults.go), stated in full: podman's own
# default lacks MKNOD, NET_RAW and AUDIT_WRITE.
DOCKER_CAPS = ("CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID", "SETFCAP",
               "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE")
DOCKER_PROFILE_DEB = "golang-github-docker-docker-dev"
DOCKER_PROFILE = "usr/share/gocode/src/github.com/docker/docker/profiles/seccomp/default.json"
GRADESCOPE_MEMORY, GRADESCOPE_CPUS = "768m", "0.5"


class Unavailable(RuntimeError):
    """No container can be run here; the message says what is missing and how to get it."""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def _key(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One builder of a cached thing at a time (two test workers may both want it)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _nested_limits() -> list[str]:
    """rlimits the runtime may set here: the ones this process has (it cannot raise them without
    CAP_SYS_RESOURCE, which a CI container may lack), the process count a little below."""
    import resource

    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[0], 32768)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


class Podman:
    """podman with a store of its own under :data:`CACHE` (cgroupfs, runc: cgroup v1 or v2)."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise Unavailable("Gradescope runs run_autograder as root; a rootful container needs root here")
        missing = [t for t in ("podman", "runc", "debootstrap") if shutil.which(t) is None]
        if missing:
            raise Unavailable(f"{', '.join(missing)} not installed (make container installs Debian's podman, runc "
                              "and debootstrap as root)")
        self.base = ["podman", "--root", str(CACHE / "storage"), "--runroot", "/run/attnlab-container",
                     "--storage-driver", "overlay", "--cgroup-manager", "cgroupfs", "--events-backend", "file",
                     "--runtime", shutil.which("runc")]

    def __call__(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return _run([*self.base, *args], **kw)

    def has_image(self, name: str) -> bool:
        return subprocess.run([*self.base, "image", "exists", name], capture_output=True).returncode == 0

    def run(self, image: str, script: str, *, name: str, volumes: dict[str, str] | None = None, env: dict[str, str] | None = None,
            limits: tuple[str, ...] | list[str] = (), timeout: float = 1200) -> subprocess.CompletedProcess:
        args = ["run", "--name", name, "--network", "none", *_nested_limits(), *limits]
        for host, inside in (volumes or {}).items():
            args += ["-v", f"{host}:{inside}:ro"]
        for k, v in (env or {}).items():
            args += ["-e", f"{k}={v}"]
        subprocess.run([*self.base, "rm", "-f", name], capture_output=True)
        return subprocess.run([*self.base, *args, image, "bash", "-c", script], capture_output=True, text=True,
                              timeout=timeout)


def docker_profile() -> Path:
    """Docker's default seccomp profile, from Debian's package of Docker's sources (extracted, not
    installed)."""
    dest = CACHE / "docker-profile"
    profile = dest / DOCKER_PROFILE
    with _locked("docker-profile"):
        if not profile.is_file():
            with tempfile.TemporaryDirectory() as tmp:
                _run(["apt-get", "download", DOCKER_PROFILE_DEB], cwd=tmp)
                deb = next(Path(tmp).glob("*.deb"))
                _run(["dpkg-deb", "-x", str(deb), str(dest)])
    if not profile.is_file():
        raise Unavailable(f"{DOCKER_PROFILE_DEB} holds no {DOCKER_PROFILE}")
    return profile


def base_image(podman: Podman) -> str:
    """Debian bookworm with :data:`PACKAGES`, built by debootstrap once and imported."""
    name = f"attnlab-gradescope-base:{_key(SUITE, *PACKAGES)}"
    with _locked("base"):
        if not podman.has_image(name):
            with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
                rootfs = Path(tmp) / "rootfs"
                _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(rootfs)],
                     timeout=1800)
                tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
                _run([*podman.base, "import", "-", name], stdin=tar.stdout, timeout=600)
                tar.wait()
    return name


def wheelhouse(requirements: str) -> Path:
    """The pinned requirements and their dependencies as wheels for CPython 3.11 (bookworm's),
    downloaded here once: ``setup.sh`` installs from them with ``--no-index``."""
    dest = CACHE / "wheels" / _key(requirements)
    with _locked("wheels"):
        if not (dest / ".complete").exists():
            dest.mkdir(parents=True, exist_ok=True)
            req = dest / "requirements.txt"
            req.write_text(requirements)
            _run([sys.executable, "-m", "pip", "download", "-q", "-d", str(dest), "-r", str(req), "--only-binary=:all:",
                  "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", "--platform",
                  "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any"], timeout=1800)
            (dest / ".complete").touch()
    return dest


_SETUP = "mkdir -p /autograder/source && cp -r /bundle/. /autograder/source/ && bash /autograder/source/setup.sh"
_OFFLINE = {"ATTNLAB_SKIP_APT": "1", "ATTNLAB_PIP_ARGS": "--no-index --find-links /wheels"}


def bundle_image(podman: Podman, bundle: Path) -> str:
    """The image Gradescope would build from ``bundle``: the base, after the bundle's ``setup.sh``."""
    with zipfile.ZipFile(bundle) as z:
        requirements, setup = z.read("requirements.txt").decode(), z.read("setup.sh")
        digest = _key(bundle.read_bytes())
    wheels = wheelhouse(requirements)
    deps = f"attnlab-gradescope-deps:{_key(base_image(podman), requirements, setup)}"
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        source = Path(tmp) / "source"
        with zipfile.ZipFile(bundle) as z:
            z.extractall(source)
        os.chmod(tmp, 0o755)
        volumes = {str(wheels): "/wheels", str(source): "/bundle"}
        with _locked(f"deps-{deps.split(':')[1]}"):
            if not podman.has_image(deps):  # the whole setup.sh on the base: the venv and the requirements
                _commit(podman, base_image(podman), deps, volumes, f"deps-{digest}")
        name = f"attnlab-gradescope-bundle:{digest}"
        if not podman.has_image(name):  # setup.sh again, as the bundle's own image build
            _commit(podman, deps, name, volumes, f"setup-{digest}")
    return name


def _commit(podman: Podman, image: str, name: str, volumes: dict[str, str], container: str) -> None:
    proc = podman.run(image, _SETUP, name=container, volumes=volumes, env=_OFFLINE)
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"setup.sh failed in the container (exit {proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        podman("commit", "-q", container, name)
    finally:
        subprocess.run([*podman.base, "rm", "-f", container], capture_output=True)


def remove_image(podman: Podman, name: str) -> None:
    """Remove a bundle's image (the base and the deps layers stay cached)."""
    subprocess.run([*podman.base, "rmi", "-f", name], capture_output=True)


def run_submission(podman: Podman, image: str, files: list[Path], *, memory: str = GRADESCOPE_MEMORY,
                   cpus: str = GRADESCOPE_CPUS, caps: tuple[str, ...] = DOCKER_CAPS,
                   timeout: float = 900) -> tuple[dict, str]:
    """``run_autograder`` on ``files`` (copied into ``/autograder/submission``) in a fresh container of
    ``image`` as Gradescope starts it (``caps``: the capabilities it keeps). Returns the results.json it wrote and what it printed (its last
    line: ``peak memory: N``, the container's peak in bytes, where its cgroup says)."""
    profile = docker_profile()
    limits = ["--memory", memory, "--memory-swap", memory, "--cpus", cpus, "--cap-drop", "all",
              "--cap-add", ",".join(caps), "--security-opt", f"seccomp={profile}"]
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        sub = Path(tmp) / "submission"
        sub.mkdir()
        for f in files:
            shutil.copyfile(f, sub / f.name)
        os.chmod(tmp, 0o755)
        container = f"run-{_key(image, *(f.read_bytes() for f in files), str(os.getpid()), tmp)}"
        script = ("mkdir -p /autograder/submission /autograder/results && cp -r /sub/. /autograder/submission/ && "
                  "bash /autograder/source/run_autograder; rc=$?; echo; echo \"peak memory: $(cat "
                  "/sys/fs/cgroup/memory/memory.max_usage_in_bytes /sys/fs/cgroup/memory.peak 2>/dev/null)\"; exit $rc")
        try:
            proc = podman.run(image, script, name=container, volumes={str(sub): "/sub"}, limits=limits,
                              timeout=timeout)
            out = Path(tmp) / "results.json"
            got = subprocess.run([*podman.base, "cp", f"{container}:/autograder/results/results.json", str(out)],
                                 capture_output=True, text=True)
            printed = proc.stdout + proc.stderr
            if got.returncode != 0:
                raise RuntimeError(f"run_autograder wrote no results.json (exit {proc.returncode}):\n{printed[-3000:]}")
            return json.loads(out.read_text()), printed
        finally:
            subprocess.run([*podman.base, "rm", "-f", container], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="example: python "
                                     "tools/gradescope_container.py --lab 01 labs/track1/01-attention/solutions/"
                                     "attention.py", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="the submission's files")
    parser.add_argument("--lab", required=True, help="the lab of the bundle (01-05)")
    parser.add_argument("--bundle", type=Path, help="an autograder.zip (default: one made now for --lab)")
    parser.add_argument("--memory", default=GRADESCOPE_MEMORY, help="the container's memory (Gradescope: 768m)")
    parser.add_argument("--cpus", default=GRADESCOPE_CPUS, help="the container's CPUs (Gradescope: 0.5)")
    args = parser.parse_args(argv)
    try:
        podman = Podman()
    except Unavailable as exc:
        print(f"cannot run a container here: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle
        if bundle is None:
            bundle = Path(tmp) / "autograder.zip"
            _run([sys.executable, "-m", "attnlab", "autograder", "--lab", args.lab, "--out", str(bundle)])
        print("building the image (setup.sh in a container) ...", file=sys.stderr)
        image = bundle_image(podman, bundle)
        try:
            print(f"run_autograder with --memory {args.memory} --cpus {args.cpus} ...", file=sys.stderr)
            data, printed = run_submission(podman, image, args.files, memory=args.memory, cpus=args.cpus)
        finally:
            remove_image(podman, image)
    print(printed[-2000:], file=sys.stderr)
    print(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
