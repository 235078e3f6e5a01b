"""attnlab's kernel layer: the contract every fast path shares (issue 24, first step).

The contract, which :mod:`attnlab.tiled`, :mod:`attnlab.flex` and the ring
(:mod:`attnlab.distributed`) use through these names only:

* **the layout** (:mod:`.layout`): ``q4 (Nb, r, L, E)``, ``k3 (Nb, S, E)``, ``v3 (Nb, S, Ev)``,
  ``Nb = B * Hkv`` key/value heads, the ``r = H / Hkv`` query heads of a group stacked on the
  query axis (:class:`Layout` maps the user's broadcast ``(..., L, E)`` onto it, without
  repeating K or V);
* **base-2 state** (:mod:`.numerics`): the online softmax keeps ``m_i``, ``l_i`` and ``acc``
  per query row in base 2, and hands on ``(out, lse2)``: the normalised output and
  ``lse2 = m_i + log2(l_i)`` (``-inf`` for a row that saw no key, output 0);
* **merge** (:func:`merge_`): two partial results over disjoint keys combine exactly through
  their ``lse2``: this is how the ring joins blocks, and how a split over S joins its pieces;
* **when the fast paths hold** (:func:`finite_inputs`, :func:`lse_absorbed`,
  :func:`needs_natural_units`): the native kernels' base-2 arithmetic needs finite inputs
  and an ``lse2`` that has not swallowed ``log2(l_i)``; otherwise the pure code runs.

* **the online softmax and its backward, once** (:mod:`.online`): :func:`online.start`,
  :func:`online.update`, :func:`online.finish` and :func:`online.backward_tile` are the only
  place the running state ``(m_i, l_i, acc)`` and FlashAttention-2's tile gradients are
  written in PyTorch; the tiled path (base 2) and flex's pure path (natural units, with a
  ``score_mod``) both run their tiles through them.

In C++ (``csrc/``, built and loaded by :mod:`.native`), ``kernels.h`` is the same layer: the
row pass, the online-softmax step (``online_update``), its end (``finish_rows``), the
log-sum-exp merge (``merge_rows``), the tile backward's two halves and (``BackwardSetup``)
the backward's checks, strides and tasks, shared by ``flash.cpp`` (dense and masked tiles),
``block_sparse.cpp`` (flex's block masks) and ``decode.cpp`` (a few rows against a KV cache,
:mod:`.decode`). ``bf16_gemm.h`` is the bf16 route's GEMM; a kernel is written once over a
GEMM policy (``Gemm32``, ``GemmBf16``). The one front door is :func:`attnlab.dispatch.attention`
(reference, tiled, flex, decode), which the modules and the transformers integration use.

Which tiles a query block visits stays with each kernel (all key blocks up to the causal
diagonal; the blocks a BlockMask keeps; the chunks of a cache): that is what makes them
different kernels. The arithmetic on a tile is written once in each language.
"""

from attnlab.kernels import online
from attnlab.kernels.layout import Layout, dense_rows
from attnlab.kernels.numerics import LOG2E, block_size, finite_inputs, lse_absorbed, merge_, needs_natural_units

__all__ = ["online", "Layout", "dense_rows", "LOG2E", "merge_", "finite_inputs", "lse_absorbed", "needs_natural_units",
           "block_size"]
