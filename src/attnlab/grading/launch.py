"""Start the sandbox server (the zygote) as early as possible, without importing torch.

The server needs ~1.5 s to import torch. Started first thing, it does so while the
grader's own process imports torch on the other core.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Optional

_server: Optional[subprocess.Popen] = None


def start() -> subprocess.Popen:
    """The running server, started if there is none."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen(
            [sys.executable, "-c", "from attnlab.grading.sandbox import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
            start_new_session=True)
        _server.ready = False  # type: ignore[attr-defined]
    return _server


def stop() -> None:
    global _server
    if _server is not None:
        _server.kill()
        _server.wait()
        _server = None
