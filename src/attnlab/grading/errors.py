"""What a learner's exception says about the mistake behind it, for every lab.

A check that raised reports ``raised <Error>: <message>`` and the traceback the sandbox sent
back (frames of the learner's file only). :func:`explain` reads the deepest frame in the
learner's file, finds that function in the file's syntax tree (parsed here, in the grader:
nothing of the learner's runs) and names the mistake when the error and the code agree:

* a broadcast error (``The size of tensor a (7) must match the size of tensor b (5)``) in a
  function that reduces along a dim without ``keepdim=True``: ``keepdim``;
* a matmul shape error on a line that transposes with ``.T`` or ``transpose(0, 1)``:
  ``wrong_transpose``;
* autograd's "returned an invalid gradient at index i": backward's gradients are not in the
  order of forward's inputs: ``order``;
* a shape error on a backward line that builds a gradient from another input than its operand
  (``dq += ds @ v_j``), or from the right ones with a transpose missing (``dv += p @ do_i``):
  ``backward_operand``; one that slices a per-query tensor (lse, D) by the key loop's bounds:
  ``wrong_axis``; one that reads a mask built with the key bounds first (``mask(ks, ke, qs, qe)``):
  ``backward_mask``;
* any error under a ``backward`` that unpacks ``ctx.saved_tensors`` in another order than
  ``save_for_backward`` saved them: ``order``.

Anything else is left to the exercise's own checks.
"""

from __future__ import annotations

import ast
import re
from typing import Optional

__all__ = ["frames", "explain", "REDUCTIONS"]

# reductions that drop the dim they reduce unless keepdim=True
REDUCTIONS = frozenset({"sum", "amax", "amin", "max", "min", "mean", "logsumexp", "prod", "norm", "nansum", "std",
                        "var"})
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')
_BROADCAST = ("must match the size of tensor", "The size of tensor a")
_MATMUL = ("cannot be multiplied", "Expected size for first two dimensions", "size mismatch", "shape mismatch",
           "mat1 and mat2", "einsum(): ")


def frames(text: str, file_names: "str | tuple[str, ...]") -> list[tuple[int, str]]:
    """``(line, function)`` of each traceback frame in the learner's file (any of ``file_names``),
    outermost first."""
    names = (file_names,) if isinstance(file_names, str) else file_names
    return [(int(line), func) for name, line, func in _FRAME.findall(text) if name.rsplit("/", 1)[-1] in names]


def _function(tree: ast.Module, name: str) -> Optional[ast.FunctionDef]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
        if isinstance(node, ast.ClassDef):  # a method (lab 04's autograd Function)
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    return None


def _reductions_without_keepdim(func: ast.FunctionDef) -> list[ast.Call]:
    """Calls such as ``x.sum(dim=-1)`` or ``torch.amax(x, -1)`` that reduce along a dim and
    do not keep it."""
    found = []
    for node in ast.walk(func):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in REDUCTIONS):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        keep = keywords.get("keepdim")
        if keep is not None and not (isinstance(keep, ast.Constant) and keep.value is False):
            continue  # keepdim=True (or a variable: not ours to guess)
        on_module = isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
        has_dim = "dim" in keywords or len(node.args) >= (2 if on_module else 1)
        if has_dim:
            found.append(node)
    return found


def _restored(func: ast.FunctionDef, calls: list[ast.Call]) -> list[ast.Call]:
    """Those of ``calls`` whose result is assigned to names that every later read gives the dim back
    (``D[:, :, qs:qe, None]``, ``m.unsqueeze(-1)``): such a reduction lost nothing (issue 62's held-out
    corpus: a right ``D = (do * o).sum(dim=-1)`` read as ``D[..., None]`` was blamed for another line)."""
    parents = {id(child): node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}

    def gives_back(load: ast.Name) -> bool:
        node, up = load, parents.get(id(load))
        while isinstance(up, ast.Subscript) and up.value is node:  # D[:, :, qs:qe][..., None]: climb the slices
            parts = up.slice.elts if isinstance(up.slice, ast.Tuple) else [up.slice]
            if any(isinstance(e, ast.Constant) and e.value is None for e in parts):
                return True
            node, up = up, parents.get(id(up))
        return isinstance(up, ast.Attribute) and up.value is node and up.attr in ("unsqueeze", "unsqueeze_")

    out = []
    for call in calls:
        assign = parents.get(id(call))
        if not (isinstance(assign, ast.Assign) and assign.value is call
                and all(isinstance(t, ast.Name) for t in assign.targets)):
            continue
        names = {t.id for t in assign.targets}
        loads = [n for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                 and n.id in names and n.lineno > call.lineno]
        if loads and all(gives_back(n) for n in loads):
            out.append(call)
    return out


# a backward's products and their operands (lab 04's names: q_i, k_j, v_j, do_i): a gradient line that reads
# another input where these belong is the mistake, whatever shape error it raised
_OPERANDS = {"dq": {"k"}, "dk": {"q"}, "dv": {"do"}, "dp": {"v"}}  # the input each product needs
_ALSO = {"dp": {"do"}}  # and the inputs it may read besides
_STEM = re.compile(r"^(do|q|k|v)(?:_?[ijtb]|_?tile|_?blk|_?block)?_?$")  # q_i, k_j, kb, v_tile, do_blk...


_RIGHT = {"dq": "dQ = scale * dS K", "dk": "dK = scale * dS^T Q", "dv": "dV = P^T dO", "dp": "dP = dO V^T"}


def _gradients_assigned(func: ast.FunctionDef, line: int):
    """(the gradient's name, the assignment) of each assignment on ``line`` to a gradient (``dq``, ``dk``,
    ``dv``, ``dp``, or a slice of one)."""
    for node in ast.walk(func):
        if getattr(node, "lineno", None) != line or not isinstance(node, (ast.Assign, ast.AugAssign)):
            continue
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        while isinstance(target, ast.Subscript):
            target = target.value
        grad = target.id.lower().rstrip("_ij") if isinstance(target, ast.Name) else ""
        grad = "d" + grad[5:] if grad.startswith("grad_") else grad  # grad_q: dq
        grad = next((g for g in _OPERANDS if grad == g or grad.startswith(g + "_")), None)
        if grad is not None:
            yield grad, node


def _wrong_operand(func: ast.FunctionDef, line: int, name: str) -> list[dict]:
    """``backward_operand`` when the failing ``line`` assigns a gradient from an input that is not its
    operand: ``dq += ds @ v_j`` (dQ = scale * dS K)."""
    for grad, node in _gradients_assigned(func, line):
        stems = {m.group(1) for n in ast.walk(node.value) if isinstance(n, ast.Name)
                 for m in [_STEM.match(n.id.lower())] if m}
        wrong = stems - _OPERANDS[grad] - _ALSO.get(grad, set())
        if wrong and not stems & _OPERANDS[grad]:
            return [{"code": "backward_operand",
                     "message": f"line {line} in {name}(): {grad} is built from {sorted(wrong)[0]}: {_RIGHT[grad]}"}]
    return []


_TRANSPOSED = {"dq": (False, False), "dk": (True, False), "dv": (True, False), "dp": (False, True)}  # dS K, dS^T Q...


def _transposed(expr: ast.AST) -> bool:
    """Whether an operand of ``@`` is a transpose: ``x.transpose(-2, -1)``, ``x.mT``, ``x.T``, ``x.t()``."""
    while isinstance(expr, ast.Call) and getattr(expr.func, "attr", "") in ("float", "double", "to", "contiguous"):
        expr = expr.func.value
    return (isinstance(expr, ast.Attribute) and expr.attr in ("mT", "T")) or (
        isinstance(expr, ast.Call) and getattr(expr.func, "attr", "") in ("transpose", "t", "swapaxes"))


def _product_misaligned(func: ast.FunctionDef, line: int, name: str) -> list[dict]:
    """``backward_operand`` when the failing ``line`` builds a gradient from a product (``@``, matmul,
    einsum) of the right operands that does not line up: a transpose missing or extra (``dv += p @ do_i``,
    an einsum reading dS as ``bhkq``)."""
    for grad, node in _gradients_assigned(func, line):
        products = [n for n in ast.walk(node.value) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult)
                    or isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", ""))
                    in ("einsum", "matmul", "bmm", "mm")]
        at = [(_transposed(n.left), _transposed(n.right)) for n in products if isinstance(n, ast.BinOp)]
        if at and all(pattern == _TRANSPOSED[grad] for pattern in at):  # as the formula has it: the shapes that
            continue  # reach this line are wrong elsewhere
        if products:
            return [{"code": "backward_operand",
                     "message": f"line {line} in {name}(): {grad}'s product does not line up: {_RIGHT[grad]}, so a "
                                "transpose is missing or extra (P^T is p.transpose(-2, -1); in an einsum the "
                                "subscripts name each operand's axes in its own order)"}]
    return []


def _mask_transposed(func: ast.FunctionDef, line: int, name: str) -> list[dict]:
    """``backward_mask`` when the failing ``line`` reads a mask built by a call that takes the key
    tile's bounds before the query tile's (``causal_block_mask(ks, ke, qs, qe)``): a (keys, queries)
    mask against (queries, keys) scores."""
    reads = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
             and getattr(n, "lineno", None) == line}
    for node in ast.walk(func):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in reads and isinstance(node.value, ast.Call)):
            continue
        firsts = [a.id[0].lower() for a in node.value.args if isinstance(a, ast.Name)]
        if "k" in firsts and "q" in firsts and firsts.index("k") < firsts.index("q"):
            return [{"code": "backward_mask",
                     "message": f"line {node.lineno} in {name}(): {node.targets[0].id} is built with the key tile's "
                                "bounds first, a (keys, queries) mask, where the scores are (queries, keys): pass the "
                                "query bounds first, as the forward does"}]
    return []


def _saved_out_of_order(tree: ast.Module, functions: list[str]) -> list[dict]:
    """``order`` when one of ``functions`` (the traceback's) unpacks ``ctx.saved_tensors`` into the names
    ``save_for_backward`` was given, in another order."""
    saved: dict[tuple, tuple] = {}  # the names saved, sorted -> (line, their order): linear in the file
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "save_for_backward" \
                and all(isinstance(a, ast.Name) for a in n.args):
            saved.setdefault(tuple(sorted(a.id for a in n.args)), (n.lineno, [a.id for a in n.args]))
    for fname in dict.fromkeys(functions):  # a traceback repeats frames: each function once
        func = _function(tree, fname)
        for node in ast.walk(func) if func is not None else ():
            if not (isinstance(node, ast.Assign) and getattr(node.value, "attr", "") == "saved_tensors"
                    and isinstance(node.targets[0], ast.Tuple)
                    and all(isinstance(e, ast.Name) for e in node.targets[0].elts)):
                continue
            names = [e.id for e in node.targets[0].elts]
            at, order = saved.get(tuple(sorted(names)), (0, names))
            if order != names:
                return [{"code": "order",
                         "message": f"line {node.lineno} unpacks ctx.saved_tensors as ({', '.join(names)}), but "
                                    f"line {at} saved ({', '.join(order)}): unpack them in the order saved"}]
    return []


# one value per query row: lse, lse2 (base 2), lse_w, lse_i, delta, D, d_i, m_i, l_i (not do, dq, dk: d takes a suffix
# only after an underscore, or b/i/t)
_PER_QUERY = re.compile(r"^(?:(?:lse|delta)2?(?:_?[a-z]{1,5}\d?)?|d2?(?:_[a-z]{1,5}\d?|[bit])?|[ml](?:_?[it])?)$",
                        re.IGNORECASE)


def _row_vector_unexpanded(func: ast.FunctionDef, line: int, name: str) -> list[dict]:
    """``keepdim`` when the failing ``line`` subtracts a per-query vector (lse, D: ``[B, H, bq]``) from a tile
    (``[B, H, bq, bk]``) without its trailing dim: ``s - lse_t`` where ``lse_t = lse[:, :, qs:qe]`` (a slice
    with no None) or ``lse`` itself, a parameter."""
    params = {a.arg for a in func.args.args + func.args.kwonlyargs}
    sliced = set()  # names bound to a per-query tensor's slice that adds no dim
    for node in ast.walk(func):
        value = node.value if isinstance(node, ast.Assign) else None
        while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
                and value.func.attr in ("float", "double", "to", "contiguous", "clone", "detach"):
            value = value.func.value  # lse[:, :, qs:qe].float(): the conversion keeps the shape
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) \
                and _PER_QUERY.match(value.value.id):
            parts = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
            if not any(isinstance(e, ast.Constant) and e.value is None for e in parts):
                sliced.add(node.targets[0].id)
    for node in ast.walk(func):
        right = node.right if isinstance(node, ast.BinOp) else None
        if isinstance(right, ast.Subscript) and isinstance(right.value, ast.Name) and _PER_QUERY.match(right.value.id):
            parts = right.slice.elts if isinstance(right.slice, ast.Tuple) else [right.slice]
            if not any(isinstance(e, ast.Constant) and e.value is None for e in parts):  # lse[:, :, q0:q1]
                right = ast.Name(id=right.value.id)
                sliced = sliced | {right.id}
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and getattr(node, "lineno", None) == line
                and isinstance(right, ast.Name) and _PER_QUERY.match(right.id)
                and right.id in sliced | params):
            continue
        vec = right.id
        return [{"code": "keepdim",
                 "message": f"line {line} in {name}(): {vec} holds one value per query row ([B, H, rows]) and is "
                            f"subtracted from a tile ([B, H, rows, keys]) without its trailing dim: {vec}[..., None]"}]
    return []


_PER_KEY = re.compile(r"^(dk|dv)$", re.IGNORECASE)  # one row per key


def _query_sliced(func: ast.FunctionDef, line: int, name: str) -> list[dict]:
    """``wrong_axis`` when the failing ``line`` writes a per-key gradient by the query tile's bounds:
    ``dk[:, :, qs:qe] += ...``."""
    for node in ast.walk(func):
        if not (isinstance(node, (ast.Assign, ast.AugAssign)) and getattr(node, "lineno", None) == line):
            continue
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                and _PER_KEY.match(target.value.id)):
            continue
        parts = target.slice.elts if isinstance(target.slice, ast.Tuple) else [target.slice]
        if any(isinstance(e, ast.Slice) and isinstance(e.lower, ast.Name) and e.lower.id.lower().startswith("q")
               for e in parts):
            return [{"code": "wrong_axis",
                     "message": f"line {line} in {name}(): {target.value.id} has one row per key, but it is "
                                "written at the query tile's rows: index it by the key tile (ks:ke)"}]
    return []


def _key_sliced(func: ast.FunctionDef, line: int, name: str) -> list[dict]:
    """``wrong_axis`` when the failing ``line`` slices a per-query tensor (lse, D) by the key loop's bounds:
    ``lse[:, :, ks:ke, None]`` in a loop ``for ks in range(0, S, block_k)``."""
    key_vars = {n.target.id for n in ast.walk(func) if isinstance(n, ast.For) and isinstance(n.target, ast.Name)
                and (n.target.id.lower().startswith("k")
                     or any(isinstance(a, ast.Name) and a.id == "S" for a in ast.walk(n.iter)))}
    for node in ast.walk(func):
        if not (isinstance(node, ast.Subscript) and getattr(node, "lineno", None) == line
                and isinstance(node.value, ast.Name) and _PER_QUERY.match(node.value.id)):
            continue
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if any(isinstance(e, ast.Slice) and isinstance(e.lower, ast.Name)
               and (e.lower.id in key_vars or e.lower.id.lower().startswith("k")) for e in parts):
            return [{"code": "wrong_axis",
                     "message": f"line {line} in {name}(): {node.value.id} has one value per query row, but it is "
                                "sliced by the key tile's bounds: index it by the query tile (qs:qe)"}]
    return []


def _wrong_reduction_axis(calls: list[ast.Call], name: str) -> list[dict]:
    """``wrong_axis`` for a per-row reduction (its dim given back later) taken over another dim than the
    last: ``(do * o).sum(dim=-2)`` sums over the rows, where D is one number per row."""
    for c in calls:
        keywords = {k.arg: k.value for k in c.keywords}
        dim = keywords.get("dim", c.args[-1] if c.args and not (isinstance(c.func.value, ast.Name)
                                                                 and c.func.value.id == "torch") else None)
        value = dim.operand.value * -1 if isinstance(dim, ast.UnaryOp) and isinstance(dim.operand, ast.Constant) \
            else getattr(dim, "value", None)
        if isinstance(value, int) and value not in (-1, 3):
            return [{"code": "wrong_axis",
                     "message": f"line {c.lineno} in {name}(): .{c.func.attr}(dim={value}) reduces over another dim "
                                "than the last: a per-row quantity (D = rowsum(dO * O), a row max) reduces the "
                                "feature or key dim, dim=-1"}]
    return []


def _stored(target: ast.AST) -> set[str]:
    """The names an assignment target binds or updates: ``a, b`` both, ``dk[:, :, qs:qe]`` dk alone (not
    the names its index reads). Iterative: a target nested thousands deep is a learner's file, and
    recursion here crashed the grader (issue 62's attacker)."""
    out, todo = set(), [target]
    while todo:
        t = todo.pop()
        if isinstance(t, ast.Name):
            out.add(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            todo.extend(t.elts)
        elif isinstance(t, (ast.Starred, ast.Subscript, ast.Attribute)):
            todo.append(t.value)
    return out


def _feeding(func: ast.FunctionDef, line: int, calls: list[ast.Call]) -> list[ast.Call]:
    """Those of ``calls`` that feed the failing ``line``: on it, or assigned to a name that line reads
    (directly or through other assignments in the function): a reduction elsewhere that lost its dim
    is not why this line fails (issue 62: ``D = rowsum(dO * O)``, right as it is, was blamed)."""
    reads = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
             and getattr(n, "lineno", None) == line}
    sources: dict[str, set[str]] = {}  # name -> the names its assignments read
    produced: dict[int, set[str]] = {}  # id(call) -> the names it is assigned to
    for node in ast.walk(func):
        pair = None  # (targets, the value they are bound from): assignments, loop and comprehension targets
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            pair = (node.targets if isinstance(node, ast.Assign) else [node.target], node.value)
        elif isinstance(node, (ast.For, ast.comprehension)):
            pair = ([node.target], node.iter)
        elif isinstance(node, ast.NamedExpr):
            pair = ([node.target], node.value)
        if pair is not None:
            targets, value = pair
            names = {n for tg in targets for n in _stored(tg)}
            used = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
            for name in names:
                sources.setdefault(name, set()).update(used)
            for c in ast.walk(value):
                if isinstance(c, ast.Call):
                    produced.setdefault(id(c), set()).update(names)
    reached, todo = set(), list(reads)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(sources.get(name, ()))
    return [c for c in calls if c.lineno == line or produced.get(id(c), set()) & reached]


_GRADIENT_SHAPE = re.compile(r"returned an invalid gradient at index (\d+) - got (\[[\d, ]*\]) but expected shape "
                             r"compatible with (\[[\d, ]*\])")


_GRADIENT_COUNT = re.compile(r"returned an incorrect number of gradients \(expected (\d+), got (\d+)\)")


def explain(text: str, tree: Optional[ast.Module], file_name: "str | tuple[str, ...]") -> list[dict]:
    """The named mistake behind an exception, as findings (``{"code", "message"}``), or none.

    ``text``: a failed check's message (the error and its traceback); ``tree``: the learner's
    file, parsed; ``file_name``: its name as the traceback shows it.
    """
    if tree is None or "raised " not in text:
        return []
    count = _GRADIENT_COUNT.search(text)
    if count:  # autograd's own check: one gradient per input of forward
        want, got = count.groups()
        return [{"code": "order",
                 "message": f"backward returned {got} gradients, forward takes {want} inputs: return one per input, "
                            "in forward's order, None for those without one (dq, dk, dv, None for is_causal)"}]
    wrong_grad = _GRADIENT_SHAPE.search(text)
    if wrong_grad:  # autograd's own check: backward's i-th gradient has another input's shape
        i, got, want = wrong_grad.groups()
        return [{"code": "order",
                 "message": f"backward's gradient number {i} has shape {got}, but input {i} of forward has {want}: "
                            "backward returns one gradient per input of forward, in the same order "
                            "(dq, dk, dv, then None for is_causal)"}]
    where = frames(text, file_name)
    if not where:
        return []
    saved = _saved_out_of_order(tree, [f for _, f in where])
    if saved:
        return saved
    line, name = where[-1]
    func = _function(tree, name)
    if func is None:
        return []
    if any(s in text for s in (*_BROADCAST, *_MATMUL)):
        for node in ast.walk(func):
            if getattr(node, "lineno", None) != line:
                continue
            transposes = (isinstance(node, ast.Attribute) and node.attr in ("T", "t")) or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "transpose"
                and [getattr(a, "value", None) for a in node.args] in ([0, 1], [1, 0]))
            if transposes:
                return [{"code": "wrong_transpose",
                         "message": f"line {line} in {name}(): .T (or transpose(0, 1)) on a 3-D or 4-D tensor swaps "
                                    "the wrong dims; transpose the last two with .transpose(-2, -1)"}]
    if any(s in text for s in (*_BROADCAST, *_MATMUL)):
        operand = (_wrong_operand(func, line, name) or _key_sliced(func, line, name) or _query_sliced(func, line, name)
                   or _mask_transposed(func, line, name))
        if operand:
            return operand
    if any(s in text for s in _BROADCAST):
        reductions = _reductions_without_keepdim(func)
        restored = _restored(func, reductions)
        axis = _wrong_reduction_axis(_feeding(func, line, restored), name)
        if axis:
            return axis
        calls = _feeding(func, line, [c for c in reductions if all(c is not r for r in restored)])
        if not calls:
            return _row_vector_unexpanded(func, line, name) or _product_misaligned(func, line, name)
        if calls:
            shown = ", ".join(f"line {c.lineno}: .{c.func.attr}(...)" for c in calls[:2])
            return [{"code": "keepdim",
                     "message": f"{name}() reduces along a dim without keepdim=True ({shown}), so the result "
                                "loses that dim and no longer lines up with the tensor it divides or shifts"}]
    if any(s in text for s in _MATMUL):
        return _product_misaligned(func, line, name)
    return []
