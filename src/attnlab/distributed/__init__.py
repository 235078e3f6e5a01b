"""Context parallelism on torch.distributed: a sequence too long for one process, split across ranks.

Each of W ranks holds a slice of the sequence, ``(B, H, L/W, E)`` (:func:`shard_sequence`, in the
``"contiguous"`` or the causally balanced ``"zigzag"`` layout), and gets its slice of the output:

* :func:`ring_attention`: key/value slices travel around a ring of ranks, partial results merged
  by their log-sum-exps (Liu et al., 2023). Any head count; one slice a step, W steps.

Forward and backward, on gloo (CPU) or NCCL.
"""

from __future__ import annotations

from attnlab.distributed.layout import LAYOUTS, gather_sequence, positions, shard_sequence
from attnlab.distributed.ring import MESSAGE_BYTES, ring_attention

__all__ = ["ring_attention", "shard_sequence", "gather_sequence", "positions", "LAYOUTS", "MESSAGE_BYTES"]
