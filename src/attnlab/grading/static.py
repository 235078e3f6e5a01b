"""The from-scratch rule, checked on the submission's source before any of it runs.

The runtime recorders (:mod:`.policy`) watch the calls *inside* the learner's process,
which the learner controls: a determined file can switch them off or forge their
report. This check runs in the grader's own process, on the text (``ast``), so
nothing the learner's code does at run time can change its verdict. It refuses,
with the line:

* imports outside the allow-list (:data:`ALLOWED_IMPORTS`: what the lab's stub itself
  imports), attnlab above all (its reference would answer every exercise);
* ``__import__``, ``eval``, ``exec``, ``compile``, ``open`` and the other builtins that
  reach the interpreter or the file system (:data:`BANNED_BUILTINS`);
* ``getattr``/``setattr``/``hasattr``/``delattr`` with a name that is not a literal
  (or a literal that is itself refused);
* attributes that start with ``_`` (dunders and private APIs: ``x.__class__``,
  ``torch._C``, ``torch.ops.aten._softmax``) and attributes that lead out of torch into
  the interpreter (``torch.sys``, ``torch.os``, ``.modules``, frame attributes);
* torch's attention under any alias (:data:`BANNED_FRAGMENTS` in any attribute or
  imported name: ``softmax``, ``scaled_dot_product_attention``, ``MultiheadAttention``...),
  except where an exercise allows it (``compare_with_sdpa``);
* string constants naming attnlab or the solutions;
* a store or delete on an attribute of anything the file did not make (:meth:`_Visitor._store`):
  of an imported module or class and every name bound to one (``torch.Tensor.detach = f``,
  ``T = torch.Tensor; T.clone = f``, ``setattr(torch.Tensor, "clone", f)``), of a computed object
  (``type(x).clone = f``) or of a module-level name; stores on the file's own classes and on
  local objects (``ctx.causal = is_causal``, ``self.scale = s``) stay allowed. The child answers in
  bytes copied by functions it captured before the file ran, so a rebound method cannot change an
  answer (:func:`.sandbox.protocol.freeze`), and the recorder reports what was rebound; this
  rule keeps the file from trying.

**The rule covers everything that runs.** What runs at import (the module body, class
bodies, decorators, default values, annotations, bases) costs the whole file, and it may not
use the file's own code at all: a submission, when imported, only defines functions and
classes, and alias them (``attention = my_attention``). ``if __name__ == "__main__":``
blocks never run when graded, and ``__name__`` cannot be assigned. Decorators are an
allow-list (:data:`ALLOWED_DECORATORS`), and so are the dunder methods a class may define
(:data:`ALLOWED_DUNDER_METHODS`), since Python calls the others by itself.

**A violation anywhere refuses the whole file** (:meth:`StaticReport.refusals`), with its
line: honest files have none, and no graph of which function reaches which decides what a
violation costs (it missed a helper reached through a module-level alias or a class
attribute). The one exception is torch's attention written directly in the function of the
exercise that measures the learner against it (``compare_with_sdpa``).

The walk is iterative (a file nested thousands deep is refused or passed like any other,
never a ``RecursionError``).

This is not the fence: torch alone can read and write files, start processes and
open sockets. The OS sandbox (:mod:`.sandbox`) is the fence; this check keeps the
*score* honest.
"""

from __future__ import annotations

import ast
import builtins
import threading
from dataclasses import dataclass, field
from typing import Iterable, Optional

from attnlab.grading.kernel_rules import kernel_violations
from attnlab.grading.sandbox.recorder import BANNED_FRAGMENTS

__all__ = ["ALLOWED_IMPORTS", "BANNED_BUILTINS", "Violation", "StaticReport", "check_source", "parse", "shape_digest"]

# ast.parse from two threads at once fails on CPython 3.11 ("SystemError: AST constructor
# recursion depth mismatch", seen when two submissions were graded in parallel)
_PARSE_LOCK = threading.Lock()
ALLOWED_IMPORTS = ("torch", "math", "typing", "jaxtyping", "__future__")
BANNED_BUILTINS = frozenset({"__import__", "eval", "exec", "compile", "open", "globals", "locals", "vars",
                             "breakpoint", "input", "memoryview", "__builtins__", "__loader__", "__spec__"})
ATTRIBUTE_FUNCTIONS = frozenset({"getattr", "setattr", "hasattr", "delattr"})
# attributes that lead from torch's namespace into the interpreter or the OS
BANNED_ATTRIBUTES = frozenset({"sys", "os", "builtins", "subprocess", "importlib", "modules", "ctypes", "inspect",
                               "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "gi_frame", "cr_frame",
                               "ag_frame", "tb_frame", "tb_next", "co_code", "func_globals"})
# attributes that compute attention's pieces in disguise
DISGUISED = {"distributions": "torch.distributions computes a softmax for you (Categorical(logits=...).probs)"}
BANNED_STRINGS = ("attnlab", "solutions")

# ---------------------------------------------------------------- the allow-lists
# The rules above name what is refused; these name what is allowed, so a way to run code that
# nobody thought of (a string annotation evaluated by typing.get_type_hints, a pickle reached
# through torch.serialization, a match class pattern, getattr under another name,
# torch.ops.load_library) is refused because it is not on a list. Everything a lab's solution,
# its stubs and the test suite's buggy variants use is here (tests/grading/test_static_allowlist.py
# checks it), plus the tensor arithmetic an honest alternative commonly writes.
ALLOWED_NODES = frozenset({
    "Module", "Expr", "Import", "ImportFrom", "alias", "FunctionDef", "ClassDef", "arguments", "arg", "keyword",
    "Return", "Assign", "AugAssign", "AnnAssign", "For", "While", "If", "With", "withitem", "Raise", "Assert",
    "Pass", "Break", "Continue", "Try", "ExceptHandler", "Delete", "NamedExpr",
    "BoolOp", "BinOp", "UnaryOp", "Lambda", "IfExp", "Dict", "Set", "ListComp", "SetComp", "DictComp",
    "GeneratorExp", "comprehension", "Compare", "Call", "Constant", "JoinedStr", "FormattedValue", "Attribute",
    "Subscript", "Starred", "Name", "List", "Tuple", "Slice", "Load", "Store", "Del",
    "And", "Or", "Add", "Sub", "Mult", "MatMult", "Div", "Mod", "Pow", "LShift", "RShift", "BitOr", "BitXor",
    "BitAnd", "FloorDiv", "Invert", "Not", "UAdd", "USub", "Eq", "NotEq", "Lt", "LtE", "Gt", "GtE", "Is", "IsNot",
    "In", "NotIn",
})
ALLOWED_BUILTINS = frozenset({
    "abs", "all", "any", "bool", "dict", "divmod", "enumerate", "filter", "float", "int", "isinstance", "len",
    "list", "map", "max", "min", "print", "range", "reversed", "round", "set", "slice", "sorted", "str", "sum",
    "tuple", "zip", "super", "staticmethod", "classmethod", "property", "NotImplementedError", "ValueError",
    "TypeError", "RuntimeError", "IndexError", "KeyError", "AssertionError", "ZeroDivisionError", "Exception",
    "SystemExit",  # raising it ends the exercise's process, which the grader reports as such
    "__name__", "__doc__",
})
# attribute (and from-import) names: tensor arithmetic, the modules' few names the labs use
COMMON_ATTRIBUTES = frozenset({
    # what the labs' solutions and stubs use
    "abs", "amax", "arange", "bool", "cat", "detach", "dtype", "empty", "exp", "expand_as", "full", "isneginf",
    "item", "log", "masked_fill", "max", "maximum", "ones", "ones_like", "repeat_interleave", "requires_grad_",
    "reshape", "shape", "sqrt", "sum", "transpose", "tril", "view", "where", "zeros", "zeros_like",
    "Tensor", "Optional", "Bool", "Float", "Int",
    # tensor arithmetic an honest alternative writes
    "T", "mT", "matmul", "mm", "bmm", "einsum", "permute", "unsqueeze", "squeeze", "contiguous", "size", "dim",
    "numel", "expand", "repeat", "flatten", "unflatten", "swapaxes", "stack", "split", "chunk", "narrow",
    "select", "index_select", "gather", "flip", "clone", "float", "double", "half", "to", "new_zeros", "new_ones",
    "new_full", "full_like", "empty_like", "linspace", "tensor", "eye", "triu", "masked_fill_", "exp2", "log2",
    "log1p", "expm1", "rsqrt", "neg", "min", "amin", "minimum", "clamp", "clamp_min", "clamp_max", "mean",
    "prod", "pow", "square", "mul", "div", "add", "sub", "isnan", "isinf", "isposinf", "isfinite",
    "nan_to_num", "logical_not", "logical_and", "logical_or", "any", "all", "eq", "ne", "lt", "le", "gt", "ge",
    "allclose", "equal", "tolist", "device", "requires_grad", "grad", "backward", "float32", "float64",
    "bfloat16", "float16", "long", "int", "int64", "finfo", "tiny", "eps", "no_grad", "fill_", "zero_", "copy_", "add_", "mul_",
    "div_", "sub_", "values", "indices", "keys", "items", "pi", "inf", "nan", "ceil", "floor",
    # more of the same, each refused an honest solution of issue 48's independent authors (the
    # in-place ones then reach the child's mutates_input check, which names them)
    "movedim", "moveaxis", "tril_indices", "triu_indices", "outer", "diagonal", "logical_not_", "logical_and_",
    "logical_or_", "unsqueeze_", "squeeze_", "clamp_", "exp_", "neg_", "masked_scatter", "causal",
    "type_as",  # a conversion (issue 62's independent author: TritonAttention.backward's dq.type_as(q) scored 0)
    # Python's list and dict methods
    "append", "extend", "pop", "insert", "index", "count", "get", "update", "copy", "sort", "reverse", "remove",
    "clear",
    "Tuple", "List", "Union", "Callable", "Sequence", "Any",
    "special",  # torch.special's arithmetic (its softmax is refused by name like every other)
})
FORBIDDEN_PATHS = ("serialization", "pickle", "ops", "classes", "utils", "hub", "multiprocessing", "distributed",
                   "load", "save", "load_library", "tofile", "fromfile", "from_file", "numpy", "storage",
                   "untyped_storage", "get_type_hints", "jit", "compile", "library", "backends", "fx", "package")


@dataclass(frozen=True)
class Violation:
    line: int
    function: Optional[str]  # the top-level function or class it is in; None: module level
    kind: str  # "import" | "unsafe" | "attention"
    message: str

    def __str__(self) -> str:
        where = f"in {self.function}()" if self.function else "at module level"
        return f"line {self.line} ({where}): {self.message}"


@dataclass
class StaticReport:
    violations: list[Violation]
    calls: dict[str, set[str]]  # top-level function -> top-level functions it names
    syntax_error: str = ""
    imports: set[str] = field(default_factory=set)  # allowed top-level modules the file imports
    tree: Optional[ast.Module] = None  # the parsed file (None where it did not parse), read again by the grader

    def reachable(self, function: str) -> set[str]:
        """``function`` and every top-level function it reaches by name."""
        seen, todo = set(), [function]
        while todo:
            f = todo.pop()
            if f in seen:
                continue
            seen.add(f)
            todo.extend(self.calls.get(f, ()))
        return seen

    def module_level(self) -> list[Violation]:
        return [v for v in self.violations if v.function is None]

    def refusals(self, attention_allowed_in: "set[str] | frozenset[str]" = frozenset()) -> list[Violation]:
        """Every violation in the file, each of which refuses the whole file (complete mediation:
        no reach graph decides what a violation costs, so no alias, class attribute or other
        road to a helper escapes it). The one exception: torch's attention written directly in
        a function of ``attention_allowed_in`` (the exercises that compare against it:
        ``compare_with_sdpa``); the unsafe kinds are refused there too."""
        return [v for v in self.violations if not (v.kind == "attention" and v.function in attention_allowed_in)]


def _banned_fragment(name: str) -> Optional[str]:
    low = name.lower().replace("_", "")
    for frag in BANNED_FRAGMENTS:
        if frag.replace("_", "") in low:
            return frag
    if "softmin" in low:
        return "softmin"
    return None


@dataclass(frozen=True)
class _Ctx:
    """Where a node stands: whom a violation there costs, and whether it runs at import."""

    unit: Optional[str]  # the top-level function or class it costs; None: the whole file
    import_time: bool  # it runs when the file is imported (module body, class bodies, decorators, defaults)
    owner: Optional[str] = None  # a top-level class whose methods' bodies are charged to it
    in_class: bool = False  # a statement directly in a class body
    main_guard: bool = False  # inside `if __name__ == "__main__":` at module level (never runs when graded)


# The dunder methods a class in a submission may define: each other one is a hook that Python or
# torch calls on its own (__init_subclass__, __set_name__ and __class_getitem__ at import,
# __torch_function__ inside torch, __getattr__ when the grader looks a function up...).
ALLOWED_DUNDER_METHODS = frozenset({"__init__", "__call__", "__repr__", "__str__"})
# What may decorate a function or class: each runs at import, with the decorated object.
ALLOWED_DECORATORS = frozenset({"staticmethod", "classmethod", "property", "torch.no_grad", "torch.no_grad()",
                                "torch.inference_mode", "torch.inference_mode()", "torch.enable_grad()"})


# Names of a lab's own modules (Lab.modules: Triton's, lab 05) that reach outside the kernel: the
# compiler, its cache and launchers, extern libraries, the learner's own assembly. None is on any
# lab's list (they are refused as every unlisted name is); these say why.
REACH_OUTSIDE = {
    "inline_asm_elementwise": "runs assembly of the file's own",
    "extern_elementwise": "calls into an extern library",
    "extra": "holds the extern libraries (libdevice)",
    "libdevice": "is an extern library",
    "runtime": "holds the launchers, the driver and the compiler's cache",
    "compiler": "compiles and caches kernels outside the interpreter",
    "compile": "compiles and caches kernels outside the interpreter",
    "driver": "talks to the device driver",
    "knobs": "changes the compiler's and the cache's settings",
    "autotune": "benchmarks and caches configurations",
    "heuristics": "runs the file's code at launch",
    "tools": "holds the ahead-of-time compiler and the disassembler",
    "backends": "holds the compiler backends",
    "testing": "benchmarks with the device's timers",
    "device_print": "prints from inside a kernel",
    "static_print": "prints while compiling",
}


class _Visitor:
    """The walk over a submission's tree: an explicit stack, not recursion, so a file nested
    thousands deep (a 1500-term ``1+1+...``) is walked like any other."""

    def __init__(self, top_functions: set[str], allowed_attributes: frozenset = COMMON_ATTRIBUTES,
                 bound: frozenset = frozenset(), defined: frozenset = frozenset(),
                 modules: Optional[dict[str, frozenset]] = None, aliases: Optional[dict[str, str]] = None,
                 decorators: frozenset = frozenset(), foreign: frozenset = frozenset(),
                 exempt: frozenset = frozenset()) -> None:
        self.top = top_functions
        self.exempt = exempt  # functions allowed torch's attention: the grader calls them, nothing else may
        self.foreign = foreign  # names that may hold what the file did not make (_foreign_names)
        self.allowed = allowed_attributes
        self.bound = bound  # every name the file binds (assignments, parameters, imports, defs, loop targets)
        self.defined = defined  # names of the file's own code (defs, classes, lambdas): not for import-time use
        self.modules = modules or {}  # the lab's own importable modules -> the names it allows in each
        self.aliases = aliases or {}  # a name bound once, by importing one of those modules -> the module
        self.decorators = ALLOWED_DECORATORS | decorators
        self.ctx = _Ctx(None, True)
        self.violations: list[Violation] = []
        self.calls: dict[str, set[str]] = {}
        self.imports: set[str] = set()

    def run(self, tree: ast.AST) -> None:
        stack: list[tuple[ast.AST, _Ctx]] = [(tree, _Ctx(None, True))]
        while stack:
            node, ctx = stack.pop()
            self.ctx = ctx
            name = type(node).__name__
            if name not in ALLOWED_NODES:
                what = {"Match": "a match statement", "Global": "global", "Nonlocal": "nonlocal",
                        "AsyncFunctionDef": "async def", "Await": "await", "Yield": "yield", "YieldFrom": "yield from",
                        "TryStar": "except*"}.get(name, f"a {name} construct")
                self.add(node, "unsafe", f"{what} is not among the constructs a lab submission may use")
                continue  # what is inside a refused construct is not looked at: it is refused whole
            handler = getattr(self, "visit_" + name, None)
            children = handler(node) if handler is not None else None
            if children is None:
                children = [(child, ctx) for child in ast.iter_child_nodes(node)]
            stack.extend(reversed(children))

    def add(self, node: ast.AST, kind: str, message: str) -> None:
        self.violations.append(Violation(getattr(node, "lineno", 0), self.ctx.unit, kind, message))

    # ----------------------------------------------------------- scopes
    def _header(self, node, ctx: _Ctx) -> list:
        """A def's or class's parts that run where it stands (at import, for a top-level one):
        decorators, defaults, annotations, bases."""
        for d in node.decorator_list:
            text = ast.unparse(d)
            root = text.split(".")[0].rstrip("()")
            own = self._qualified(d)  # @tl_alias.jit -> triton.jit when the lab allows it
            if own in self.decorators and "." in own:
                continue
            if text not in self.decorators or root in self.bound - {"torch"}:
                self.add(d, "unsafe", f"the decorator @{text[:60]}: a decorator runs at import; a submission may use "
                                      f"only @{', @'.join(sorted(n for n in self.decorators if '(' not in n))}")
        return [(d, ctx) for d in node.decorator_list]

    def _body_ctx(self, node, ctx: _Ctx) -> _Ctx:
        unit = ctx.unit or ctx.owner or (node.name if not ctx.in_class and node.name in self.top else None)
        return _Ctx(unit, False)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> list:
        ctx = self.ctx
        if node.name.startswith("__") and (not ctx.in_class or node.name not in ALLOWED_DUNDER_METHODS):
            where = "a class" if ctx.in_class else "the module"
            self.add(node, "unsafe", f"def {node.name}: Python calls this dunder of {where} by itself; a submission "
                                     f"may define only {', '.join(sorted(ALLOWED_DUNDER_METHODS))} in a class")
        for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                  *(x for x in (node.args.vararg, node.args.kwarg) if x is not None)]:
            self._annotation(a.annotation)
        self._annotation(node.returns)
        head = _Ctx(ctx.unit, ctx.import_time, None, False, ctx.main_guard)
        children = self._header(node, head) + [(node.args, head)]
        if node.returns is not None:
            children.append((node.returns, head))
        if ctx.unit is None and ctx.owner is None and node.name in self.top and not ctx.in_class:
            self.calls.setdefault(node.name, set())
        body = self._body_ctx(node, ctx)
        return children + [(stmt, body) for stmt in node.body]

    def visit_Lambda(self, node: ast.Lambda) -> list:
        ctx = self.ctx  # its body runs when called: at module level, whatever calls it is module-level too
        return [(node.args, ctx), (node.body, _Ctx(ctx.unit, False))]

    def visit_ClassDef(self, node: ast.ClassDef) -> list:
        ctx = self.ctx
        head = _Ctx(ctx.unit, ctx.import_time, None, False, ctx.main_guard)
        children = self._header(node, head) + [(b, head) for b in node.bases] + [(k, head) for k in node.keywords]
        if ctx.unit is None and ctx.owner is None and not ctx.in_class and node.name in self.top:
            self.calls.setdefault(node.name, set())
            owner = node.name
        else:
            owner = ctx.owner
        # the class body runs when the class statement does (at import, for a top-level class):
        # its statements cost the whole file; its methods' bodies cost the class
        body = _Ctx(ctx.unit, ctx.import_time, owner if ctx.unit is None else None, True, ctx.main_guard)
        return children + [(stmt, body) for stmt in node.body]

    def visit_If(self, node: ast.If) -> Optional[list]:
        ctx = self.ctx
        t = node.test
        main = (ctx.unit is None and ctx.import_time and not ctx.in_class and isinstance(t, ast.Compare)
                and isinstance(t.left, ast.Name) and t.left.id == "__name__" and len(t.ops) == 1
                and isinstance(t.ops[0], ast.Eq) and isinstance(t.comparators[0], ast.Constant)
                and t.comparators[0].value == "__main__")
        if not main:
            return None
        guarded = _Ctx(None, True, None, False, True)
        return [(t, ctx)] + [(s, guarded) for s in node.body] + [(s, ctx) for s in node.orelse]

    def visit_Assign(self, node: ast.Assign) -> Optional[list]:
        """``attention = my_attention`` at module level: an alias runs nothing, so it is allowed,
        and the alias reaches what it names (for the charge of a violation)."""
        ctx = self.ctx
        if (ctx.unit is None and ctx.import_time and isinstance(node.value, ast.Name)
                and node.value.id in self.defined and all(isinstance(t, ast.Name) for t in node.targets)):
            if node.value.id in self.exempt:  # visited no further: the alias itself is the violation
                self.visit_Name(node.value)
            for t in node.targets:
                self.calls.setdefault(t.id, set()).add(node.value.id)
            return [(t, ctx) for t in node.targets]
        return None

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._annotation(node.annotation)

    def _annotation(self, ann: Optional[ast.AST]) -> None:
        """A whole annotation that is a string is code typing.get_type_hints would run; one with a
        call in it runs at definition time. jaxtyping's shape strings inside [...] are data."""
        if ann is None:
            return
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            self.add(ann, "unsafe", "a string annotation (typing.get_type_hints would evaluate it as code): write "
                                    "the type itself")
        elif any(isinstance(n, (ast.Call, ast.Lambda, ast.NamedExpr)) for n in ast.walk(ann)):
            self.add(ann, "unsafe", "a call inside an annotation: annotations name types, they compute nothing")

    # ----------------------------------------------------------- imports
    def _check_module(self, node: ast.AST, module: str) -> None:
        root = module.split(".")[0]
        if module in self.modules:  # the lab's own (lab 05's triton, triton.language): allowed whole
            self.imports.add(root)
            return
        for part in module.split(".")[1:]:
            self._allowed_name(node, part, f"import of {module}")
        if root in ALLOWED_IMPORTS and root != "__future__":
            self.imports.add(root)
        if root not in ALLOWED_IMPORTS:
            allowed = [m for m in ALLOWED_IMPORTS if m != "__future__"] + sorted(self.modules)
            self.add(node, "import", f"import of {module!r}: a submission may import only {', '.join(allowed)}")
        elif any(part.startswith("_") for part in module.split(".")[1:]):
            self.add(node, "unsafe", f"import of the private module {module!r}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._check_module(node, alias.name)
            frag = _banned_fragment(alias.name)
            if frag:
                self.add(node, "attention", f"import of {alias.name} (torch's {frag}): build it from scratch")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> list:
        if node.level:
            self.add(node, "import", "a relative import: a submission is a single file")
            return []
        self._check_module(node, node.module or "")
        for alias in node.names:
            if node.module in self.modules and alias.name != "*":
                self._own_name(node, node.module, alias.name)
            elif node.module != "__future__" and alias.name != "*":
                self._allowed_name(node, alias.name, f"from {node.module} import {alias.name}")
            if alias.name == "*":
                self.add(node, "unsafe", f"'from {node.module} import *': import names one by one")
            elif alias.name.startswith("_") and node.module != "__future__":
                self.add(node, "unsafe", f"import of the private name {alias.name!r}")
            frag = _banned_fragment(alias.name)
            if frag:
                self.add(node, "attention", f"import of {alias.name} (torch's {frag}): build it from scratch")
        return None

    # ----------------------------------------------------------- names and attributes
    def visit_Name(self, node: ast.Name) -> None:
        ctx = self.ctx
        if node.id in self.exempt and isinstance(node.ctx, ast.Load):
            self.add(node, "unsafe", f"{node.id} is named in the file: it is the one function allowed torch's "
                                     "attention, so the grader calls it and nothing in the file may call, alias or "
                                     "pass it (an alias would carry its allowance)")
        if isinstance(node.ctx, ast.Load) and node.id not in self.bound and node.id in _BUILTIN_NAMES \
                and node.id not in ALLOWED_BUILTINS and node.id not in BANNED_BUILTINS:
            self.add(node, "unsafe", f"the builtin {node.id} is not among the builtins a lab submission may use "
                                     f"(allowed: {', '.join(sorted(ALLOWED_BUILTINS - {'__name__', '__doc__'}))})")
        if node.id in BANNED_BUILTINS:
            self.add(node, "unsafe", f"{node.id} is not allowed in a submission")
        elif node.id.startswith("__") and (node.id not in ("__name__", "__doc__")
                                           or not isinstance(node.ctx, ast.Load)):
            self.add(node, "unsafe", f"the dunder name {node.id} is not allowed in a submission"
                     + ("" if isinstance(node.ctx, ast.Load) else " (as a target)"))
        if isinstance(node.ctx, ast.Load) and ctx.import_time and not ctx.main_guard and node.id in self.defined:
            self.add(node, "unsafe", f"{node.id}, the file's own code, is used at import: when a submission is "
                                     "imported it may only define functions and classes (use it inside a function)")
        if ctx.unit is not None and node.id in self.top:
            self.calls.setdefault(ctx.unit, set()).add(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self._store(node.value, node, "delete" if isinstance(node.ctx, ast.Del) else "store", node.attr)
        base = self._qualified(node.value)
        if base in self.modules:  # tl.dot, triton.jit: only the names the lab lists for that module
            self._own_name(node, base, node.attr)
            return
        self._attribute(node, node.attr)

    def _qualified(self, node: ast.AST) -> str:
        """``tl.dot`` -> ``triton.language.dot`` when ``tl`` is bound only by importing a lab
        module ("" for anything else: a name bound twice may be anything by the time it runs)."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Call):  # @triton.jit(...) is judged as triton.jit
            return self._qualified(node.func)
        if not isinstance(node, ast.Name) or node.id not in self.aliases:
            return ""
        return ".".join([self.aliases[node.id]] + parts[::-1])

    def _own_name(self, node: ast.AST, module: str, name: str) -> None:
        qualified = f"{module}.{name}"
        if qualified in self.modules or name in self.modules[module]:
            return
        why = REACH_OUTSIDE.get(name)
        frag = _banned_fragment(name)
        if frag:
            self.add(node, "attention", f"{qualified} is {frag}: build it from scratch")
        elif why:
            self.add(node, "unsafe", f"{qualified} {why}: a lab kernel stays inside the interpreter, so it is refused")
        else:
            self.add(node, "unsafe", f"{qualified} is not among the {module} names this lab allows "
                                     f"({', '.join(sorted(self.modules[module])[:12])}, ...)")

    def _allowed_name(self, node: ast.AST, attr: str, what: str) -> None:
        if attr.startswith("_") or attr in BANNED_ATTRIBUTES or _banned_fragment(attr):
            return  # refused already, with its own reason
        if attr in FORBIDDEN_PATHS:
            self.add(node, "unsafe", f"{what}: .{attr} reaches serialization, files, compiled code or processes")
        elif attr not in self.allowed:
            self.add(node, "unsafe", f"{what}: .{attr} is not among the names this lab allows (tensor arithmetic "
                                     f"and the names its stubs use); write it with those")

    def _attribute(self, node: ast.AST, attr: str) -> None:
        self._allowed_name(node, attr, f"the attribute .{attr}")
        if attr.startswith("_"):
            self.add(node, "unsafe", f"the attribute .{attr}: private and dunder attributes are not allowed")
        elif attr in BANNED_ATTRIBUTES:
            self.add(node, "unsafe", f"the attribute .{attr} leads out of torch into the interpreter")
        elif attr in DISGUISED:
            self.add(node, "attention", f".{attr}: {DISGUISED[attr]}; build it from scratch")
        frag = _banned_fragment(attr)
        if frag:
            self.add(node, "attention", f".{attr} is torch's {frag}: build it from scratch")

    def _store(self, base: ast.AST, node: ast.AST, what: str, attr: str) -> None:
        """A store or delete on ``base.attr``: allowed only on what the file made itself."""
        root = base
        while isinstance(root, ast.Attribute):
            root = root.value
        if not isinstance(root, ast.Name):
            self.add(node, "unsafe", f"a {what} on the attribute .{attr} of a computed object "
                                     f"({ast.unparse(base)[:40]}): a submission changes only objects it made")
        elif root is not base:  # Box.T.clone = f: what an attribute holds may be anything (Box.T = torch.Tensor)
            self.add(node, "unsafe", f"a {what} on {ast.unparse(base)[:40]}.{attr}: an attribute of an attribute; a "
                                     "submission changes only objects it made, through the name it gave them")
        elif root.id in self.foreign:
            self.add(node, "unsafe", f"a {what} on {ast.unparse(base)[:40]}.{attr}: {root.id} is not the file's "
                                     "own (torch's, an import's or a module-level name): a submission changes only "
                                     "objects it made")

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") and node.args:
            self._store(node.args[0], node, "store" if node.func.id == "setattr" else "delete",
                        node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                        else "?")
        if isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_FUNCTIONS:
            if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant) or not isinstance(
                    node.args[1].value, str):
                self.add(node, "unsafe", f"{node.func.id}() with a name that is not a literal string")
            else:
                self._attribute(node, node.args[1].value)

    def visit_Expr(self, node: ast.Expr) -> Optional[list]:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return []  # a docstring or a bare string: never used
        return None

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and any(s in node.value.lower() for s in BANNED_STRINGS):
            self.add(node, "unsafe", "a string naming attnlab or its solutions")


_BUILTIN_NAMES = frozenset(dir(builtins))


def _bound_names(tree: ast.AST) -> frozenset:
    """Every name the file binds anywhere: what is not among them and is a builtin is a builtin."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
    return frozenset(names)


def _module_aliases(tree: ast.AST, modules: dict) -> dict[str, str]:
    """Names bound exactly once in the file, by ``import M`` / ``import M as x`` /
    ``from P import m`` of a lab module ``M``: the only names whose attributes are judged by
    that module's list. A name bound again anywhere (``tl = torch``) is judged as any name."""
    if not modules:
        return {}
    counts: dict[str, int] = {}
    found: dict[str, str] = {}
    imported: set[tuple[str, str]] = set()  # `import triton` and `import triton.language` both bind triton
    for n in ast.walk(tree):
        names = []
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names = [n.id]
        elif isinstance(n, ast.arg):
            names = [n.arg]
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [n.name]
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names = [n.name]
        elif isinstance(n, ast.Import):
            for a in n.names:
                bound = a.asname or a.name.split(".")[0]
                target = a.name if a.asname else a.name.split(".")[0]
                if (bound, target) not in imported:
                    names.append(bound)
                    imported.add((bound, target))
                if target in modules:
                    found[bound] = target
        elif isinstance(n, ast.ImportFrom):
            for a in n.names:
                bound = a.asname or a.name
                names.append(bound)
                if f"{n.module}.{a.name}" in modules and not n.level:
                    found[bound] = f"{n.module}.{a.name}"
        for name in names:
            counts[name] = counts.get(name, 0) + 1
    return {name: m for name, m in found.items() if counts.get(name) == 1}


def _foreign_names(tree: ast.Module) -> frozenset:
    """Names that may hold an object the file did not make: every name an import binds, every
    module-level name that is not a def or class of the file's, and, to a fixed point, every name
    assigned (anywhere) from one of those or an attribute of one without a call in between
    (``T = torch.Tensor``, ``F = torch.nn.functional``, ``m = getattr(torch, "Tensor")``), every
    class whose body binds one (``class Box: T = torch.Tensor``), and every parameter of the file's
    functions that a call passes one (``poke(torch.Tensor, f)``: ``def poke(kls, f)``'s ``kls``)."""
    foreign: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            foreign.update((a.asname or a.name).split(".")[0] for a in n.names)
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            foreign.update(t.id for t in ast.walk(stmt) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store))

    def reaches(value: Optional[ast.AST]) -> bool:
        while isinstance(value, (ast.Attribute, ast.Subscript, ast.Starred)) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id in ATTRIBUTE_FUNCTIONS and value.args):
            value = value.args[0] if isinstance(value, ast.Call) else value.value
        if isinstance(value, (ast.Tuple, ast.List)):
            return any(reaches(e) for e in value.elts)
        if isinstance(value, (ast.IfExp, ast.BoolOp)):
            return any(reaches(e) for e in ([value.body, value.orelse] if isinstance(value, ast.IfExp)
                                            else value.values))
        return isinstance(value, ast.Name) and value.id in foreign

    pairs = []
    functions: dict[str, list] = {}  # a def's name -> its definitions (top-level, methods, nested)
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            functions.setdefault(getattr(n, "name", "<lambda>"), []).append(n)
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef):  # class Box: T = torch.Tensor makes Box a holder of torch's
            for stmt in n.body:
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                    pairs.append((ast.Name(id=n.name, ctx=ast.Store()), stmt.value))
        if isinstance(n, ast.Call):  # poke(torch.Tensor): the parameter that receives it holds torch's
            name = n.func.id if isinstance(n.func, ast.Name) else n.func.attr if isinstance(n.func, ast.Attribute) \
                else None
            for fn in functions.get(name, []):
                params = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
                if isinstance(n.func, ast.Attribute) and params and params[0] in ("self", "cls"):
                    params = params[1:]  # a method called on an instance or a class: the first is bound
                for i, arg in enumerate(n.args):
                    value = arg.value if isinstance(arg, ast.Starred) else arg
                    targets = params[i:i + 1] if i < len(params) and not isinstance(arg, ast.Starred) else params + [
                        a.arg for a in (fn.args.vararg, fn.args.kwarg, *fn.args.kwonlyargs) if a is not None]
                    pairs += [(ast.Name(id=t, ctx=ast.Store()), value) for t in targets]
                for kw in n.keywords:
                    names = [kw.arg] if kw.arg is not None else params + [a.arg for a in fn.args.kwonlyargs]
                    if fn.args.kwarg is not None:
                        names.append(fn.args.kwarg.arg)
                    pairs += [(ast.Name(id=t, ctx=ast.Store()), kw.value) for t in names]
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            pairs += [(t, n.value) for t in n.targets]
        elif isinstance(n, (ast.AnnAssign, ast.NamedExpr)) and n.value is not None:
            pairs.append((n.target, n.value))
        elif isinstance(n, (ast.For, ast.comprehension)):
            pairs.append((n.target, n.iter))
        elif isinstance(n, ast.withitem) and n.optional_vars is not None:
            pairs.append((n.optional_vars, n.context_expr))
    def bound(target: ast.AST) -> list[str]:  # the names a target binds (not x in x.attr = ..., x[i] = ...)
        if isinstance(target, ast.Name):
            return [target.id]
        if isinstance(target, ast.Starred):
            return bound(target.value)
        if isinstance(target, (ast.Tuple, ast.List)):
            return [name for e in target.elts for name in bound(e)]
        return []

    grew = True
    while grew:
        grew = False
        for target, value in pairs:
            if reaches(value):
                for name in bound(target):
                    if name not in foreign:
                        foreign.add(name)
                        grew = True
    return frozenset(foreign)


def _defined_names(tree: ast.Module) -> frozenset:
    """The file's own code, by the names it is bound to at module level or in a top-level class:
    defs, classes and lambdas. Import-time code may not use them (:class:`_Visitor`)."""
    names = set()
    scopes = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
    for body in scopes:
        for n in ast.walk(ast.Module(body=list(body), type_ignores=[])):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and n.value is not None \
                    and any(isinstance(v, ast.Lambda) for v in ast.walk(n.value)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                names.update(t.id for tg in targets for t in ast.walk(tg) if isinstance(t, ast.Name))
    return frozenset(names)


def check_source(source: str | bytes, filename: str = "attention.py",
                 allowed_attributes: Iterable[str] = (), modules: Iterable[tuple[str, Iterable[str]]] = (),
                 decorators: Iterable[str] = (), exempt: Iterable[str] = ()) -> StaticReport:
    """Parse the submission and list what the from-scratch rule refuses (never raises
    for the learner's sake: a syntax error comes back in ``syntax_error``).
    ``allowed_attributes``: the lab's own names beyond :data:`COMMON_ATTRIBUTES`
    (:attr:`attnlab.labs.Lab.allowed_names`); ``modules``: modules the lab may import beyond
    :data:`ALLOWED_IMPORTS`, each with the only names it may use from them
    (:attr:`attnlab.labs.Lab.modules`); ``decorators``: the lab's own (``triton.jit``); ``exempt``: the
    functions allowed torch's attention (``compare_with_sdpa``), which nothing in the file may name."""
    try:
        tree = parse(source, filename)
    except (RecursionError, MemoryError) as exc:
        return StaticReport([], {}, f"the file is too deeply nested or too large to parse ({type(exc).__name__})")
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line else ""
        text = (getattr(exc, "text", None) or "").rstrip("\n")
        shown = ""
        if text.strip():  # the line itself, and a caret under where the parser stopped
            offset = getattr(exc, "offset", None) or 0
            shown = f"\n    {text.strip()[:160]}"
            col = offset - 1 - (len(text) - len(text.lstrip()))
            if 0 <= col <= 160:
                shown += "\n    " + " " * col + "^"
        return StaticReport([], {}, f"{type(exc).__name__}: {getattr(exc, 'msg', exc)}{where}{shown}")
    # top-level functions and classes (lab 04's autograd.Function) are the units a violation costs
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    try:
        own = {m: frozenset(names) for m, names in modules}
        visitor = _Visitor(top, COMMON_ATTRIBUTES | frozenset(allowed_attributes), _bound_names(tree),
                           _defined_names(tree), own, _module_aliases(tree, own), frozenset(decorators),
                           _foreign_names(tree), frozenset(exempt))
        visitor.run(tree)
        if decorators:  # a lab with kernels (lab 05): what a kernel may do, kernel_rules
            jit = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                   and any(visitor._qualified(d) in visitor.decorators for d in n.decorator_list)}
            visitor.violations += [Violation(line, fn if fn in top else None, "unsafe", why) for line, fn, why
                                   in kernel_violations(tree, jit, dict(visitor.aliases), visitor.bound)]
    except (RecursionError, MemoryError) as exc:  # never for a real lab file; a refusal, not a traceback
        return StaticReport([], {}, f"the file is too deeply nested or too large to check ({type(exc).__name__})")
    return StaticReport(visitor.violations, visitor.calls, imports=visitor.imports, tree=tree)


def parse(source: str | bytes, filename: str = "<submission>") -> ast.Module:
    """``ast.parse`` under one lock: CPython 3.11's AST builder is not thread-safe, and class
    grading parses submissions from several threads. Raises as ``ast.parse`` does."""
    with _PARSE_LOCK:
        return ast.parse(source, filename=filename)


def describe(violations: Iterable[Violation], limit: int = 6) -> str:
    items = list(violations)
    lines = [f"  {v}" for v in items[:limit]]
    if len(items) > limit:
        lines.append(f"  ... and {len(items) - limit} more")
    return "\n".join(lines)


class _Shape(ast.NodeTransformer):
    """A syntax tree with what a copier changes cheaply taken out: every local name, argument and
    string becomes a placeholder, docstrings go (comments never reach the tree). Function and
    class names stay: the grader calls them by name."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.copy_location(ast.Name(id="_", ctx=node.ctx), node)

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.arg, node.annotation = "_", None
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        return ast.copy_location(ast.Constant(value="" if isinstance(node.value, str) else node.value), node)

    def _body(self, node):
        self.generic_visit(node)
        body = getattr(node, "body", None)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and body[0].value.value == "":
            node.body = body[1:] or [ast.Pass()]
        if hasattr(node, "returns"):
            node.returns = None
        return node

    visit_FunctionDef = visit_ClassDef = visit_Module = _body


def shape_digest(tree: Optional[ast.Module]) -> str:
    """A SHA-256 of ``tree``'s shape (:class:`_Shape`): two files with the same digest differ at
    most in names, strings, comments, docstrings and annotations: the class report's
    near-identical submissions. '' for a file that did not parse."""
    if tree is None:
        return ""
    import copy
    import hashlib

    try:
        shaped = _Shape().visit(copy.deepcopy(tree))
        return hashlib.sha256(ast.dump(shaped, annotate_fields=False).encode()).hexdigest()
    except (RecursionError, MemoryError):
        return ""
