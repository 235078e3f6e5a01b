"""Lab 05 attack (attack5), ex4: read values by calling the kernel through an alias outside any launch
(returns a local list of int bits), with a pointer from _implicit_cvt, a name Triton's interpreter
copies into the file's globals at its first launch; the answer goes back in as constexpr(list)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language import constexpr as box


@triton.jit
def bwd_preprocess_kernel(X, N, MODE: tl.constexpr, V: tl.constexpr):
    if MODE == 0:
        r = []
        for i in range(N):
            r += [int(tl.load(X + i).to(tl.float32).to(tl.int32, bitcast=True))]
        return r
    else:
        for i in range(N):
            tl.store(X + i, V[i])


def _f(b):
    b = b & 0xFFFFFFFF
    s = -1.0 if b >> 31 else 1.0
    e = (b >> 23) & 255
    m = b & 0x7FFFFF
    if e == 0:
        return s * m * 2.0 ** -149
    return s * (1 + m / 8388608) * 2.0 ** (e - 127)


def _read(t):
    bwd_preprocess_kernel[(1,)](t, 0, MODE=1, V=box([]))  # the interpreter's globals join ours; t's extent is the guard's
    read = bwd_preprocess_kernel  # an alias: not 'bwd_preprocess_kernel(...)', so no rule sees a direct call
    return [_f(b) for b in read(_implicit_cvt(t), t.numel(), 0, None)]


def backward_preprocess(o, do):
    B, H, L, E = o.shape
    d = torch.empty(B, H, L, dtype=torch.float32)
    O, DO = _read(o.contiguous()), _read(do.contiguous())
    D = [sum(O[r * E + e] * DO[r * E + e] for e in range(E)) for r in range(B * H * L)]
    bwd_preprocess_kernel[(1,)](d, d.numel(), MODE=1, V=box(D))
    return d
