"""The parity matrix (shapes, masks, options) that the reference's and the tiled path's parity
tests share: each :class:`Case` built in any dtype from a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
NEG_INF = float("-inf")


@dataclass
class Case:
    """Shapes and options of one parity case; tensors are drawn from a seeded generator."""

    id: str
    q: tuple
    k: tuple
    v: tuple
    mask: Optional[Callable[[torch.Generator], torch.Tensor]] = None  # float32/bool, built in float32
    kwargs: dict = field(default_factory=dict)
    magnitude: float = 1.0
    layout: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # e.g. a non-contiguous view
    mask_requires_grad: bool = False


def _bool(shape, p=0.7):
    return lambda g: torch.rand(shape, generator=g) < p


def _float(shape):
    return lambda g: torch.randn(shape, generator=g)


def _padding(lengths, S):
    # (B, 1, 1, S): key j is real for j < length[b] (True = attend)
    return lambda g: (torch.arange(S) < torch.tensor(lengths).view(-1, 1)).view(len(lengths), 1, 1, S)


def _fully_masked_rows_bool(L, S):
    def make(g):
        m = torch.rand(L, S, generator=g) < 0.6
        m[0] = False
        m[L // 2] = False
        return m
    return make


def _fully_masked_rows_float(L, S):
    def make(g):
        m = torch.randn(L, S, generator=g)
        m[1] = NEG_INF
        m[:, 0] = NEG_INF  # and one column masked everywhere
        return m
    return make


B, H, L, S, E, Ev = 2, 3, 5, 7, 8, 6
CASES = [
    # ranks 2-5, L != S, Ev != E
    Case("rank2", (L, E), (S, E), (S, Ev)),
    Case("rank3", (B, L, E), (B, S, E), (B, S, Ev)),
    Case("rank4", (B, H, L, E), (B, H, S, E), (B, H, S, Ev)),
    Case("rank5", (2, B, H, L, E), (2, B, H, S, E), (2, B, H, S, Ev)),
    Case("L_eq_S", (B, H, 6, E), (B, H, 6, E), (B, H, 6, E)),
    Case("L1_S1", (B, H, 1, E), (B, H, 1, E), (B, H, 1, Ev)),
    Case("L_gt_S", (B, H, 9, E), (B, H, 4, E), (B, H, 4, Ev)),
    # broadcast leading dims
    Case("broadcast_batch", (B, 1, L, E), (1, H, S, E), (H, S, Ev)),
    Case("broadcast_kv_2d", (B, H, L, E), (S, E), (S, Ev)),
    # empty sizes
    Case("L0", (B, H, 0, E), (B, H, S, E), (B, H, S, Ev)),
    Case("S0", (B, H, L, E), (B, H, 0, E), (B, H, 0, Ev)),
    Case("B0", (0, H, L, E), (0, H, S, E), (0, H, S, Ev)),
    # bool masks in every broadcastable shape
    Case("bool_mask_LS", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _bool((L, S))),
    Case("bool_mask_1S", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _bool((1, S))),
    Case("bool_mask_L1", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _bool((L, 1), 0.8)),
    Case("bool_mask_B11S", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _bool((B, 1, 1, S))),
    Case("bool_mask_1HLS", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _bool((1, H, L, S))),
    Case("bool_mask_BHLS", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _bool((B, H, L, S))),
    Case("bool_mask_HLS", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _bool((H, L, S))),
    Case("padding_mask", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _padding([7, 3], S)),
    Case("fully_masked_rows_bool", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _fully_masked_rows_bool(L, S)),
    Case("fully_masked_batch", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _padding([S, 0], S)),
    # float masks (additive), including -inf rows and a mask that requires grad
    Case("float_mask_LS", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _float((L, S))),
    Case("float_mask_B1LS", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _float((B, 1, L, S))),
    Case("float_mask_1S", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _float((1, S))),
    Case("float_mask_requires_grad", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _float((H, L, S)),
         mask_requires_grad=True),
    Case("float_mask_minus_inf_rows", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _fully_masked_rows_float(L, S)),
    # causal, top-left, square and not
    Case("causal_square", (B, H, 6, E), (B, H, 6, E), (B, H, 6, Ev), kwargs={"is_causal": True}),
    Case("causal_L_lt_S", (B, H, 3, E), (B, H, 8, E), (B, H, 8, Ev), kwargs={"is_causal": True}),
    Case("causal_L_gt_S", (B, H, 8, E), (B, H, 3, E), (B, H, 3, Ev), kwargs={"is_causal": True}),
    Case("causal_rank2", (L, E), (S, E), (S, Ev), kwargs={"is_causal": True}),
    # scale
    Case("scale_explicit", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), kwargs={"scale": 0.3}),
    Case("scale_zero", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), kwargs={"scale": 0.0}),
    Case("scale_negative", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), kwargs={"scale": -0.7}),
    Case("scale_int", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), kwargs={"scale": 1}),
    # grouped-query and multi-query attention
    Case("gqa_6_2", (B, 6, L, E), (B, 2, S, E), (B, 2, S, Ev), kwargs={"enable_gqa": True}),
    Case("mqa_4_1", (B, 4, L, E), (B, 1, S, E), (B, 1, S, Ev), kwargs={"enable_gqa": True}),
    Case("gqa_k2_v3", (B, 6, L, E), (B, 2, S, E), (B, 3, S, Ev), kwargs={"enable_gqa": True}),
    Case("gqa_causal_mask", (B, 6, L, E), (B, 2, S, E), (B, 2, S, Ev), _bool((B, 6, L, S)),
         kwargs={"enable_gqa": True}),
    Case("gqa_same_heads", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), kwargs={"enable_gqa": True}),
    Case("gqa_rank3", (6, L, E), (2, S, E), (2, S, Ev), kwargs={"enable_gqa": True}),
    # dropout with a fixed seed: the same weights are dropped as in torch
    Case("dropout_0.2", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), kwargs={"dropout_p": 0.2}),
    Case("dropout_0.5_mask", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _bool((L, S)), kwargs={"dropout_p": 0.5}),
    Case("dropout_causal", (B, H, 6, E), (B, H, 6, E), (B, H, 6, Ev), kwargs={"dropout_p": 0.3, "is_causal": True}),
    Case("dropout_1", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), kwargs={"dropout_p": 1.0}),
    # layouts and magnitudes
    Case("non_contiguous", (B, L, H, E), (B, S, H, E), (B, S, H, Ev), layout=lambda t: t.transpose(1, 2)),
    Case("non_contiguous_strided", (B, H, L, 2 * E), (B, H, S, 2 * E), (B, H, S, 2 * Ev),
         layout=lambda t: t[..., ::2]),
    Case("expanded_kv", (B, H, L, E), (1, 1, S, E), (1, 1, S, Ev), layout=lambda t: t.expand(B, H, *t.shape[2:])),
    Case("large_scores_1e4", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), magnitude=35.0),
    Case("large_scores_masked", (B, H, L, E), (B, H, S, E), (B, H, S, Ev), _bool((L, S)), magnitude=35.0),
]


def build(case: Case, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g) for s in (case.q, case.k, case.v))
    if case.magnitude != 1.0:
        q, k = q * case.magnitude, k * case.magnitude
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if case.layout is not None:
        q, k, v = (case.layout(t) for t in (q, k, v))
    mask = None
    if case.mask is not None:
        mask = case.mask(g)
        if mask.is_floating_point():
            # alternate between the two float mask dtypes SDPA accepts
            if dtype != torch.float32 and seed % 2 == 0:
                mask = mask.to(dtype)
            mask.requires_grad_(case.mask_requires_grad)
    return q, k, v, mask
