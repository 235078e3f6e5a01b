"""Which system calls the sandbox's processes make: the measurement behind
:data:`attnlab.grading.sandbox.seccomp.ALLOWED`.

    python tools/trace_syscalls.py            # needs strace (Debian: apt-get install strace)

Grades every lab's solution and stub, and the buggy variants the lab tests use, with the
sandbox server started under ``strace -f`` (mode ``none``, so nothing of bwrap's own set-up is
counted), and prints each call the server and its children made, with a count, then the calls
of that list that the allow-list lacks. The server's whole life is traced: interpreter start,
``import torch``, the zygote, and every exercise's child.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    if shutil.which("strace") is None:
        print("strace is not installed (Debian: apt-get install strace)", file=sys.stderr)
        return 2
    out = Path(tempfile.mkdtemp(prefix="attnlab-trace-"))
    from attnlab import labs
    from attnlab.grading import Limits, grade
    from attnlab.grading.sandbox import pool, seccomp

    real_argv = pool._server_argv

    def traced(inside: bool) -> list[str]:  # the server under strace: every process it starts, one file each
        return ["strace", "-ff", "-qq", "-o", str(out / "trace"), *real_argv(inside)]

    pool._server_argv = traced
    files = []
    for lab in labs.LABS:
        folder = ROOT / "labs" / "track1" / lab.name
        files += [(folder / lab.file, lab.name), (folder / "solutions" / lab.file, lab.name)]
    for path, lab in files:
        report = grade(path, sandbox="none", lab=lab, limits=Limits(timeout_s=20.0), total_timeout_s=600)
        print(f"{lab} {path.name}: {report.score:g}/{report.max_score:g}", file=sys.stderr)
    counts: Counter = Counter()
    call = re.compile(r"^(?:<\.\.\. )?([a-z_0-9]+)[( ]")
    for line in (ln for f in out.glob("trace*") for ln in f.read_text(errors="replace").splitlines()):
        m = call.match(line)
        if m and m.group(1) not in ("exited", "killed", "resumed"):
            counts[m.group(1)] += 1
    for name, n in sorted(counts.items()):
        print(f"{name} {n}")
    missing = sorted(set(counts) - set(seccomp.ALLOWED) - {"clone"})  # clone: allowed without CLONE_NEW* flags
    print(f"# {len(counts)} calls; not in seccomp.ALLOWED: {' '.join(missing) or 'none'}")
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
