"""Lab 01's mistakes, on the instructor's solution (``a``, matmul and masked_fill) and on an
independent one (``b``, einsum, index comparisons and torch.where).
Solution ``c`` (issue 48, independent): broadcast products summed, loop-built masks, boolean-index fill."""

from corpus import M

LAB = "01-attention"
SOLUTIONS = {"a": "labs/track1/01-attention/solutions/attention.py", "b": "tests/corpus/lab01_b.py"}

A_SCORES = "return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])"
A_SUM = "total = e.sum(dim=dim, keepdim=True)"
A_GUARD = "    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)\n"
A_CAUSAL = "return torch.ones(T, T, dtype=torch.bool).tril()"
A_PAD = "return (torch.arange(T) < lengths[:, None])[:, None, :]"
A_FILL = "return scores.masked_fill(~mask, NEG_INF)"
A_SOFTMAX8 = "    weights = stable_softmax(scores, dim=-1)\n    return attend(weights, V), weights"
B_SCORES = 'return torch.einsum("bik,bjk->bij", Q, K) * d_k ** -0.5'
B_TOP = "top = scores.max(dim=dim, keepdim=True).values"
B_CAUSAL = "return i[:, None] >= i[None, :]"
B_PAD = "return (positions < lengths.unsqueeze(1)).unsqueeze(1)  # [B, 1, T]"
B_WHERE = 'return torch.where(mask, scores, torch.full_like(scores, float("-inf")))'
B_LAYER = "    weights = stable_softmax(scores, dim=-1)\n    return attend(weights, V), weights"

MUTANTS = [
    # ------------------------------------------------------------------ a: the instructor's solution
    M("a", "qkv_order", "return X @ W_Q, X @ W_K, X @ W_V", "return X @ W_K, X @ W_Q, X @ W_V", "ex1", "order"),
    M("a", "kv_swapped", "return X @ W_Q, X @ W_K, X @ W_V", "return X @ W_Q, X @ W_V, X @ W_K", "ex1", "order"),
    M("a", "no_scale", A_SCORES, "return Q @ K.transpose(-2, -1)", "ex2", "missing_scale"),
    M("a", "divide_by_d_k", A_SCORES, "return Q @ K.transpose(-2, -1) / Q.shape[-1]", "ex2", "wrong_scale"),
    M("a", "times_sqrt_d_k", A_SCORES, "return Q @ K.transpose(-2, -1) * math.sqrt(Q.shape[-1])", "ex2",
      "wrong_scale"),
    M("a", "sqrt_of_S", A_SCORES, "return Q @ K.transpose(-2, -1) / math.sqrt(K.shape[1])", "ex2", "wrong_scale"),
    M("a", "K_dot_T", A_SCORES, "return Q @ K.T / math.sqrt(Q.shape[-1])", "ex2", "wrong_transpose"),
    M("a", "transpose_0_1", A_SCORES, "return Q @ K.transpose(0, 1) / math.sqrt(Q.shape[-1])", "ex2",
      "wrong_transpose"),
    M("a", "K_Q_transposed", A_SCORES, "return K @ Q.transpose(-2, -1) / math.sqrt(Q.shape[-1])", "ex2",
      "wrong_transpose"),
    M("a", "no_max_shift", "e = torch.exp(scores - m)", "e = torch.exp(scores)", "ex3", "unstable_softmax"),
    M("a", "sum_without_keepdim", A_SUM, "total = e.sum(dim=dim)", "ex3", "keepdim"),
    M("a", "max_without_keepdim", "m = scores.amax(dim=dim, keepdim=True)", "m = scores.amax(dim=dim)", "ex3",
      "keepdim"),
    M("a", "global_max", "m = scores.amax(dim=dim, keepdim=True)", "m = scores.amax()", "ex3", "unstable_softmax"),
    M("a", "dim_ignored", "m = scores.amax(dim=dim, keepdim=True)", "m = scores.amax(dim=-1, keepdim=True)", "ex3",
      "softmax_dim", (A_SUM, "total = e.sum(dim=-1, keepdim=True)")),
    M("a", "no_empty_guard", A_GUARD, "", "ex3", "fully_masked_nan",
      ("return e / torch.where(total == 0, torch.ones_like(total), total)", "return e / total")),
    M("a", "causal_triu", A_CAUSAL, "return torch.ones(T, T, dtype=torch.bool).triu()", "ex5", "causal_future"),
    M("a", "causal_hides_diagonal", A_CAUSAL, "return torch.ones(T, T, dtype=torch.bool).tril(-1)", "ex5",
      "off_by_one"),
    M("a", "causal_sees_next", A_CAUSAL, "return torch.ones(T, T, dtype=torch.bool).tril(1)", "ex5", "off_by_one"),
    M("a", "causal_inverted", A_CAUSAL, "return ~torch.ones(T, T, dtype=torch.bool).tril()", "ex5", "mask_polarity"),
    M("a", "causal_float", A_CAUSAL, "return torch.ones(T, T).tril()", "ex5", "mask_dtype"),
    M("a", "padding_le", A_PAD, "return (torch.arange(T) <= lengths[:, None])[:, None, :]", "ex6", "off_by_one"),
    M("a", "padding_inverted", A_PAD, "return (torch.arange(T) >= lengths[:, None])[:, None, :]", "ex6",
      "mask_polarity"),
    M("a", "padding_query_side", A_PAD, "return (torch.arange(T) < lengths[:, None])[:, :, None]", "ex6",
      "padding_query_side"),
    M("a", "fill_where_true", A_FILL, "return scores.masked_fill(mask, NEG_INF)", "ex7", "mask_polarity"),
    M("a", "fill_zero", A_FILL, "return scores.masked_fill(~mask, 0.0)", "ex7", "mask_fill_zero"),
    M("a", "fill_minus_1e9", A_FILL, "return scores.masked_fill(~mask, -1e9)", "ex7", "mask_fill_finite"),
    M("a", "mask_multiplied", A_FILL, "return scores * mask", "ex7", "mask_multiplied"),
    M("a", "layer_softmax_over_queries", A_SOFTMAX8,
      "    weights = stable_softmax(scores, dim=-2)\n    return attend(weights, V), weights", "ex8", "softmax_dim"),
    M("a", "layer_attends_K", A_SOFTMAX8, "    weights = stable_softmax(scores, dim=-1)\n    return attend(weights, K), weights",
      "ex8", "value_swapped"),
    M("a", "layer_mask_ignored", "    if mask is not None:\n        scores = apply_mask(scores, mask)\n", "", "ex8",
      "mask_ignored"),
    M("a", "layer_mask_after_softmax", "    if mask is not None:\n        scores = apply_mask(scores, mask)\n    weights = stable_softmax(scores, dim=-1)\n",
      "    weights = stable_softmax(scores, dim=-1)\n    if mask is not None:\n        weights = weights * mask\n",
      "ex8", "mask_after_softmax"),
    M("a", "layer_scaled_twice", "    scores = attention_scores(Q, K)\n",
      "    scores = attention_scores(Q, K) / math.sqrt(Q.shape[-1])\n", "ex8", "wrong_scale"),
    M("a", "first_column", "return weights[:, 0, :]", "return weights[:, :, 0]", "ex12", "wrong_axis"),
    M("a", "first_batch_only", "return weights[:, 0, :]", "return weights[0]", "ex12", "batch_only"),
    M("a", "ex2_divides_by_d_k", '"scaled": stable_softmax(unscaled / math.sqrt(d_k)),',
      '"scaled": stable_softmax(unscaled / d_k),', "ex11", "wrong_scale"),
    # ------------------------------------------------------------------ b: einsum and torch.where
    M("b", "qk_swapped", "Q = torch.einsum(\"btd,dk->btk\", X, W_Q)", "Q = torch.einsum(\"btd,dk->btk\", X, W_K)",
      "ex1", "order", ("K = torch.einsum(\"btd,dk->btk\", X, W_K)", "K = torch.einsum(\"btd,dk->btk\", X, W_Q)")),
    M("b", "no_scale", B_SCORES, 'return torch.einsum("bik,bjk->bij", Q, K)', "ex2", "missing_scale"),
    M("b", "times_sqrt_d_k", B_SCORES, 'return torch.einsum("bik,bjk->bij", Q, K) * d_k ** 0.5', "ex2",
      "wrong_scale"),
    M("b", "divide_by_d_k", B_SCORES, 'return torch.einsum("bik,bjk->bij", Q, K) / d_k', "ex2", "wrong_scale"),
    M("b", "size_of_T", "d_k = Q.size(-1)", "d_k = Q.size(1)", "ex2", "wrong_scale"),
    M("b", "scores_transposed", B_SCORES, 'return torch.einsum("bik,bjk->bji", Q, K) * d_k ** -0.5', "ex2",
      "wrong_transpose"),
    M("b", "max_without_keepdim", B_TOP, "top = scores.max(dim=dim).values", "ex3", "keepdim"),
    M("b", "sum_without_keepdim", "denom = exps.sum(dim=dim, keepdim=True)", "denom = exps.sum(dim=dim)", "ex3",
      "keepdim"),
    M("b", "no_shift", "exps = (scores - top).exp()", "exps = scores.exp()", "ex3", "unstable_softmax"),
    M("b", "no_empty_guard", '    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)\n', "", "ex3",
      "fully_masked_nan", ("return exps / denom.clamp(min=torch.finfo(denom.dtype).tiny)", "return exps / denom")),
    M("b", "sum_over_everything", "denom = exps.sum(dim=dim, keepdim=True)", "denom = exps.sum()", "ex3",
      "softmax_dim"),
    M("b", "causal_strict", B_CAUSAL, "return i[:, None] > i[None, :]", "ex5", "off_by_one"),
    M("b", "causal_upper", B_CAUSAL, "return i[:, None] <= i[None, :]", "ex5", "causal_future"),
    M("b", "padding_le", "return (positions < lengths", "return (positions <= lengths", "ex6", "off_by_one"),
    M("b", "padding_inverted", "return (positions < lengths", "return (positions >= lengths", "ex6", "mask_polarity"),
    M("b", "padding_query_side", B_PAD, "return (positions < lengths.unsqueeze(1)).unsqueeze(2)", "ex6",
      "padding_query_side"),
    M("b", "where_swapped", B_WHERE, 'return torch.where(mask, torch.full_like(scores, float("-inf")), scores)',
      "ex7", "mask_polarity"),
    # issue 48: an in-place op on the caller's tensor (full marks before: the values are right)
    M("a", "masked_fill_in_place", A_FILL, "return scores.masked_fill_(~mask, NEG_INF)", "ex7", "mutates_input"),
    M("b", "shift_in_place", "exps = (scores - top).exp()", "scores -= top\n    exps = scores.exp()", "ex3",
      "mutates_input"),
    M("a", "sdpa_without_mask", "ref = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask)",
      "ref = torch.nn.functional.scaled_dot_product_attention(Q, K, V)", "ex9", "mask_ignored"),
    M("b", "sdpa_without_mask", "theirs = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask)",
      "theirs = torch.nn.functional.scaled_dot_product_attention(Q, K, V)", "ex9", "mask_ignored"),
    M("b", "where_zero", B_WHERE, "return torch.where(mask, scores, torch.zeros_like(scores))", "ex7",
      "mask_fill_zero"),
    M("b", "where_finfo_min", B_WHERE,
      "return torch.where(mask, scores, torch.full_like(scores, torch.finfo(scores.dtype).min))", "ex7",
      "mask_fill_finite"),
    M("b", "layer_softmax_dim_1", B_LAYER, "    weights = stable_softmax(scores, dim=1)\n    return attend(weights, V), weights",
      "ex8", "softmax_dim"),
    M("b", "layer_attends_Q", B_LAYER, "    weights = stable_softmax(scores, dim=-1)\n    return attend(weights, Q), weights",
      "ex8", "value_swapped"),
    M("b", "layer_mask_dropped", "        scores = apply_mask(scores, mask)\n", "        apply_mask(scores, mask)\n",
      "ex8", "mask_ignored"),
    M("b", "layer_zeroes_weights", B_LAYER,
      "    weights = stable_softmax(scores, dim=-1)\n    if mask is not None:\n"
      "        weights = torch.where(mask, weights, torch.zeros_like(weights))\n    return attend(weights, V), weights",
      "ex8", "mask_after_softmax", ("        scores = apply_mask(scores, mask)\n", "        pass\n")),
    M("b", "layer_returns_swapped", B_LAYER, "    weights = stable_softmax(scores, dim=-1)\n    return weights, attend(weights, V)",
      "ex8", "order"),
    M("b", "first_column", "return weights[:, 0]", "return weights[:, :, 0]", "ex12", "wrong_axis"),
    M("b", "first_batch_only", "return weights[:, 0]", "return weights[0]", "ex12", "batch_only"),
    M("b", "ex2_unscaled", '"scaled": stable_softmax(unscaled / math.sqrt(d_k))}', '"scaled": stable_softmax(unscaled)}',
      "ex11", "missing_scale"),
]

# ---------------------------------------------------------------------- c: broadcasting, loops, clone
SOLUTIONS["c"] = "tests/corpus/lab01_c.py"

C_SCALE = "return dots / math.sqrt(d_k)"
C_PEAK = "peak = scores.amax(dim=dim, keepdim=True)"
C_EXP = "expd = torch.exp(scores - peak)"
C_DENOM = "denom = expd.sum(dim=dim, keepdim=True)"
C_CAUSAL_ROW = "mask[i, : i + 1] = True"
C_PAD_ZEROS = "mask = torch.zeros(len(lengths), 1, T, dtype=torch.bool)"
C_PAD_ROW = "mask[b, 0, :n] = True"
C_FILL = 'masked[hidden] = float("-inf")'
C_ROW0 = "return probs.select(dim=1, index=0)"

MUTANTS += [
    M("c", "qk_swapped", "    Q = _project(X, W_Q)\n", "    Q = _project(X, W_K)\n", "ex1", "order",
      ("    K = _project(X, W_K)\n", "    K = _project(X, W_Q)\n")),
    M("c", "returns_q_v_k", "return Q, K, V", "return Q, V, K", "ex1", "order"),
    M("c", "no_scale", C_SCALE, "return dots", "ex2", "missing_scale"),
    M("c", "divide_by_d_k", C_SCALE, "return dots / d_k", "ex2", "wrong_scale"),
    M("c", "size_of_T", "d_k = Q.size(-1)", "d_k = Q.size(-2)", "ex2", "wrong_scale"),
    M("c", "unsqueeze_swapped", "dots = (Q.unsqueeze(-2) * K.unsqueeze(-3)).sum(dim=-1)",
      "dots = (Q.unsqueeze(-3) * K.unsqueeze(-2)).sum(dim=-1)", "ex2", "wrong_transpose"),
    M("c", "no_max_shift", C_EXP, "expd = torch.exp(scores)", "ex3", "unstable_softmax"),
    M("c", "max_without_keepdim", C_PEAK, "peak = scores.amax(dim=dim)", "ex3", "keepdim"),
    M("c", "sum_without_keepdim", C_DENOM, "denom = expd.sum(dim=dim)", "ex3", "keepdim"),
    M("c", "no_peak_guard", "    peak = peak.masked_fill(torch.isinf(peak), 0.0)\n", "", "ex3", "fully_masked_nan"),
    M("c", "no_denom_guard", "    denom = denom.masked_fill(denom == 0, 1.0)\n", "", "ex3", "fully_masked_nan"),
    M("c", "scalar_max", C_PEAK, "peak = scores.max()", "ex3", "unstable_softmax"),
    M("c", "dim_hardcoded", C_PEAK, "peak = scores.amax(dim=-1, keepdim=True)", "ex3", "softmax_dim",
      (C_DENOM, "denom = expd.sum(dim=-1, keepdim=True)")),
    M("c", "sub_in_place", C_EXP, "expd = scores.sub_(peak).exp()", "ex3", "mutates_input"),
    M("c", "causal_strict", C_CAUSAL_ROW, "mask[i, :i] = True", "ex5", "off_by_one"),
    M("c", "causal_rows_from_i", C_CAUSAL_ROW, "mask[i, i:] = True", "ex5", "causal_future"),
    M("c", "causal_marks_hidden", C_CAUSAL_ROW, "mask[i, i + 1 :] = True", "ex5", "mask_polarity"),
    M("c", "causal_float", "mask = torch.zeros(T, T, dtype=torch.bool)", "mask = torch.zeros(T, T)", "ex5",
      "mask_dtype"),
    M("c", "padding_le", C_PAD_ROW, "mask[b, 0, : n + 1] = True", "ex6", "off_by_one"),
    M("c", "padding_inverted", C_PAD_ROW, "mask[b, 0, n:] = True", "ex6", "mask_polarity"),
    M("c", "padding_query_side", C_PAD_ZEROS, "mask = torch.zeros(len(lengths), T, 1, dtype=torch.bool)", "ex6",
      "padding_query_side", (C_PAD_ROW, "mask[b, :n, 0] = True")),
    M("c", "padding_float", C_PAD_ZEROS, "mask = torch.zeros(len(lengths), 1, T)", "ex6", "mask_dtype"),
    M("c", "fill_where_true", "hidden = ~mask.expand_as(masked)", "hidden = mask.expand_as(masked)", "ex7",
      "mask_polarity"),
    M("c", "fill_zero", C_FILL, "masked[hidden] = 0.0", "ex7", "mask_fill_zero"),
    M("c", "fill_minus_1e4", C_FILL, "masked[hidden] = -10000.0", "ex7", "mask_fill_finite"),
    M("c", "no_clone", "masked = scores.clone()", "masked = scores", "ex7", "mutates_input"),
    M("c", "layer_softmax_dim_2", "probs = stable_softmax(logits, dim=-1)", "probs = stable_softmax(logits, dim=-2)",
      "ex8", "softmax_dim"),
    M("c", "layer_attends_K", "out = attend(probs, V)", "out = attend(probs, K)", "ex8", "value_swapped"),
    M("c", "layer_mask_result_dropped", "        logits = apply_mask(logits, mask)\n",
      "        apply_mask(logits, mask)\n", "ex8", "mask_ignored"),
    M("c", "layer_mask_after_softmax", "    if mask is not None:\n        logits = apply_mask(logits, mask)\n", "",
      "ex8", "mask_after_softmax",
      ("    out = attend(probs, V)\n", "    if mask is not None:\n        probs = probs * mask\n    out = attend(probs, V)\n")),
    M("c", "layer_returns_swapped", "return out, probs", "return probs, out", "ex8", "order"),
    M("c", "layer_scaled_twice", "logits = attention_scores(Q, K)",
      "logits = attention_scores(Q, K) / math.sqrt(Q.size(-1))", "ex8", "wrong_scale"),
    M("c", "sdpa_without_mask",
      "reference = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask)",
      "reference = torch.nn.functional.scaled_dot_product_attention(Q, K, V)", "ex9", "mask_ignored"),
    M("c", "mine_without_mask", "mine, _ = self_attention(X, W_Q, W_K, W_V, mask=mask)",
      "mine, _ = self_attention(X, W_Q, W_K, W_V)", "ex9", "mask_ignored"),
    M("c", "ex2_unscaled", "scaled = unscaled / math.sqrt(d_k)", "scaled = unscaled", "ex11", "missing_scale"),
    M("c", "first_column", C_ROW0, "return probs.select(dim=2, index=0)", "ex12", "wrong_axis"),
    M("c", "select_dim_0", C_ROW0, "return probs.select(dim=0, index=0)", "ex12", "batch_only"),
]

# issue 48: the "c" mistakes the grader did not name when its author wrote them, named since
MUTANTS += [
    M("c", "sum_over_last_dim", "denom = expd.sum(dim=dim, keepdim=True)", "denom = expd.sum(dim=-1, keepdim=True)",
      "ex3", "softmax_dim"),
    M("c", "min_instead_of_max", "peak = scores.amax(dim=dim, keepdim=True)",
      "peak = scores.amin(dim=dim, keepdim=True)", "ex3", "unstable_softmax"),
    M("c", "layer_apply_mask_on_probs", "    if mask is not None:\n        logits = apply_mask(logits, mask)\n", "",
      "ex8", "mask_after_softmax", ("    out = attend(probs, V)\n",
                                    "    if mask is not None:\n        probs = apply_mask(probs, mask)\n"
                                    "    out = attend(probs, V)\n")),
    M("c", "ex2_times_sqrt", "scaled = unscaled / math.sqrt(d_k)", "scaled = unscaled * math.sqrt(d_k)", "ex11",
      "wrong_scale"),
    M("c", "ex2_stable_is_naive", '"stable": stable_softmax(unscaled)', '"stable": naive_softmax(unscaled)', "ex11",
      "unstable_softmax"),
    M("c", "last_row", C_ROW0, "return probs.select(dim=1, index=-1)", "ex12", "wrong_axis"),
    M("c", "causal_loop_stops_early", "for i in range(T):", "for i in range(T - 1):", "ex5", "off_by_one"),
    M("c", "padding_drops_last", "mask[b, 0, :n] = True", "mask[b, 0, : n - 1] = True", "ex6", "off_by_one"),
]

# ---------------------------------------------------------------------- d: bmm, arange masks, where, log-sum-exp
SOLUTIONS["d"] = "tests/corpus/lab01_d.py"

D_SCORES = "return torch.bmm(Q, K.transpose(1, 2)) / math.sqrt(d_k)"
D_PEAK = "peak = scores.amax(dim=dim, keepdim=True)"
D_SHIFT = "shifted = scores - peak"
D_LSE = "log_total = torch.log(torch.exp(shifted).sum(dim=dim, keepdim=True))"
D_CAUSAL = "return key <= query"
D_PAD = "real = positions < lengths.unsqueeze(1)"
D_WHERE = "return torch.where(mask, scores, minus_inf)"
D_MASK8 = "        scores = apply_mask(scores, mask)\n"
D_SCORES8 = "    scores = attention_scores(Q, K)\n    if mask"
D_ROW0 = "return weights[:, 0, :]"

MUTANTS += [
    M("d", "qk_swapped", "Q = batched_project(X, W_Q)", "Q = batched_project(X, W_K)", "ex1", "order",
      ("K = batched_project(X, W_K)", "K = batched_project(X, W_Q)")),
    M("d", "returns_q_v_k", "return Q, K, V", "return Q, V, K", "ex1", "order"),
    M("d", "no_scale", D_SCORES, "return torch.bmm(Q, K.transpose(1, 2))", "ex2", "missing_scale"),
    M("d", "size_of_S", "d_k = Q.shape[-1]", "d_k = K.shape[1]", "ex2", "wrong_scale"),
    M("d", "transpose_0_1", D_SCORES, "return torch.bmm(Q, K.transpose(0, 1)) / math.sqrt(d_k)", "ex2",
      "wrong_transpose"),
    M("d", "bmm_K_Q", D_SCORES, "return torch.bmm(K, Q.transpose(1, 2)) / math.sqrt(d_k)", "ex2", "wrong_transpose"),
    M("d", "scale_Q_in_place", D_SCORES, "Q /= math.sqrt(d_k)\n    return torch.bmm(Q, K.transpose(1, 2))", "ex2",
      "mutates_input"),
    M("d", "no_max_shift", D_SHIFT, "shifted = scores", "ex3", "unstable_softmax"),
    M("d", "max_without_keepdim", D_PEAK, "peak = scores.amax(dim=dim)", "ex3", "keepdim"),
    M("d", "sum_without_keepdim", D_LSE, "log_total = torch.log(torch.exp(shifted).sum(dim=dim))", "ex3", "keepdim"),
    M("d", "no_peak_guard", "    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)\n", "", "ex3",
      "fully_masked_nan"),
    M("d", "no_lse_guard",
      "    log_total = torch.where(torch.isinf(log_total), torch.zeros_like(log_total), log_total)\n", "", "ex3",
      "fully_masked_nan"),
    M("d", "global_max", D_PEAK, "peak = scores.amax()", "ex3", "unstable_softmax"),
    M("d", "dim_hardcoded", D_PEAK, "peak = scores.amax(dim=-1, keepdim=True)", "ex3", "softmax_dim",
      (D_LSE, "log_total = torch.log(torch.exp(shifted).sum(dim=-1, keepdim=True))")),
    M("d", "sub_in_place", D_SHIFT, "shifted = scores.sub_(peak)", "ex3", "mutates_input"),
    M("d", "causal_strict", D_CAUSAL, "return key < query", "ex5", "off_by_one"),
    M("d", "causal_unsqueeze_swapped", "query = torch.arange(T).unsqueeze(1)", "query = torch.arange(T).unsqueeze(0)",
      "ex5", "causal_future", ("key = torch.arange(T).unsqueeze(0)", "key = torch.arange(T).unsqueeze(1)")),
    M("d", "causal_inverted", D_CAUSAL, "return key > query", "ex5", "mask_polarity"),
    M("d", "causal_float", D_CAUSAL, "return (key <= query).float()", "ex5", "mask_dtype"),
    M("d", "padding_le", D_PAD, "real = positions <= lengths.unsqueeze(1)", "ex6", "off_by_one"),
    M("d", "padding_inverted", D_PAD, "real = positions >= lengths.unsqueeze(1)", "ex6", "mask_polarity"),
    M("d", "padding_query_side", "return real.unsqueeze(1)", "return real.unsqueeze(2)", "ex6", "padding_query_side"),
    M("d", "padding_length_minus_1", D_PAD, "real = positions < lengths.unsqueeze(1) - 1", "ex6", "off_by_one"),
    M("d", "where_swapped", D_WHERE, "return torch.where(mask, minus_inf, scores)", "ex7", "mask_polarity"),
    M("d", "where_zero", 'float("-inf")', "0.0", "ex7", "mask_fill_zero"),
    M("d", "where_finfo_min", 'float("-inf")', "torch.finfo(scores.dtype).min", "ex7", "mask_fill_finite"),
    M("d", "layer_softmax_dim_1", "weights = stable_softmax(scores, dim=-1)", "weights = stable_softmax(scores, dim=1)",
      "ex8", "softmax_dim"),
    M("d", "layer_attends_Q", "output = attend(weights, V)", "output = attend(weights, Q)", "ex8", "value_swapped"),
    M("d", "layer_mask_dropped", D_MASK8, "        apply_mask(scores, mask)\n", "ex8", "mask_ignored"),
    M("d", "layer_mask_inverted", D_MASK8, "        scores = apply_mask(scores, ~mask)\n", "ex8", "mask_polarity"),
    M("d", "layer_zeroes_weights", "    if mask is not None:\n" + D_MASK8, "", "ex8", "mask_after_softmax",
      ("    output = attend(weights, V)\n", "    if mask is not None:\n"
       "        weights = torch.where(mask, weights, torch.zeros_like(weights))\n    output = attend(weights, V)\n")),
    M("d", "layer_returns_swapped", "return output, weights", "return weights, output", "ex8", "order"),
    M("d", "layer_scaled_twice", D_SCORES8, "    scores = attention_scores(Q, K) / math.sqrt(Q.shape[-1])\n    if mask",
      "ex8", "wrong_scale"),
    M("d", "layer_scores_K_Q", D_SCORES8, "    scores = attention_scores(K, Q)\n    if mask", "ex8",
      "wrong_transpose"),
    M("d", "sdpa_without_mask", "theirs = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask)",
      "theirs = torch.nn.functional.scaled_dot_product_attention(Q, K, V)", "ex9", "mask_ignored"),
    M("d", "mine_without_mask", "mine, _ = self_attention(X, W_Q, W_K, W_V, mask)",
      "mine, _ = self_attention(X, W_Q, W_K, W_V)", "ex9", "mask_ignored"),
    M("d", "ex2_stable_is_naive", '"stable": stable_softmax(unscaled),', '"stable": naive_softmax(unscaled),', "ex11",
      "unstable_softmax"),
    M("d", "ex2_unscaled", '"scaled": stable_softmax(unscaled / math.sqrt(d_k)),', '"scaled": stable_softmax(unscaled),',
      "ex11", "missing_scale"),
    M("d", "first_column", D_ROW0, "return weights[:, :, 0]", "ex12", "wrong_axis"),
    M("d", "first_batch_only", D_ROW0, "return weights[0]", "ex12", "batch_only"),
]

# issue 48: in-place slips the allow-list refused (now named by the child's check); "d"'s unnamed one
MUTANTS += [
    M("c", "attend_unsqueeze_in_place", "weights.unsqueeze(-1)", "weights.unsqueeze_(-1)", "ex4", "mutates_input"),
    M("d", "lse_of_unshifted", "log_total = torch.log(torch.exp(shifted).sum(dim=dim, keepdim=True))",
      "log_total = torch.log(torch.exp(scores).sum(dim=dim, keepdim=True))", "ex3", "unstable_softmax"),
]
