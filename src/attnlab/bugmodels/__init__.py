"""One library of attention bug models, for the doctor and for every lab's judge (package-internal).

A bug model is the right algorithm with named choices changed; each choice maps to one code of
the shared vocabulary (:mod:`attnlab.mistakes`), so a lab and the doctor name the same mistake
the same way. The models live here:

* :mod:`.sdpa_forward`: SDPA's forward on whole matrices (scale, softmax axis, transposes, masks, causal
  corners, empty rows, GQA maps), fitted by ``attnlab doctor`` to a function's outputs, and through the
  doctor by the labs' SDPA-like exercises (labs 02 and 03).
* :mod:`.sdpa_backward`: SDPA's backward on whole matrices (sinks, bool masks, GQA, precision),
  fitted by ``attnlab doctor --backward`` to a function's gradients on designed probes.
* :mod:`.flash_backward`: FlashAttention-2's tiled backward as two kernels (dQ over key tiles,
  dK/dV over query tiles) with per-kernel choices (scale, exp base, mask, tiles visited, D, dS,
  accumulation, dropped tiles, GQA maps), which labs 04 and 05 ask with :func:`explain`: which
  choices, one or two at a time, reproduce the learner's gradients on every case of an exercise.
* :mod:`.flash_fits`: what no model reproduces, named by what its gradients are made of (:func:`fit`:
  the tile pairs each kernel added, a D or a normaliser of its own per query row).
"""

from __future__ import annotations

from attnlab.bugmodels.flash_backward import (FLASH_FINDINGS, FlashBackward, FlashCase, Explanation, explain,
                                              flash_gradients, moves)
from attnlab.bugmodels.flash_fits import Fitted, fit

__all__ = ["FLASH_FINDINGS", "FlashBackward", "FlashCase", "Explanation", "explain", "flash_gradients", "moves",
           "Fitted", "fit", "gradients_of"]


def gradients_of(explanation, case: FlashCase) -> dict:
    """``dq``, ``dk``, ``dv`` (float64) that ``explanation`` (an :class:`Explanation` of :func:`explain` or a
    :class:`Fitted` of :func:`fit`) gives on ``case``."""
    if isinstance(explanation, Fitted):
        return explanation.gradients(case)
    return flash_gradients(case, explanation.model)
