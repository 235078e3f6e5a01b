"""What a ``@triton.jit`` kernel of a submission may do (lab 05): load, compute and store, and nothing
that carries a value out to Python. Checked on the source, in the grader's process (with
:mod:`.static`, whose :func:`~.static.check_source` calls it for a lab with kernels).

Under ``TRITON_INTERPRET=1`` a kernel is Python: its tensors are numpy arrays that answer
``str()``, ``bool()`` and ``int()``, and its body can call any function and change any object it
reaches. A third attacker of issue 61 scored 100/100 with kernels that appended each loaded value,
as text, to a list its launcher passed, and launchers that computed attention in Python on those
values before other kernels stored them: every element was a learner's store, and no torch
arithmetic ran. Triton's compiler refuses all of that on a GPU (a kernel sees tensors, numbers and
other kernels); here it is refused by name, before anything runs. Inside a kernel (and each jit
helper it calls):

* a call is to ``tl``'s functions (the lab's allow-list of names, held by :mod:`.static`), the
  file's other kernels, :data:`KERNEL_BUILTINS`, or a method of :data:`KERNEL_METHODS`;
* a name from module level is an import, another kernel or a number (``BLOCK_Q = 16``);
* nothing is stored into an attribute or an item, nothing deleted; no ``assert``, ``try``, ``with``,
  ``lambda``, comprehension, nested ``def`` or ``class``; ``raise`` only of ``NotImplementedError``
  (the stub's own line); a parameter's default is a number.

And around the kernels (:func:`_outside_kernels`; the fourth and fifth attackers' roads): no call of
``tl``'s functions (a launch patches them in, so a grid function ran them in Python), a kernel used
only by its launch ``kernel[grid](...)`` (called as a function it runs in Python and returns its
values), no ``try`` (a kernel's error text holds its values), and no name the file does not bind
(the interpreter puts its own helpers, ``_implicit_cvt`` among them, into the module).

The launch's side (a list, an object or a class passed *as* a kernel's argument, a grid that is not
numbers) is evidence in the child: :func:`.sandbox.interpreter.count_launches` reports every
parameter a kernel receives, defaults included, that is not a tensor, a number or a dtype.
"""

from __future__ import annotations

import ast
from typing import Iterable, Optional

__all__ = ["KERNEL_BUILTINS", "KERNEL_METHODS", "kernel_violations"]

KERNEL_BUILTINS = frozenset({"range", "min", "max", "abs", "float", "int", "len"})
KERNEL_METHODS = frozenset({"to", "reshape", "trans", "broadcast_to", "expand_dims", "view", "permute"})
_REFUSED = {"Assert": "assert", "Try": "try", "With": "with", "Lambda": "lambda", "ListComp": "a comprehension",
            "SetComp": "a comprehension", "DictComp": "a comprehension", "GeneratorExp": "a comprehension",
            "FunctionDef": "a nested def", "ClassDef": "a class", "Delete": "del", "Dict": "a dict", "Set": "a set"}


def _module_names(tree: ast.Module, jit: set[str]) -> tuple[set[str], set[str]]:
    """(names a kernel may read from module level: imports, kernels, numeric constants; every name
    bound at module level)."""
    readable, bound = set(jit), set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = {(a.asname or a.name).split(".")[0] for a in node.names}
            readable |= names
            bound |= names
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            bound |= names
            value = node.value
            if value is not None and all(isinstance(n, (ast.Constant, ast.UnaryOp, ast.BinOp, ast.operator,
                                                        ast.unaryop)) for n in ast.walk(value)) \
                    and all(isinstance(n.value, (int, float, bool)) for n in ast.walk(value)
                            if isinstance(n, ast.Constant)):
                readable |= names
    return readable, bound


def _locals(fn: ast.FunctionDef) -> set[str]:
    """Parameters and every name the kernel binds (Python makes those local everywhere in it)."""
    a = fn.args
    names = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, *(y for y in (a.vararg, a.kwarg) if y)]}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _kernel(fn: ast.FunctionDef, jit: set[str], readable: set[str], bound: set[str],
            mods: set[str]) -> list[tuple[int, str]]:
    """(line, why) for each thing in one kernel's body that may carry a value out of it."""
    out: list[tuple[int, str]] = []
    local = _locals(fn)
    where = f"in kernel {fn.name}"
    for default in [*fn.args.defaults, *(d for d in fn.args.kw_defaults if d is not None)]:
        if not (isinstance(default, ast.Constant) and isinstance(default.value, (int, float, bool, type(None)))):
            out.append((default.lineno, f"the default {ast.unparse(default)[:40]} {where}: a kernel's defaults are "
                                        "numbers (a list there is a road out; a fifth attacker's)"))
    called = {id(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}  # said once, as a call
    for stmt in fn.body:
        for node in ast.walk(stmt):
            line = getattr(node, "lineno", fn.lineno)
            kind = type(node).__name__
            if kind in _REFUSED:
                out.append((line, f"{_REFUSED[kind]} {where}: a kernel loads, computes and stores"))
            elif kind == "Raise" and not (isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name)
                                          and node.exc.func.id == "NotImplementedError"
                                          and all(isinstance(x, ast.Constant) for x in node.exc.args)):
                out.append((line, f"raise {where}: only the stub's raise NotImplementedError(...) may stay"))
            elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                out.append((line, f"a store into {ast.unparse(node)[:40]} {where}: a kernel writes memory only "
                                  "with tl.store"))
            elif kind == "Call":
                out += _call(node, line, where, jit, local, mods)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local \
                    and node.id in bound and node.id not in readable and id(node) not in called:
                out.append((line, f"{where} reads the module-level {node.id}: a kernel reads its arguments, "
                                  "numeric constants and other kernels"))
    return out


def _call(node: ast.Call, line: int, where: str, jit: set[str], local: set[str],
          mods: set[str]) -> list[tuple[int, str]]:
    fn = node.func
    if isinstance(fn, ast.Name):
        if fn.id in jit or (fn.id in KERNEL_BUILTINS | {"NotImplementedError"} and fn.id not in local):
            return []
        return [(line, f"a call of {fn.id}() {where}: a kernel calls tl's functions, other @triton.jit kernels "
                       f"and {', '.join(sorted(KERNEL_BUILTINS))}")]
    if isinstance(fn, ast.Attribute):
        root = fn.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id not in local and root.id in mods:
            return []  # a module's function: static.py holds it to the lab's allow-list of names
        if fn.attr in KERNEL_METHODS:
            return []
        return [(line, f"a call of .{fn.attr}() {where}: a kernel's tensors have only "
                       f"{', '.join('.' + m + '()' for m in sorted(KERNEL_METHODS))}")]
    return [(line, f"a call of a computed function {where}")]


def kernel_violations(tree: ast.Module, jit: Iterable[str], modules,
                      file_names: Iterable[str]) -> list[tuple[int, Optional[str], str]]:
    """(line, unit, why) for each construct of the file's kernels (the top-level functions named in
    ``jit``), or of the code around them, that may carry a value out to Python; ``modules``: the
    names the file binds to the lab's modules, ``{"tl": "triton.language", "triton": "triton"}``;
    ``file_names``: every name the file binds anywhere (:mod:`.static` works it out)."""
    kernels = set(jit)
    callable_ = kernels | {(a.asname or a.name) for n in tree.body if isinstance(n, ast.ImportFrom)
                           and (n.module or "").split(".")[0] == "triton" for a in n.names}
    readable, bound = _module_names(tree, callable_)
    out = [(line, node.name, why) for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in kernels
           for line, why in _kernel(node, callable_, readable, bound, set(modules))]
    language = {name for name, module in dict(modules).items() if module == "triton.language"} \
        if isinstance(modules, dict) else {"tl"}
    return out + _outside_kernels(tree, kernels, language, frozenset(file_names))


def _outside_kernels(tree: ast.Module, kernels: set[str], language: set[str],
                     bound: Iterable[str]) -> list[tuple[int, str, str]]:
    """The launchers' side: Triton's interpreter runs ``tl``'s functions wherever they are called once
    a launch has patched them (a fourth attacker's grid function, ``kernel[grid_fn]``, loaded and
    stored every value in Python), a kernel called without a launch returns its values to Python,
    and a kernel's error carries values in its text (``tl.max(v, v)``: "axis [<the block>]"), which
    only a ``try`` could read. So outside the kernels: no call of ``tl``'s functions, no kernel called
    but by ``kernel[grid](...)``, and no ``try``."""
    out: list[tuple[int, str, str]] = []
    imported = {(a.asname or a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("triton.language") for a in n.names}
    for top in tree.body:  # Triton's interpreter puts its own globals (_implicit_cvt, np...) in the module
        unit = getattr(top, "name", None)
        for node in ast.walk(top):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound \
                    and node.id not in _BUILTINS:
                out.append((node.lineno, unit, f"{node.id} is bound nowhere in the file: a name a submission "
                                               "reads is its own, an import's or a builtin"))
    for top in tree.body:
        if isinstance(top, ast.FunctionDef) and top.name in kernels:
            continue
        unit = getattr(top, "name", None)
        launched = {id(n.value) for n in ast.walk(top) if isinstance(n, ast.Subscript)}  # kernel[grid]
        for node in ast.walk(top):
            if isinstance(node, ast.Name) and node.id in kernels and isinstance(node.ctx, ast.Load) \
                    and id(node) not in launched:
                out.append((node.lineno, unit, f"{node.id} is used outside a kernel other than by its launch, "
                                               f"{node.id}[grid](...): called as a function it runs in Python"))
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
                out.append((node.lineno, unit, f"{node.func.id}() outside a kernel: tl's functions run only inside "
                                               "@triton.jit kernels"))
                continue
            line = getattr(node, "lineno", 0)
            if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                out.append((line, unit, "try in a file with kernels: a kernel's error is the grader's to report "
                                        "(its text can hold the kernel's values)"))
            elif isinstance(node, ast.Call):
                root = node.func
                while isinstance(root, ast.Attribute):
                    root = root.value
                text = ast.unparse(node.func)
                if isinstance(node.func, ast.Attribute) and isinstance(root, ast.Name) and (
                        root.id in language or text.startswith("triton.language.")):
                    out.append((line, unit, f"{text}() outside a kernel: tl's functions run only inside "
                                            "@triton.jit kernels"))
    return out


_BUILTINS = frozenset(dir(__import__("builtins")))

