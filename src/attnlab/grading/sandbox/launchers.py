"""What lab 05's launchers may run in torch: allocate, view, copy, convert and launch; nothing else.

An exercise with kernels (:attr:`.exercise.Exercise.kernels`) is graded on what those kernels
compute, so the Python around them (the launchers, the ``autograd.Function``, the given
``attention_and_grads``) may not compute. This is an allow-list, deny by default: every ATen kernel
the call dispatched must be one of :data:`LAUNCHER_ATEN` (by its packet name, any overload). The
deny-list it replaced (matmuls, ``exp``, ``log``, max, reductions along a dim) let a second
attacker of issue 61 score 100/100 with torch's answer built from ``mul``/``add`` loops, an ``exp``
series, a Newton ``log`` and ``-amin(-x)``, which the kernels only copied.

And no value may leave a tensor for Python, where arithmetic is torch's no more and no recorder
sees it: ``item()`` and ``float(t)`` dispatch ``_local_scalar_dense`` (not on the list), while
``tolist()`` and ``repr`` dispatch nothing, so the Python-level functions of
:data:`VALUE_ESCAPES` are refused by name too. The static rule keeps the rest out of reach
(``numpy``, storages, ``memoryview``, ``ctypes``: :mod:`..static`).

What the four independent solutions' launchers and Triton's interpreter dispatch, measured with
:class:`.recorder.Policy` on (2, 4, 2, 24, 40, 16) causal GQA calls: ``empty``, ``empty_like``,
``zeros``, ``new_empty``, ``copy_``, ``set_`` (the interpreter's host copies) and, in
``attention_and_grads``, ``detach``. Views, dtype conversions and GQA's ``repeat_interleave``
(a clone of an expanded view) are data movement an honest launcher may write, so they are listed;
constants from Python (``torch.tensor``, ``full``, ``fill_``) are not.

Evidence, like every record made in the learner's process (a file that switches the recorder off is
caught by the stores' record and by the static rule, not by this).
"""

from __future__ import annotations

__all__ = ["LAUNCHER_ATEN", "REINTERPRET", "VALUE_ESCAPES", "moves_data", "outside_kernels"]

# ATen packets a launcher may dispatch: allocation, views, copies and conversions
LAUNCHER_ATEN = frozenset({
    # allocation (zeros: accumulators a kernel adds into)
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "zero_",
    # views
    "view", "_unsafe_view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "select",
    "slice", "as_strided", "t", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk", "narrow",
    "movedim", "_reshape_alias",
    # copies and conversions (.contiguous(), .float(), .to(dtype), repeat_interleave's clone)
    "copy_", "clone", "_to_copy", "contiguous",
    # Triton's interpreter: its host copies of each argument and back
    "set_",
})
# overloads of listed packets that are not data movement: a view of the bytes as another dtype (a ninth
# attacker handed K and V to the kernels as int32, so that no float load saw their NaN)
REINTERPRET = frozenset({"aten.view.dtype"})
# Python-level functions that hand a tensor's values to Python, where no recorder sees the arithmetic
VALUE_ESCAPES = frozenset({"tolist", "numpy", "__repr__", "__str__", "__format__", "__array__", "__dlpack__",
                           "__reduce_ex__", "__reduce__", "__getstate__", "__deepcopy__"})


def moves_data(name: str) -> bool:
    """Whether the ATen kernel ``name`` (``aten.view.default``) only allocates, views, copies or converts."""
    return name.startswith("aten.") and name.split(".")[1] in LAUNCHER_ATEN and name not in REINTERPRET


def outside_kernels(aten: list, functions: list) -> list:
    """What a call ran outside its kernels: the ATen kernels among ``aten`` (``aten.mul.Tensor``) whose
    packet is not in :data:`LAUNCHER_ATEN`, and the functions among ``functions``
    (``TensorBase.tolist``) named in :data:`VALUE_ESCAPES`; distinct, sorted, at most 8."""
    found = {n for n in aten if n.startswith("aten.") and not moves_data(n)}
    found |= {n for n in functions if n.rsplit(".", 1)[-1] in VALUE_ESCAPES}
    return sorted(found)[:8]
