"""Trusted steps the grader takes in the child around a learner's object: part of the runner.

Imports the standard library and torch, never attnlab. What an exercise grades must come from the
thing the rule names, not from a learner function that reports on it: lab 04's ex5 and lab 05's ex6
grade "one autograd Function", and until now the child called the file's given
``attention_and_grads``, which a third attacker of issue 61 rewrote to call the forward and backward
directly and return made-up saved shapes (100/100 in both labs with no Function written). So the
child runs those steps itself (:func:`autograd`): ``cls.apply`` on fresh leaves, the output's node
checked to be that Function's, the shapes that node saved, and torch's ``autograd.grad`` through
it. The torch functions it uses are captured (:func:`capture`) before the learner's file runs.

Likewise a function that *reports on* another (lab 01's ex9 returns how far ``self_attention`` is
from SDPA) could return a constant near the true, tiny difference. :func:`planted` runs it while
the module's function answers with a secret difference added: only a real measurement finds it.
"""

from __future__ import annotations

from typing import Any

_CAPTURED: dict = {}


def capture() -> None:
    """Keep the torch functions :func:`autograd` calls, before any learner code runs (the static
    rule refuses a store on torch's attributes; this keeps a rebinding from mattering even so)."""
    import torch

    base = torch._C.TensorBase
    _CAPTURED.update(grad=torch.autograd.grad, function=torch.autograd.Function, tensor=torch.Tensor,
                     detach=base.detach, requires_grad_=base.requires_grad_,
                     grad_fn=base.grad_fn.__get__, shape=base.shape.__get__, vars=vars, add=base.add,
                     no_grad=torch.no_grad, type=type, getattr=getattr)


def _tensors_in(values, module: str = "", depth: int = 0, seen: "set | None" = None) -> list:
    """The plain tensors among ``values``, looking a few levels deep into tuples, lists and dicts, and
    into the attributes of objects and classes the learner's file (module ``module``) defined: an eighth
    attacker kept the [L, S] weights on ``ctx.grad = Keep(p)``, an instance of the file's own class."""
    seen = set() if seen is None else seen
    out = []
    for v in values:
        kind = _CAPTURED["type"](v)
        if id(v) in seen or len(out) >= 256:
            continue
        seen.add(id(v))
        if kind is _CAPTURED["tensor"]:
            out.append(v)
        elif depth >= 4:
            continue
        elif kind in (tuple, list):
            out += _tensors_in(v, module, depth + 1, seen)
        elif kind is dict:
            out += _tensors_in(list(v.values()), module, depth + 1, seen)
        elif module and _CAPTURED["getattr"](v if isinstance(v, type) else kind, "__module__", None) == module:
            try:  # an instance of the file's class, or the class itself: its own attributes
                inner = list(_CAPTURED["vars"](v).values())
            except TypeError:  # no __dict__ (slots)
                continue
            out += _tensors_in(inner, module, depth + 1, seen)
    return out[:256]


def autograd(cls: Any, args: tuple, name: str, module: Any = None) -> tuple:
    """``(o, dq, dk, dv, saved)`` of the learner's Function ``cls`` on ``args = (q, k, v, do,
    is_causal)``: ``o = cls.apply(q, k, v, is_causal)`` on leaves that require grad, ``dq, dk, dv``
    its gradients against the cotangent ``do`` (torch's autograd calling ``cls.backward``), and
    ``saved`` the shape of each tensor its node saved, kept on it, or left where the file's ``module``
    holds state (its globals, its classes and their instances) when the forward has run. Raises
    TypeError, with the why, when ``cls`` is not a Function or the output was not made by it."""
    q, k, v, do, causal = args
    if not isinstance(cls, type) or not issubclass(cls, _CAPTURED["function"]):
        raise TypeError(f"{name} must be a class deriving from torch.autograd.Function "
                        f"(got {type(cls).__name__})")
    leaves = tuple(_CAPTURED["requires_grad_"](_CAPTURED["detach"](t), True) for t in (q, k, v))
    out = cls.apply(*leaves, causal)
    if type(out) is not _CAPTURED["tensor"]:
        raise TypeError(f"{name}.apply must return the output tensor, got {type(out).__name__}")
    node = _CAPTURED["grad_fn"](out)
    if node is None or getattr(type(node), "_forward_cls", None) is not cls:
        raise TypeError(f"{name}.apply's output was not made by {name}.forward (its grad_fn is "
                        f"{type(node).__name__}): return the forward's output itself")
    saved = [list(_CAPTURED["shape"](t)) for t in node.saved_tensors if type(t) is _CAPTURED["tensor"]]
    # and what the forward kept on ctx itself (ctx.values = (w, k, v): a sixth attacker's [L, S] weights,
    # never in save_for_backward): the node is the ctx, its instance attributes are the file's
    name_of = _CAPTURED["getattr"](module, "__name__", "") if module is not None else ""
    kept = list(_CAPTURED["vars"](node).values())
    kept += list(_CAPTURED["vars"](module).values()) if module is not None else []  # a global list or a class attribute
    saved += [list(_CAPTURED["shape"](t)) for t in _tensors_in(kept, name_of)]
    dq, dk, dv = _CAPTURED["grad"](out, leaves, grad_outputs=do)
    return _CAPTURED["detach"](out), dq, dk, dv, saved


def planted(module: Any, fn: Any, plant: tuple, args: tuple, kwargs: dict, recorder: Any = None) -> Any:
    """``fn(*args, **kwargs)`` while ``module``'s function ``plant[0]`` returns its own answer plus the
    tensor ``plant[1]`` (a difference the learner cannot know in advance; added to the first element
    of a tuple answer, as lab 01's ``(output, weights)``); the module's own function is put back
    afterwards. The dict written is the module's own (``vars``), not a learner ``__setattr__``.
    ``plant[2]``, when there: a second difference, added to what an exempt call of torch's SDPA returns
    while ``fn`` runs (the recorder adds it, :class:`recorder.FunctionRecorder`), so that the number must
    be a difference from SDPA's answer, not from the file's own second attention (an eighth attacker)."""
    name, delta = plant[:2]
    namespace = _CAPTURED["vars"](module)
    original, add = namespace.get(name), _CAPTURED["add"]
    if not callable(original):
        raise TypeError(f"{name} is not a function in your file")

    def with_difference(*a, **k):
        answer = original(*a, **k)
        if type(answer) is tuple and answer:
            return (add(answer[0], delta), *answer[1:])
        return add(answer, delta)

    namespace[name] = with_difference
    functions = recorder.functions if recorder is not None and len(plant) > 2 else None
    if functions is not None:
        functions.offset = plant[2]
    try:
        return fn(*args, **kwargs)
    finally:
        namespace[name] = original
        if functions is not None:
            functions.offset = None


def no_grad() -> Any:
    """torch's ``no_grad``, captured before the learner's file ran: a call the grader runs under it builds
    no autograd graph, so a backward cannot be had from the ``grad_fn`` nodes of a forward rebuilt for it
    (an eighth attacker called each node by hand: lab 04's ex4 for no backward written)."""
    return _CAPTURED["no_grad"]()
