"""attnlab: self-attention from scratch, verified against PyTorch's SDPA.

Public API:

* :func:`attnlab.stable_softmax`: softmax that never overflows; fully masked rows give 0.
* :mod:`attnlab.functional`: ``scaled_dot_product_attention`` (torch SDPA's contract,
  written from scratch) and ``attention_weights``.
* :class:`attnlab.SelfAttention`: the lesson's single-head module, with ``trace``.
* :mod:`attnlab.masks`: materialised bool masks (``True`` = attend).
* :mod:`attnlab.testing`: parity helpers against torch's SDPA, for any implementation.
"""

from attnlab import functional, masks, testing
from attnlab.modules import SelfAttention
from attnlab.softmax import stable_softmax
from attnlab.trace import AttentionTrace, TraceStep

__version__ = "0.1.0"

__all__ = [
    "AttentionTrace",
    "SelfAttention",
    "TraceStep",
    "functional",
    "masks",
    "stable_softmax",
    "testing",
    "__version__",
]
