"""A library of attention implementations, each with SDPA's signature.

``CORRECT``: right answers written in different ways (no alarm expected).
``BUGGY``: (expected code, function), at least two per doctor code. They play
learner code, so they may call anything, torch.softmax included.
"""

import math

import torch

from attnlab.functional import scaled_dot_product_attention as attnlab_sdpa

NEG_INF = float("-inf")


def template(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
             scale_fn=None, scores_fn=None, softmax_fn=None, mask_fn=None, causal_fn=None, values_fn=None,
             dropout_fn=None, empty_fn=None):
    """A correct from-scratch attention whose every step can be swapped for a buggy one."""
    E, L, S = q.shape[-1], q.shape[-2], k.shape[-2]
    factor = scale_fn(scale, q, k, v) if scale_fn else (1 / math.sqrt(E) if scale is None else scale)
    s = scores_fn(q, k) if scores_fn else q @ k.transpose(-2, -1)
    s = s * factor
    keep = None
    if is_causal:
        keep = causal_fn(L, S) if causal_fn else torch.ones(L, S, dtype=torch.bool).tril()
    elif attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask
    elif attn_mask is not None:
        s = s + attn_mask
    if mask_fn:
        s, post = mask_fn(s, keep)
    else:
        post = None
        if keep is not None:
            s = s.masked_fill(~keep, NEG_INF)
    if softmax_fn:
        w = softmax_fn(s)
    else:
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        e = torch.exp(s - m)
        tot = e.sum(-1, keepdim=True)
        w = e / torch.where(tot == 0, torch.ones_like(tot), tot)
    if empty_fn:
        w = empty_fn(w, s)
    if post is not None:
        w = post(w)
    if dropout_p > 0:
        if dropout_fn:
            w = dropout_fn(w, dropout_p)
        else:
            w = w * (torch.rand_like(w) >= dropout_p) / (1 - dropout_p)
    return (values_fn(w, q, k, v) if values_fn else w @ v)


def variant(**swaps):
    def fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        return template(q, k, v, attn_mask, dropout_p, is_causal, scale, **swaps)
    return fn


def _gqa(expand):
    """SDPA with ``enable_gqa``, its key/value heads expanded by ``expand(t, r)``."""
    def fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            r = q.shape[-3] // k.shape[-3]
            k, v = expand(k, r), expand(v, r)
        return template(q, k, v, attn_mask, dropout_p, is_causal, scale)
    return fn


# ------------------------------------------------------------------ correct ones
def torch_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                            is_causal=is_causal, scale=scale)


def einsum_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    s = torch.einsum("...le,...se->...ls", q, k) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, NEG_INF) if attn_mask.dtype == torch.bool else s + attn_mask
    w = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    if dropout_p > 0:
        w = torch.nn.functional.dropout(w, dropout_p)
    return torch.einsum("...ls,...sv->...lv", w, v)


def float64_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    mask = attn_mask.double() if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
    return attnlab_sdpa(q.double(), k.double(), v.double(), mask, dropout_p, is_causal, scale).to(q.dtype)


def finfo_min_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """-finfo.max instead of -inf, with fully masked rows zeroed: harmless."""
    def mask_fn(s, keep):
        if keep is None:
            return s, None
        return s.masked_fill(~keep, -torch.finfo(s.dtype).max), (lambda w: w * keep.any(-1, keepdim=True))
    return template(q, k, v, attn_mask, dropout_p, is_causal, scale, mask_fn=mask_fn)


CORRECT = {
    "attnlab": attnlab_sdpa,
    "torch_sdpa": torch_sdpa,
    "einsum": einsum_attention,
    "float64": float64_attention,
    "finfo_min": finfo_min_attention,
    "template": variant(),
    "gqa_interleave": _gqa(lambda t, r: t.repeat_interleave(r, dim=1)),
    "gqa_expand_reshape": _gqa(lambda t, r: t[:, :, None].expand(-1, -1, r, -1, -1).reshape(
        t.shape[0], t.shape[1] * r, *t.shape[2:])),
}


# ------------------------------------------------------------------ buggy ones
def _naive_softmax(s):
    e = torch.exp(s)
    return e / e.sum(-1, keepdim=True)


def _mean_shift_softmax(s):
    e = torch.exp(s - s.mean(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def _k_dot_T(q, k):
    return q @ k.T  # reverses all dims of a 4-D tensor


def _only_3d(q, k):
    return q @ k.transpose(1, 2)


def _hard_square(q, k):
    return (q @ k.transpose(-2, -1)).reshape(*q.shape[:-2], q.shape[-2], q.shape[-2])


def _torch_softmax(s):
    return torch.softmax(s, -1)


BUGGY = [
    ("missing_scale", "no_scale", variant(scale_fn=lambda scale, q, k, v: 1.0)),
    ("missing_scale", "scale_arg_only", variant(scale_fn=lambda scale, q, k, v: 1.0 if scale is None else scale)),
    ("wrong_scale", "divide_by_E", variant(scale_fn=lambda scale, q, k, v: 1 / q.shape[-1])),
    ("wrong_scale", "sqrt_Ev", variant(scale_fn=lambda scale, q, k, v: 1 / math.sqrt(v.shape[-1]))),
    ("wrong_scale", "ignores_scale_arg", variant(scale_fn=lambda scale, q, k, v: 1 / math.sqrt(q.shape[-1]))),
    ("unstable_softmax", "naive_exp", variant(softmax_fn=_naive_softmax)),
    ("unstable_softmax", "mean_shift", variant(softmax_fn=_mean_shift_softmax)),
    ("softmax_dim", "dim_minus_2", variant(softmax_fn=lambda s: torch.softmax(s, -2))),
    ("softmax_dim", "transpose_softmax", variant(
        softmax_fn=lambda s: torch.softmax(s.transpose(-2, -1), -1).transpose(-2, -1))),
    ("wrong_transpose", "q_at_k", variant(scores_fn=lambda q, k: q @ k)),
    ("wrong_transpose", "k_at_qT", variant(scores_fn=lambda q, k: k @ q.transpose(-2, -1))),
    ("wrong_transpose", "K.T", variant(scores_fn=_k_dot_T)),
    ("value_swapped", "weights_at_q", variant(values_fn=lambda w, q, k, v: w @ q)),
    ("value_swapped", "weights_at_k", variant(values_fn=lambda w, q, k, v: w @ k)),
    ("mask_polarity", "fill_where_true", variant(
        mask_fn=lambda s, keep: (s if keep is None else s.masked_fill(keep, NEG_INF), None))),
    ("mask_polarity", "where_true_inf", variant(
        mask_fn=lambda s, keep: (s if keep is None else torch.where(keep, torch.full_like(s, NEG_INF), s), None))),
    ("mask_after_softmax", "multiply_after", variant(
        mask_fn=lambda s, keep: (s, None if keep is None else (lambda w: w * keep)))),
    ("mask_after_softmax", "fill_zero_after", variant(
        mask_fn=lambda s, keep: (s, None if keep is None else (lambda w: w.masked_fill(~keep, 0.0))))),
    ("causal_alignment", "bottom_right", variant(
        causal_fn=lambda L, S: torch.ones(L, S, dtype=torch.bool).tril(S - L))),
    ("causal_alignment", "bottom_right_arange", variant(
        causal_fn=lambda L, S: torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L))),
    ("off_by_one", "no_diagonal", variant(causal_fn=lambda L, S: torch.ones(L, S, dtype=torch.bool).tril(-1))),
    ("off_by_one", "sees_next", variant(causal_fn=lambda L, S: torch.ones(L, S, dtype=torch.bool).tril(1))),
    ("causal_future", "upper", variant(causal_fn=lambda L, S: torch.ones(L, S, dtype=torch.bool).triu())),
    ("causal_future", "arange_ge", variant(causal_fn=lambda L, S: torch.arange(S)[None, :] >= torch.arange(L)[:, None])),
    ("mask_ignored", "mask_dropped", variant(mask_fn=lambda s, keep: (s, None))),
    ("mask_ignored", "causal_dropped", variant(causal_fn=lambda L, S: torch.ones(L, S, dtype=torch.bool))),
    ("mask_fill_zero", "fill_zero", variant(
        mask_fn=lambda s, keep: (s if keep is None else s.masked_fill(~keep, 0.0), None))),
    ("mask_fill_zero", "multiplied", variant(mask_fn=lambda s, keep: (s if keep is None else s * keep, None))),
    ("fully_masked_nan", "torch_softmax_nan", variant(softmax_fn=_torch_softmax)),
    ("fully_masked_nan", "no_empty_guard", variant(softmax_fn=lambda s: torch.exp(s - s.amax(-1, keepdim=True))
                                                   / torch.exp(s - s.amax(-1, keepdim=True)).sum(-1, keepdim=True))),
    ("mask_fill_finite", "minus_1e9", variant(
        mask_fn=lambda s, keep: (s if keep is None else s.masked_fill(~keep, -1e9), None))),
    ("mask_fill_finite", "finfo_min", variant(
        mask_fn=lambda s, keep: (s if keep is None else s.masked_fill(~keep, torch.finfo(s.dtype).min), None))),
    ("dropout_scale", "no_rescale", variant(dropout_fn=lambda w, p: w * (torch.rand_like(w) >= p))),
    ("dropout_scale", "dropout_ignored", variant(dropout_fn=lambda w, p: w)),
    ("shape_error", "only_3d", variant(scores_fn=_only_3d)),
    ("shape_error", "assumes_square", variant(scores_fn=_hard_square)),
    ("gqa_group_mapping", "tiled_heads", _gqa(lambda t, r: t.repeat(1, r, 1, 1))),
    ("gqa_group_mapping", "cat_heads", _gqa(lambda t, r: torch.cat([t] * r, dim=1))),
    ("unknown", "off_by_a_bit", variant(values_fn=lambda w, q, k, v: w @ v + 0.1)),
    ("unknown", "relu_weights", variant(softmax_fn=lambda s: torch.relu(s) / (torch.relu(s).sum(-1, keepdim=True) + 1))),
]


# Continuous parameters: the doctor fits them and names the number (issue: multiply by
# sqrt(d_k) was 'unknown'). Two mutants of each parameter besides that one.
FITTED = [
    ("wrong_scale", "times_sqrt_E", variant(scale_fn=lambda scale, q, k, v: math.sqrt(q.shape[-1])),
     "you multiplied by sqrt(d_k)"),
    ("wrong_scale", "hardcoded_one_eighth", variant(scale_fn=lambda scale, q, k, v: 0.125), "constant 0.125"),
    ("wrong_scale", "fourth_root", variant(scale_fn=lambda scale, q, k, v: q.shape[-1] ** -0.25), "d_k^-0.25"),
    # the right scale (an explicit one honoured) multiplied by sqrt(d_k) or by d_k
    ("wrong_scale", "scale_times_sqrt_E", variant(
        scale_fn=lambda scale, q, k, v: (scale or q.shape[-1] ** -0.5) * math.sqrt(q.shape[-1])),
     "multiplied it by sqrt(d_k) where 1/sqrt(d_k) is already the scale"),
    ("wrong_scale", "scale_times_E", variant(scale_fn=lambda scale, q, k, v: (scale or q.shape[-1] ** -0.5) * q.shape[-1]),
     "is multiplied by d_k^1"),
    # so large that every core probe's softmax saturates (one-hot rows): only the small-score probes pin it
    ("wrong_scale", "cube_of_E", variant(scale_fn=lambda scale, q, k, v: float(q.shape[-1]) ** 3), "d_k^3 instead"),
    ("off_by_one", "tril_plus_two", variant(causal_fn=lambda L, S: torch.ones(L, S, dtype=torch.bool).tril(2)),
     "off by +2"),
    ("off_by_one", "tril_minus_two", variant(
        causal_fn=lambda L, S: torch.ones(L, S, dtype=torch.bool).tril(-2)), "off by -2"),
]
