"""``nn.Module`` wrappers around attnlab's reference attention."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab import functional as F_
from attnlab._validation import validate
from attnlab.trace import AttentionTrace

__all__ = ["SelfAttention"]


class SelfAttention(nn.Module):
    """Single-head self-attention, the lesson's module.

    ``Q = x @ W_Q``, ``K = x @ W_K``, ``V = x @ W_V`` (plus biases when ``bias=True``),
    then ``softmax(Q @ K^T / sqrt(d_k)) @ V`` with attnlab's from-scratch reference.

    Parameters (shapes as in the lesson, inputs on the left so ``x @ W`` works):
        ``W_Q (d_model, d_k)``, ``W_K (d_model, d_k)``, ``W_V (d_model, d_v)``;
        with ``bias=True`` also ``b_Q (d_k,)``, ``b_K (d_k,)``, ``b_V (d_v,)``.

    The weights start as ``randn / sqrt(d_model)``, so unit-variance inputs give
    unit-variance Q, K, V. (The lesson draws plain ``randn``; use
    :meth:`from_weights` to load any weights you like.)

    Args:
        d_model: feature size of the input ``x``.
        d_k: query/key size (the scores are scaled by ``1 / sqrt(d_k)``).
        d_v: value (and output) size.
        bias: add learnable biases to the three projections.
    """

    def __init__(self, d_model: int, d_k: int, d_v: int, bias: bool = False) -> None:
        super().__init__()
        for name, n in (("d_model", d_model), ("d_k", d_k), ("d_v", d_v)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"SelfAttention: {name} must be a positive int, got {n!r}")
        self.d_model, self.d_k, self.d_v = d_model, d_k, d_v
        std = 1.0 / math.sqrt(d_model)
        self.W_Q = nn.Parameter(torch.randn(d_model, d_k) * std)
        self.W_K = nn.Parameter(torch.randn(d_model, d_k) * std)
        self.W_V = nn.Parameter(torch.randn(d_model, d_v) * std)
        if bias:
            self.b_Q = nn.Parameter(torch.zeros(d_k))
            self.b_K = nn.Parameter(torch.zeros(d_k))
            self.b_V = nn.Parameter(torch.zeros(d_v))
        else:
            self.register_parameter("b_Q", None)
            self.register_parameter("b_K", None)
            self.register_parameter("b_V", None)

    @classmethod
    def from_weights(
        cls,
        W_Q: Tensor,
        W_K: Tensor,
        W_V: Tensor,
        b_Q: Optional[Tensor] = None,
        b_K: Optional[Tensor] = None,
        b_V: Optional[Tensor] = None,
    ) -> "SelfAttention":
        """Build a module holding copies of the given weights.

        Args:
            W_Q: ``(d_model, d_k)``.
            W_K: ``(d_model, d_k)``.
            W_V: ``(d_model, d_v)``.
            b_Q, b_K, b_V: ``(d_k,)``, ``(d_k,)``, ``(d_v,)``; all three or none.

        The module takes the weights' dtype and device.
        """
        for name, w in (("W_Q", W_Q), ("W_K", W_K), ("W_V", W_V)):
            if not isinstance(w, Tensor):
                raise TypeError(f"SelfAttention.from_weights: {name} must be a torch.Tensor, got {type(w).__name__}")
            if w.dim() != 2:
                raise ValueError(f"SelfAttention.from_weights: {name} must be 2-D (d_model, d_out), "
                                 f"got shape {tuple(w.shape)}")
        d_model, d_k = W_Q.shape
        d_v = W_V.shape[1]
        if tuple(W_K.shape) != (d_model, d_k):
            raise ValueError(f"SelfAttention.from_weights: W_K must have W_Q's shape {(d_model, d_k)}, "
                             f"got {tuple(W_K.shape)}")
        if W_V.shape[0] != d_model:
            raise ValueError(f"SelfAttention.from_weights: W_V must be (d_model={d_model}, d_v), "
                             f"got {tuple(W_V.shape)}")
        biases = (b_Q, b_K, b_V)
        has_bias = [b is not None for b in biases]
        if any(has_bias) and not all(has_bias):
            raise ValueError("SelfAttention.from_weights: pass all three biases b_Q, b_K, b_V or none")
        if all(has_bias):
            for name, b, n in (("b_Q", b_Q, d_k), ("b_K", b_K, d_k), ("b_V", b_V, d_v)):
                if tuple(b.shape) != (n,):
                    raise ValueError(f"SelfAttention.from_weights: {name} must have shape ({n},), "
                                     f"got {tuple(b.shape)}")
        module = cls(d_model, d_k, d_v, bias=all(has_bias)).to(device=W_Q.device, dtype=W_Q.dtype)
        with torch.no_grad():
            module.W_Q.copy_(W_Q)
            module.W_K.copy_(W_K)
            module.W_V.copy_(W_V)
            if all(has_bias):
                module.b_Q.copy_(b_Q)
                module.b_K.copy_(b_K)
                module.b_V.copy_(b_V)
        return module

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x (..., T, d_model) -> Q (..., T, d_k), K (..., T, d_k), V (..., T, d_v)``."""
        self._check_input(x)
        Q = x @ self.W_Q  # (..., T, d_k)
        K = x @ self.W_K  # (..., T, d_k)
        V = x @ self.W_V  # (..., T, d_v)
        if self.b_Q is not None:
            Q, K, V = Q + self.b_Q, K + self.b_K, V + self.b_V
        return Q, K, V

    def forward(
        self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Attend over the sequence.

        Args:
            x: ``(B, T, d_model)`` (any leading dims work: ``(..., T, d_model)``).
            attn_mask: ``None`` or bool (``True`` = attend) / float (added), broadcastable
                to ``(B, T, T)``.
            is_causal: top-left causal mask (position ``i`` sees ``0..i``).

        Returns:
            ``(output (B, T, d_v), attn_weights (B, T, T))``.
        """
        return self._run(x, attn_mask, is_causal, record=None)

    def trace(
        self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False
    ) -> AttentionTrace:
        """Run :meth:`forward` and record every step: X, Q, K, V, scores, (masked_scores),
        scores_shifted, weights, output, each with its name, shape and a detached tensor.
        """
        trace = AttentionTrace()
        self._run(x, attn_mask, is_causal, record=trace.record)
        return trace

    def _run(self, x, attn_mask, is_causal, record):
        Q, K, V = self.project(x)
        if record is not None:
            for name, t in (("X", x), ("Q", Q), ("K", K), ("V", V)):
                record(name, t)
        validate(Q, K, V, attn_mask, 0.0, is_causal, None, False, fn="SelfAttention.forward")
        return F_._attention(Q, K, V, attn_mask, 0.0, is_causal, None, False, record=record)

    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"SelfAttention: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"SelfAttention: x must be (B, T, d_model={self.d_model}), got shape {tuple(x.shape)}")
        if x.dtype != self.W_Q.dtype:
            raise TypeError(f"SelfAttention: x.dtype must match the weights' {self.W_Q.dtype}, got {x.dtype} "
                            f"(convert x, or the module with .to({x.dtype}))")

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_k={self.d_k}, d_v={self.d_v}, bias={self.b_Q is not None}"
