"""attnlab: self-attention from scratch, verified against PyTorch's SDPA.

Public API:

* :func:`attnlab.attention`: the one front door (:mod:`attnlab.dispatch`): SDPA's signature,
  run by the reference, the tiled path, flex or the decode path (``impl=``, :func:`use_impl`).
* :func:`attnlab.stable_softmax`: softmax that never overflows; fully masked rows give 0.
* :mod:`attnlab.functional`: ``scaled_dot_product_attention`` (torch SDPA's contract,
  written from scratch) and ``attention_weights``: the reference.
* :func:`attnlab.flash_attention` (:mod:`attnlab.tiled`): the same, tile by tile, with its
  native kernels; :mod:`attnlab.flex` (FlexAttention's API), :mod:`attnlab.decoding` (KV
  caches), :mod:`attnlab.distributed` (ring attention) beside it, all over one kernel layer
  (:mod:`attnlab.kernels`).
* :class:`attnlab.SelfAttention`, :class:`attnlab.MultiHeadAttention`, :class:`attnlab.KVCache`
  (:mod:`attnlab.modules`): the lesson's module, with ``trace``, and the models' modules.
* :mod:`attnlab.masks`: materialised bool masks (``True`` = attend).
* :mod:`attnlab.testing`: parity helpers against torch's SDPA, for any implementation.

Beside the library: :mod:`attnlab.labs` (the labs, a module each), :mod:`attnlab.grading`
(the grader and its sandbox), :mod:`attnlab.bench` (``attnlab bench``), :mod:`attnlab.doctor`,
and :mod:`attnlab.cli` (the command, thin).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "AttentionTrace",
    "KVCache",
    "MultiHeadAttention",
    "SelfAttention",
    "attention",
    "flash_attention",
    "use_impl",
    "TraceStep",
    "functional",
    "masks",
    "stable_softmax",
    "testing",
    "__version__",
]

# Loaded on first use, so that `attnlab --help` and the grader's launcher start
# without importing torch (~1.5 s).
_LAZY = {
    "functional": ("attnlab.functional", None),
    "masks": ("attnlab.masks", None),
    "testing": ("attnlab.testing", None),
    "doctor": ("attnlab.doctor", None),
    "tiled": ("attnlab.tiled", None),
    "dispatch": ("attnlab.dispatch", None),
    "attention": ("attnlab.dispatch", "attention"),
    "use_impl": ("attnlab.dispatch", "use_impl"),
    "flash_attention": ("attnlab.tiled", "flash_attention"),
    "SelfAttention": ("attnlab.modules", "SelfAttention"),
    "MultiHeadAttention": ("attnlab.modules", "MultiHeadAttention"),
    "KVCache": ("attnlab.modules", "KVCache"),
    "stable_softmax": ("attnlab.softmax", "stable_softmax"),
    "AttentionTrace": ("attnlab.trace", "AttentionTrace"),
    "TraceStep": ("attnlab.trace", "TraceStep"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # for type checkers and IDEs
    from attnlab import functional, masks, testing  # noqa: F401
    from attnlab.modules import SelfAttention  # noqa: F401
    from attnlab.softmax import stable_softmax  # noqa: F401
    from attnlab.trace import AttentionTrace, TraceStep  # noqa: F401
