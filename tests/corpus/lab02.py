"""Lab 02's mistakes, on the instructor's solution (``a``: tril with offsets, masked_fill)
and on an independent one (``b``: index comparisons, torch.where, einsum).
Solution ``c`` (issue 48, independent): a float bias, triu complements, clamped max and sum."""

from corpus import M

LAB = "02-masks"
SOLUTIONS = {"a": "labs/track1/02-masks/solutions/masks.py", "b": "tests/corpus/lab02_b.py"}

A1 = "    return torch.ones(L, S, dtype=torch.bool).tril()\n"
A2 = "return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)"
A3 = "return (torch.arange(S) < lengths[:, None])[:, None, None, :]"
A5_FILL = 's = scores.masked_fill(~mask, float("-inf"))'
A5_GUARD = "    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # an empty row: no -inf - -inf\n"
A5_DIV = "return e / torch.where(total == 0, torch.ones_like(total), total)"
A7 = "scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])"
B_NEG = 'neg = torch.full_like(scores, float("-inf"))'
B_TOP = "top = torch.where(any_visible, s.max(dim=-1, keepdim=True).values, torch.zeros_like(scores[..., :1]))"
B7 = 'scores = torch.einsum("bhle,bhse->bhls", Q, K) / math.sqrt(E)'

MUTANTS = [
    # ------------------------------------------------------------------ a
    M("a", "causal_triu", A1, "    return torch.ones(L, S, dtype=torch.bool).triu()\n", "ex1", "causal_future"),
    M("a", "causal_hides_diagonal", A1, "    return torch.ones(L, S, dtype=torch.bool).tril(-1)\n", "ex1",
      "off_by_one"),
    M("a", "causal_sees_next", A1, "    return torch.ones(L, S, dtype=torch.bool).tril(1)\n", "ex1", "off_by_one"),
    M("a", "causal_inverted", A1, "    return ~torch.ones(L, S, dtype=torch.bool).tril()\n", "ex1", "mask_polarity"),
    M("a", "causal_bottom_right", A1, "    return torch.ones(L, S, dtype=torch.bool).tril(S - L)\n", "ex1",
      "causal_alignment"),
    M("a", "causal_float", A1, "    return torch.ones(L, S).tril()\n", "ex1", "mask_dtype"),
    M("a", "decoding_top_left", A2, "return torch.ones(L, S, dtype=torch.bool).tril()", "ex2", "causal_alignment"),
    M("a", "decoding_L_minus_S", A2, "return torch.ones(L, S, dtype=torch.bool).tril(diagonal=L - S)", "ex2",
      "causal_alignment"),
    M("a", "decoding_off_by_one", A2, "return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L - 1)", "ex2",
      "off_by_one"),
    M("a", "decoding_inverted", A2, "return ~torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)", "ex2",
      "mask_polarity"),
    M("a", "decoding_triu", A2, "return torch.ones(L, S, dtype=torch.bool).triu(diagonal=S - L)", "ex2",
      "causal_future"),
    M("a", "padding_le", A3, "return (torch.arange(S) <= lengths[:, None])[:, None, None, :]", "ex3", "off_by_one"),
    M("a", "padding_inverted", A3, "return (torch.arange(S) >= lengths[:, None])[:, None, None, :]", "ex3",
      "mask_polarity"),
    M("a", "padding_query_side", A3, "return (torch.arange(S) < lengths[:, None])[:, None, :, None]", "ex3",
      "padding_query_side"),
    M("a", "combine_or", "return a & b", "return a | b", "ex4", "mask_combined_or"),
    M("a", "softmax_then_mask", A5_FILL, "s = scores", "ex5", "mask_after_softmax",
      ("return e / torch.where(total == 0, torch.ones_like(total), total)",
       "return e / torch.where(total == 0, torch.ones_like(total), total) * mask")),
    M("a", "fill_zero", A5_FILL, "s = scores.masked_fill(~mask, 0.0)", "ex5", "mask_fill_zero"),
    M("a", "fill_where_true", A5_FILL, 's = scores.masked_fill(mask, float("-inf"))', "ex5", "mask_polarity"),
    M("a", "fill_minus_1e9", A5_FILL, "s = scores.masked_fill(~mask, -1e9)", "ex5", "mask_fill_finite"),
    M("a", "no_empty_guard", A5_GUARD, "", "ex5", "fully_masked_nan", (A5_DIV, "return e / total")),
    M("a", "no_max_shift", "e = torch.exp(s - m)", "e = torch.exp(s)", "ex5", "unstable_softmax"),
    M("a", "sum_without_keepdim", "total = e.sum(dim=-1, keepdim=True)", "total = e.sum(dim=-1)", "ex5", "keepdim"),
    M("a", "max_without_keepdim", "m = s.amax(dim=-1, keepdim=True)", "m = s.amax(dim=-1)", "ex5", "keepdim"),
    M("a", "kpm_not_inverted", "return (~key_padding_mask)[:, None, None, :]",
      "return key_padding_mask[:, None, None, :]", "ex6", "mask_polarity"),
    M("a", "kpm_query_side", "return (~key_padding_mask)[:, None, None, :]",
      "return (~key_padding_mask)[:, None, :, None]", "ex6", "padding_query_side"),
    M("a", "attention_no_scale", A7, "scores = Q @ K.transpose(-2, -1)", "ex7", "missing_scale"),
    M("a", "attention_sqrt_Ev", A7, "scores = Q @ K.transpose(-2, -1) / math.sqrt(V.shape[-1])", "ex7",
      "wrong_scale"),
    M("a", "attention_times_sqrt_E", A7, "scores = Q @ K.transpose(-2, -1) * math.sqrt(Q.shape[-1])", "ex7",
      "wrong_scale"),
    M("a", "attention_mask_inverted", "return masked_softmax(scores, mask.expand_as(scores)) @ V",
      "return masked_softmax(scores, ~mask.expand_as(scores)) @ V", "ex7", "mask_polarity"),
    M("a", "attention_mask_ignored", "return masked_softmax(scores, mask.expand_as(scores)) @ V",
      "return masked_softmax(scores, torch.ones_like(scores, dtype=torch.bool)) @ V", "ex7", "mask_ignored"),
    # ------------------------------------------------------------------ b
    M("b", "causal_strict", "    return k <= q\n\n\ndef decoding_mask", "    return k < q\n\n\ndef decoding_mask", "ex1",
      "off_by_one"),
    M("b", "causal_future", "    return k <= q\n\n\ndef decoding_mask", "    return k >= q\n\n\ndef decoding_mask", "ex1",
      "causal_future"),
    M("b", "causal_inverted", "    return k <= q\n\n\ndef decoding_mask", "    return k > q\n\n\ndef decoding_mask", "ex1",
      "mask_polarity"),
    M("b", "decoding_L_minus_S", "offset = S - L", "offset = L - S", "ex2", "causal_alignment"),
    M("b", "decoding_no_offset", "offset = S - L", "offset = 0", "ex2", "causal_alignment"),
    M("b", "decoding_off_by_one", "offset = S - L", "offset = S - L + 1", "ex2", "off_by_one"),
    M("b", "padding_le", "real = torch.arange(S).unsqueeze(0) < lengths", "real = torch.arange(S).unsqueeze(0) <= lengths",
      "ex3", "off_by_one"),
    M("b", "padding_inverted", "real = torch.arange(S).unsqueeze(0) < lengths",
      "real = torch.arange(S).unsqueeze(0) >= lengths", "ex3", "mask_polarity"),
    M("b", "padding_query_side", "return real.view(-1, 1, 1, S)", "return real.view(-1, 1, S, 1)", "ex3",
      "padding_query_side"),
    M("b", "combine_or", "return torch.logical_and(a, b)", "return torch.logical_or(a, b)", "ex4", "mask_combined_or"),
    M("b", "combine_added", "return torch.logical_and(a, b)", "return a + b", "ex4", "mask_combined_or"),
    M("b", "fill_zero", B_NEG, "neg = torch.zeros_like(scores)", "ex5", "mask_fill_zero"),
    M("b", "where_swapped", "s = torch.where(mask, scores, neg)", "s = torch.where(mask, neg, scores)", "ex5",
      "mask_polarity"),
    # (-1e9 instead of -inf is harmless here: b finds empty rows from the mask, and exp(-1e9 - max) is 0.0)
    M("b", "no_empty_guard", B_TOP, "top = s.max(dim=-1, keepdim=True).values", "ex5", "fully_masked_nan",
      ("return torch.where(any_visible, e / torch.where(any_visible, z, torch.ones_like(z)), torch.zeros_like(e))",
       "return e / z")),
    M("b", "sum_without_keepdim", "z = e.sum(dim=-1, keepdim=True)", "z = e.sum(dim=-1)", "ex5", "keepdim"),
    M("b", "max_without_keepdim", B_TOP,
      "top = torch.where(any_visible, s.max(dim=-1).values, torch.zeros_like(scores[..., :1]))", "ex5", "keepdim"),
    M("b", "no_shift", "e = torch.exp(s - top)", "e = torch.exp(s)", "ex5", "unstable_softmax"),
    M("b", "mask_after_softmax", "s = torch.where(mask, scores, neg)", "s = scores", "ex5", "mask_after_softmax",
      ("return torch.where(any_visible, e / torch.where(any_visible, z, torch.ones_like(z)), torch.zeros_like(e))",
       "return torch.where(mask, e / z, torch.zeros_like(e))")),
    M("b", "kpm_not_inverted", "keep = torch.logical_not(key_padding_mask)", "keep = key_padding_mask", "ex6",
      "mask_polarity"),
    M("b", "kpm_query_side", "return keep.unsqueeze(1).unsqueeze(2)", "return keep.unsqueeze(1).unsqueeze(-1)", "ex6",
      "padding_query_side"),
    M("b", "attention_no_scale", B7, 'scores = torch.einsum("bhle,bhse->bhls", Q, K)', "ex7", "missing_scale"),
    M("b", "attention_sqrt_Ev", "E = Q.shape[-1]", "E = V.shape[-1]", "ex7", "wrong_scale"),
    M("b", "attention_divide_by_E", B7, 'scores = torch.einsum("bhle,bhse->bhls", Q, K) / E', "ex7", "wrong_scale"),
    M("b", "attention_mask_inverted", "weights = masked_softmax(scores, mask.expand(scores.shape))",
      "weights = masked_softmax(scores, ~mask.expand(scores.shape))", "ex7", "mask_polarity"),
    M("b", "attention_mask_ignored", "    if mask is None:\n        mask", "    if True:\n        mask", "ex7",
      "mask_ignored"),
]

# ------------------------------------------------------------------ c: a third, independent solution
# written from the brief alone by a separate author: causal masks as the complement of a strict
# upper triangle (~ones.triu(d)), padding by lengths viewed [B, 1, 1, 1] against an arange,
# logical_and / logical_not, and a masked softmax that adds a float bias (0 or -inf) to the
# scores and clamps an empty row's max and sum; matmul with K.mT on a pre-scaled Q.
SOLUTIONS["c"] = "tests/corpus/lab02_c.py"
C1 = "future = torch.ones(L, S, dtype=torch.bool).triu(diagonal=1)"
C2 = "ahead = torch.ones(L, S, dtype=torch.bool).triu(diagonal=shift + 1)"
C3 = "return lengths.view(-1, 1, 1, 1) > key_pos"
C5_FILL = "bias = bias.masked_fill(mask.logical_not(), -math.inf)"
C5_MAX = "row_max = biased.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)"
C5_DIV = "return e / z.clamp(min=torch.finfo(scores.dtype).tiny)"
C6 = "return attend.unsqueeze(1).unsqueeze(2)"
C7 = "scores = torch.matmul(Q * scale, K.mT)"

MUTANTS += [
    # ex1: the complement of the strict upper triangle
    M("c", "causal_triu_no_offset", C1, "future = torch.ones(L, S, dtype=torch.bool).triu()", "ex1", "off_by_one"),
    M("c", "causal_not_complemented", "    return ~future\n", "    return future\n", "ex1", "mask_polarity"),
    M("c", "causal_complement_of_tril", C1, "future = torch.ones(L, S, dtype=torch.bool).tril(diagonal=-1)", "ex1",
      "causal_future"),
    M("c", "causal_shifted_like_cache", C1, "future = torch.ones(L, S, dtype=torch.bool).triu(diagonal=S - L + 1)",
      "ex1", "causal_alignment"),
    M("c", "causal_float_complement", C1 + "\n    return ~future",
      "future = torch.ones(L, S).triu(diagonal=1)\n    return 1 - future", "ex1", "mask_dtype"),
    # ex2: the same, shifted by S - L
    M("c", "decoding_no_plus_one", C2, "ahead = torch.ones(L, S, dtype=torch.bool).triu(diagonal=shift)", "ex2",
      "off_by_one"),
    M("c", "decoding_L_minus_S", "shift = S - L", "shift = L - S", "ex2", "causal_alignment"),
    M("c", "decoding_shift_forgotten", C2, "ahead = torch.ones(L, S, dtype=torch.bool).triu(diagonal=1)", "ex2",
      "causal_alignment"),
    M("c", "decoding_not_complemented", "    return ~ahead\n", "    return ahead\n", "ex2", "mask_polarity"),
    M("c", "decoding_complement_of_tril", C2,
      "ahead = torch.ones(L, S, dtype=torch.bool).tril(diagonal=shift - 1)", "ex2", "causal_future"),
    # ex3: lengths [B, 1, 1, 1] against the key positions
    M("c", "padding_ge", C3, "return lengths.view(-1, 1, 1, 1) >= key_pos", "ex3", "off_by_one"),
    M("c", "padding_inverted", C3, "return lengths.view(-1, 1, 1, 1) <= key_pos", "ex3", "mask_polarity"),
    M("c", "padding_query_side", C3, "return lengths.view(-1, 1, 1, 1) > key_pos[:, None]", "ex3",
      "padding_query_side"),
    # ex4
    M("c", "combine_or", "return torch.logical_and(a, b)", "return torch.logical_or(a, b)", "ex4", "mask_combined_or"),
    M("c", "combine_maximum", "return torch.logical_and(a, b)", "return torch.maximum(a, b)", "ex4",
      "mask_combined_or"),
    # ex5: the additive bias
    M("c", "bias_where_true", C5_FILL, "bias = bias.masked_fill(mask, -math.inf)", "ex5", "mask_polarity"),
    M("c", "bias_minus_1e9", C5_FILL, "bias = bias.masked_fill(mask.logical_not(), -1e9)", "ex5", "mask_fill_finite"),
    M("c", "bias_finfo_min", C5_FILL, "bias = bias.masked_fill(mask.logical_not(), torch.finfo(scores.dtype).min)",
      "ex5", "mask_fill_finite"),
    M("c", "bias_added_in_place", "biased = scores + bias", "biased = scores.add_(bias)", "ex5", "mutates_input"),
    M("c", "mask_after_softmax", "biased = scores + bias", "biased = scores", "ex5", "mask_after_softmax",
      (C5_DIV, "return e / z.clamp(min=torch.finfo(scores.dtype).tiny) * mask")),
    M("c", "max_not_clamped", C5_MAX, "row_max = biased.amax(dim=-1, keepdim=True)", "ex5", "fully_masked_nan"),
    M("c", "sum_not_clamped", C5_DIV, "return e / z", "ex5", "fully_masked_nan"),
    M("c", "no_max_shift", "e = torch.exp(biased - row_max)", "e = torch.exp(biased)", "ex5", "unstable_softmax"),
    M("c", "max_without_keepdim", C5_MAX,
      "row_max = biased.amax(dim=-1).clamp(min=torch.finfo(scores.dtype).min)", "ex5", "keepdim"),
    M("c", "sum_without_keepdim", "z = e.sum(dim=-1, keepdim=True)", "z = e.sum(dim=-1)", "ex5", "keepdim"),
    # ex6
    M("c", "kpm_inverted_into_itself", "attend = key_padding_mask.logical_not()",
      "attend = torch.logical_not(key_padding_mask, out=key_padding_mask)", "ex6", "mutates_input"),
    M("c", "kpm_not_inverted", "attend = key_padding_mask.logical_not()", "attend = key_padding_mask", "ex6",
      "mask_polarity"),
    M("c", "kpm_query_side", C6, "return attend.unsqueeze(1).unsqueeze(-1)", "ex6", "padding_query_side"),
    # ex7: matmul on a pre-scaled Q
    M("c", "attention_no_scale", C7, "scores = torch.matmul(Q, K.mT)", "ex7", "missing_scale"),
    M("c", "attention_sqrt_Ev", "scale = 1.0 / math.sqrt(Q.size(-1))", "scale = 1.0 / math.sqrt(V.size(-1))", "ex7",
      "wrong_scale"),
    M("c", "attention_divide_by_E", "scale = 1.0 / math.sqrt(Q.size(-1))", "scale = 1.0 / Q.size(-1)", "ex7",
      "wrong_scale"),
    M("c", "attention_times_sqrt_E", "scale = 1.0 / math.sqrt(Q.size(-1))", "scale = math.sqrt(Q.size(-1))", "ex7",
      "wrong_scale"),
    M("c", "attention_Q_scaled_in_place", C7, "scores = torch.matmul(Q.mul_(scale), K.mT)", "ex7", "mutates_input"),
    M("c", "attention_mask_inverted", "weights = masked_softmax(scores, mask)",
      "weights = masked_softmax(scores, ~mask)", "ex7", "mask_polarity"),
    M("c", "attention_default_always", "    if mask is None:\n        mask = torch.ones(", "    mask = torch.ones(",
      "ex7", "mask_ignored"),
    M("c", "attention_weights_times_K", "return torch.matmul(weights, V)", "return torch.matmul(weights, K)", "ex7",
      "value_swapped"),
]

# ------------------------------------------------------------------ d: a fourth, independent solution
# written from the brief alone by a separate author: bool masks from torch.ones + torch.tril with
# each diagonal offset in a named variable, combined with &; a masked softmax by masked_fill of
# -inf, a max shift and a sum, empty rows guarded with torch.where; attention by torch.einsum.
SOLUTIONS["d"] = "tests/corpus/lab02_d.py"
D1_OFF = "top_left_offset = 0"
D1_RET = "return torch.tril(everything, diagonal=top_left_offset)"
D2_OFF = "cache_len = S - L"
D2_RET = "return torch.tril(everything, diagonal=cache_len)"
D3_CMP = "is_real_key = key_positions[None, :] < lengths[:, None]"
D5_FILL = 'filled = scores.masked_fill(~mask, float("-inf"))'
D5_RET = "return exps / denom"
D6 = "attend = ~key_padding_mask"
D7_SCORES = 'scores = torch.einsum("...le,...se->...ls", Q, K) * scale'
D7_SCALE = "scale = 1.0 / math.sqrt(E)"
D7_SOFTMAX = "weights = masked_softmax(scores, mask)"
D7_OUT = 'return torch.einsum("...ls,...sv->...lv", weights, V)'

MUTANTS += [
    # ex1: tril of ones with a named offset
    M("d", "causal_triu", D1_RET, "return torch.triu(everything, diagonal=top_left_offset)", "ex1", "causal_future"),
    M("d", "causal_hides_diagonal", D1_OFF, "top_left_offset = -1", "ex1", "off_by_one"),
    M("d", "causal_sees_next", D1_OFF, "top_left_offset = 1", "ex1", "off_by_one"),
    M("d", "causal_offset_S_minus_L", D1_OFF, "top_left_offset = S - L", "ex1", "causal_alignment"),
    M("d", "causal_inverted", D1_RET, "return ~torch.tril(everything, diagonal=top_left_offset)", "ex1",
      "mask_polarity"),
    M("d", "causal_float_ones", "everything = torch.ones(L, S, dtype=torch.bool)\n    top_left_offset",
      "everything = torch.ones(L, S)\n    top_left_offset", "ex1", "mask_dtype"),
    # ex2: the offset S - L
    M("d", "decoding_no_offset", D2_OFF, "cache_len = 0", "ex2", "causal_alignment"),
    M("d", "decoding_L_minus_S", D2_OFF, "cache_len = L - S", "ex2", "causal_alignment"),
    M("d", "decoding_hides_diagonal", D2_OFF, "cache_len = S - L - 1", "ex2", "off_by_one"),
    M("d", "decoding_sees_next", D2_OFF, "cache_len = S - L + 1", "ex2", "off_by_one"),
    M("d", "decoding_triu", D2_RET, "return torch.triu(everything, diagonal=cache_len)", "ex2", "causal_future"),
    M("d", "decoding_float_ones", "everything = torch.ones(L, S, dtype=torch.bool)\n    cache_len",
      "everything = torch.ones(L, S)\n    cache_len", "ex2", "mask_dtype"),
    # ex3: an arange against the lengths
    M("d", "padding_le", D3_CMP, "is_real_key = key_positions[None, :] <= lengths[:, None]", "ex3", "off_by_one"),
    M("d", "padding_inverted", D3_CMP, "is_real_key = key_positions[None, :] >= lengths[:, None]", "ex3",
      "mask_polarity"),
    M("d", "padding_query_side", "return is_real_key.reshape(batch, 1, 1, S)",
      "return is_real_key.reshape(batch, 1, S, 1)", "ex3", "padding_query_side"),
    M("d", "padding_float", D3_CMP, "is_real_key = (key_positions[None, :] < lengths[:, None]).float()", "ex3",
      "mask_dtype"),
    # ex4
    M("d", "combine_or", "return a & b", "return a | b", "ex4", "mask_combined_or"),
    # ex5: masked_fill, shift, sum, torch.where guards
    M("d", "fill_zero", D5_FILL, "filled = scores.masked_fill(~mask, 0.0)", "ex5", "mask_fill_zero"),
    M("d", "fill_where_true", D5_FILL, 'filled = scores.masked_fill(mask, float("-inf"))', "ex5", "mask_polarity"),
    M("d", "fill_minus_1e9", D5_FILL, "filled = scores.masked_fill(~mask, -1e9)", "ex5", "mask_fill_finite"),
    M("d", "fill_finfo_min", D5_FILL, "filled = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)", "ex5",
      "mask_fill_finite"),
    M("d", "fill_in_place", D5_FILL, 'filled = scores.masked_fill_(~mask, float("-inf"))', "ex5", "mutates_input"),
    M("d", "shift_unguarded", "shift = torch.where(empty_row, torch.zeros_like(row_max), row_max)",
      "shift = row_max", "ex5", "fully_masked_nan"),
    M("d", "denom_unguarded", "denom = torch.where(empty_row, torch.ones_like(row_sum), row_sum)",
      "denom = row_sum", "ex5", "fully_masked_nan"),
    M("d", "no_max_shift", "exps = torch.exp(filled - shift)", "exps = torch.exp(filled)", "ex5", "unstable_softmax"),
    M("d", "max_without_keepdim", "row_max = filled.amax(dim=-1, keepdim=True)", "row_max = filled.amax(dim=-1)",
      "ex5", "keepdim"),
    M("d", "sum_without_keepdim", "row_sum = exps.sum(dim=-1, keepdim=True)", "row_sum = exps.sum(dim=-1)", "ex5",
      "keepdim"),
    M("d", "mask_after_softmax", D5_FILL, "filled = scores", "ex5", "mask_after_softmax",
      (D5_RET, "return (exps / denom).masked_fill(~mask, 0.0)")),
    # ex6
    M("d", "kpm_not_inverted", D6, "attend = key_padding_mask", "ex6", "mask_polarity"),
    M("d", "kpm_query_side", "return attend.reshape(batch, 1, 1, S)", "return attend.reshape(batch, 1, S, 1)", "ex6",
      "padding_query_side"),
    # ex7: two einsums
    M("d", "attention_no_scale", D7_SCORES, 'scores = torch.einsum("...le,...se->...ls", Q, K)', "ex7",
      "missing_scale"),
    M("d", "attention_sqrt_Ev", "E = Q.shape[-1]", "E = V.shape[-1]", "ex7", "wrong_scale"),
    M("d", "attention_divide_by_E", D7_SCALE, "scale = 1.0 / E", "ex7", "wrong_scale"),
    M("d", "attention_times_sqrt_E", D7_SCALE, "scale = math.sqrt(E)", "ex7", "wrong_scale"),
    M("d", "attention_einsum_K_transposed", D7_SCORES, 'scores = torch.einsum("...le,...es->...ls", Q, K) * scale',
      "ex7", "wrong_transpose"),
    M("d", "attention_weights_times_K", D7_OUT, 'return torch.einsum("...ls,...sv->...lv", weights, K)', "ex7",
      "value_swapped"),
    M("d", "attention_mask_inverted", D7_SOFTMAX, "weights = masked_softmax(scores, ~mask)", "ex7", "mask_polarity"),
    M("d", "attention_default_always", "    if mask is None:\n        mask = torch.ones(", "    mask = torch.ones(",
      "ex7", "mask_ignored"),
]

# issue 48: the "c" mistakes the grader did not name when its author wrote them, named since
MUTANTS += [
    M("c", "padding_positions_from_one", "key_pos = torch.arange(S, device=lengths.device)",
      "key_pos = torch.arange(1, S + 1, device=lengths.device)", "ex3", "off_by_one"),
    M("c", "bias_fill_zero", "bias.masked_fill(mask.logical_not(), -math.inf)",
      "bias.masked_fill(mask.logical_not(), 0.0)", "ex5", "mask_ignored"),
    M("c", "scores_multiplied_by_mask", "biased = scores + bias", "biased = scores * mask", "ex5", "mask_fill_zero"),
    M("c", "max_of_unmasked_scores", "row_max = biased.amax(dim=-1, keepdim=True)",
      "row_max = scores.amax(dim=-1, keepdim=True)", "ex5", "unstable_softmax"),
    M("c", "sum_over_queries", "z = e.sum(dim=-1, keepdim=True)", "z = e.sum(dim=-2, keepdim=True)", "ex5",
      "softmax_dim"),
]

# issue 48: the "d" mistakes the grader did not name when its author wrote them, named since
MUTANTS += [
    M("d", "sum_over_queries", "row_sum = exps.sum(dim=-1, keepdim=True)", "row_sum = exps.sum(dim=-2, keepdim=True)",
      "ex5", "softmax_dim"),
    M("d", "combine_in_place", "    return a & b", "    a &= b\n    return a", "ex4", "mutates_input"),
]
MUTANTS += [
    M("c", "kpm_inverted_in_place", "key_padding_mask.logical_not()", "key_padding_mask.logical_not_()", "ex6",
      "mutates_input"),
]
