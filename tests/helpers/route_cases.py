"""The attention cases every native-kernel route is checked on (the bf16 routes, the float32 GEMM
routes), and a spy on the native ops' arguments: one copy for each route's test module."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from attnlab.kernels import native as _native

CASES = {
    "tiles": dict(q=(1, 2, 300, 64), kv=(1, 2, 600, 64), causal=True),
    "gqa": dict(q=(2, 8, 257, 128), kv=(2, 2, 257, 128), causal=True, gqa=True),
    "odd_sizes": dict(q=(2, 3, 17, 7), kv=(2, 3, 5, 7), v_dim=9),
    "bool_mask": dict(q=(1, 2, 64, 32), kv=(1, 2, 96, 32), mask="bool"),
    "float_mask": dict(q=(1, 2, 64, 32), kv=(1, 2, 96, 32), mask="float"),
}


def case_inputs(case: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(q, k, v, attn_mask)`` of one of :data:`CASES` in ``dtype`` (a float mask too)."""
    c = CASES[case]

    def randn(*shape, seed=0):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)

    q, k = randn(*c["q"]), randn(*c["kv"], seed=1)
    v = randn(*c["kv"][:-1], c.get("v_dim", c["kv"][-1]), seed=2)
    mask = None
    if c.get("mask") == "bool":
        mask = torch.rand(c["q"][-2], c["kv"][-2], generator=torch.Generator().manual_seed(3)) > 0.3
    elif c.get("mask") == "float":
        mask = randn(c["q"][-2], c["kv"][-2], seed=3)
    return q, k, v, mask


def spy_calls(monkeypatch, op_name: str, pick: Callable[[tuple], object]) -> list:
    """``pick(args)`` of each call of the native op ``op_name`` (the other ops pass through); one
    module object serves tiled's, flex's and decoding's ``_native``, so every caller is seen."""
    seen, real = [], _native.ops()

    class Spy:
        def __getattr__(self, name):
            op = getattr(real, name)
            if name != op_name:
                return op

            def call(*args):
                seen.append(pick(args))
                return op(*args)
            return call

    monkeypatch.setattr(_native, "ops", lambda: Spy())
    return seen
