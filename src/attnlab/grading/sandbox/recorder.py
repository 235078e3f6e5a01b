"""The from-scratch policy: record every torch call and flag the forbidden ones.

Two recorders run together. :class:`FunctionRecorder` (a ``TorchFunctionMode``)
sees Python-level torch functions and ``Tensor`` methods under any alias
(``torch.softmax``, ``F.softmax``, ``x.softmax``, ``torch.special.softmax``,
``F.multi_head_attention_forward``...). :class:`KernelRecorder` (a
``TorchDispatchMode``) sees the ATen kernels underneath, so a route that never
touches a Python name (a saved C function, ``torch.ops.aten._softmax``) is caught
too.
"""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BANNED_FRAGMENTS", "FunctionRecorder", "KernelRecorder", "banned", "Policy"]

# Substrings of function / kernel names that attention code must not reach.
BANNED_FRAGMENTS = ("softmax", "scaled_dot_product", "multi_head_attention", "multiheadattention",
                    "flash_attention", "efficient_attention", "flex_attention", "transformer_encoder",
                    "transformerencoder", "transformerdecoder", "transformer_decoder")


def banned(names: list[str]) -> list[str]:
    """The distinct forbidden names among ``names``, sorted."""
    return sorted({n for n in names if any(b in n.lower() for b in BANNED_FRAGMENTS)})


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


class FunctionRecorder(TorchFunctionMode):
    """Records the name of every torch function and Tensor method called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(_name(func))
        return func(*args, **(kwargs or {}))


class KernelRecorder(TorchDispatchMode):
    """Records the name of every ATen kernel dispatched inside it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ so that torch.compile skips it; the wrapper
        # imports torch._dynamo on first use (~1 s). Nothing here is compiled.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class Policy:
    """Both recorders at once: ``with Policy() as p: ...; p.violations()``."""

    def __init__(self) -> None:
        self.functions = FunctionRecorder()
        self.kernels = KernelRecorder()

    def __enter__(self) -> "Policy":
        self.kernels.__enter__()
        self.functions.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.functions.__exit__(*exc)
        self.kernels.__exit__(*exc)

    def violations(self) -> list[str]:
        return banned(self.functions.names + self.kernels.names)
