"""Context parallelism on torch.distributed: a sequence too long for one process, split across ranks.

Each of W ranks holds a slice of the sequence, ``(B, H, L/W, E)`` (:func:`shard_sequence`, in the
``"contiguous"`` or the causally balanced ``"zigzag"`` layout), and gets its slice of the output:

* :func:`ring_attention`: key/value slices travel around a ring of ranks, partial results merged
  by their log-sum-exps (Liu et al., 2023). Any head count; one slice a step, W steps.
* :func:`ulysses_attention`: two all-to-alls, heads scattered and the sequence gathered
  (DeepSpeed-Ulysses): each rank attends its H/W heads over the whole sequence. ``H % W == 0``.

* :func:`context_parallel_attention`: USP, Ulysses inside each group of a 2-D mesh and the ring
  across the groups (:func:`usp_shard` says which rows a rank holds).

All take the same arguments with the same meanings (``is_causal``, ``scale``, ``layout``,
``enable_gqa``, ``mask_mod`` over absolute positions, ``sinks``), forward and backward, on gloo
(CPU) or NCCL. :mod:`attnlab.distributed.testing` runs W gloo ranks inside a test.
"""

from __future__ import annotations

# torch._dynamo before any process group: the local kernels ask torch.compiler.is_compiling(), which imports
# it on first use; imported that way inside a rank's first backward, after gloo's threads had started, one
# rank in 2 to 4 runs of 6 (4 ranks, Ulysses) aborted at interpreter exit ("terminate called without an
# active exception"); imported here first, 0 of 8 (and 0 of 12 with a gc.collect() before the exit)
import torch._dynamo  # noqa: F401  (the import is the point)

from attnlab.distributed.layout import LAYOUTS, gather_sequence, positions, shard_sequence
from attnlab.distributed.ring import MESSAGE_BYTES, ring_attention
from attnlab.distributed.ulysses import kv_heads_for, ulysses_attention
from attnlab.distributed.usp import context_parallel_attention, usp_groups, usp_shard

__all__ = ["ring_attention", "ulysses_attention", "context_parallel_attention", "usp_shard", "usp_groups",
           "kv_heads_for", "shard_sequence", "gather_sequence", "positions",
           "LAYOUTS", "MESSAGE_BYTES"]
