"""Lab 05's mistakes: the online softmax, causal tiles, ragged edges (loads and scores past the
end), D, the backward's kernels, float16 accumulators, the autograd.Function and grouped heads;
on the instructor's Triton solution (a) and on a second one written independently in another style (b, tests/corpus/lab05_b.py: base-2
scores, pointers advanced through the loops, a two-pass causal forward, a transposed backward)."""

from corpus import M

LAB = "05-triton-flash"
SOLUTIONS = {"a": "labs/track1/05-triton-flash/solutions/flash_triton.py"}

F_ACC = "acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))"
F_L = "l_i = l_i * alpha + tl.sum(p, 1)"
F_P = "p = tl.exp(s - m_safe[:, None])"
F_S = "s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale  # (BQ, BK)"
F_LSE = "lse = m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i))"
F_DIAG = ("        if CAUSAL:\n            seen = seen & (keys[None, :] <= rows[:, None])  # ex2: the diagonal tile, masked "
          "inside\n")
F_STOP = "# ex2: key tiles wholly after this query tile are never visited\n        stop = tl.minimum(S, (pid_q + 1) * BQ)"
F_SEEN = "seen = keys[None, :] < S  # ex3: keys past the end are not keys"
F_K = ("        k = tl.load(K + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)\n"
       "        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale  # (BQ, BK)")
F_V = ("        v = tl.load(V + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)\n"
       "        acc = acc")
F_GQA = "bhk = b * Hkv + h // (H // Hkv)  # ex7"
D_SUM = "tl.store(D + bh * L + rows, tl.sum(o * do, 1), mask=rows < L)"
B_DS = "ds = p * (dp - d[:, None])"
B_DK = "dk += tl.dot(tl.trans(ds), q.to(tl.float32)) * scale"
B_DQ = "dq += tl.dot(ds, k.to(tl.float32)) * scale"
B_ACC = "dk = tl.zeros([BK, E], tl.float32)\n    dv = tl.zeros([BK, E], tl.float32)"
B_DV = "dv += tl.dot(tl.trans(p), do.to(tl.float32))"
B_CAUSAL_KV = ("            if CAUSAL:\n                seen = seen & (keys[None, :] <= rows[:, None])\n"
               "            p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)  # P rebuilt")
B_CAUSAL_Q = ("        if CAUSAL:\n            seen = seen & (keys[None, :] <= rows[:, None])\n"
              "        p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)\n        dp")
B_GROUP = "for g in range(0, r):"
B_DQ_HEAD = "bhk = b * Hkv + h // (H // Hkv)\n    rows"

O_ST = ("    tl.store(O + bh * L * E + rows[:, None] * E + cols_e[None, :], o.to(O.dtype.element_ty), "
        "mask=rows[:, None] < L)")
FWD_SEEN = "            seen = seen & (keys[None, :] <= rows[:, None])  # ex2: the diagonal tile, masked inside"

MUTANTS = [
    M("a", "acc_not_rescaled", F_ACC, "acc = acc + tl.dot(p, v.to(tl.float32))", "ex1", "online_rescale"),
    M("a", "l_not_rescaled", F_L, "l_i = l_i + tl.sum(p, 1)", "ex1", "online_rescale"),
    M("a", "stale_max", F_P, 'p = tl.exp(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])', "ex1",
      "online_rescale"),
    M("a", "forward_no_scale", F_S, "s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))  # (BQ, BK)", "ex1",
      "missing_scale"),
    M("a", "lse_log2", F_LSE, "lse = m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))", "ex1", "lse_saved"),
    M("a", "lse_is_max", F_LSE, "lse = m_i", "ex1", "lse_saved"),
    M("a", "lse_without_max", F_LSE, "lse = tl.log(tl.where(l_i == 0.0, 1.0, l_i))", "ex1", "lse_saved"),
    M("a", "diagonal_unmasked", F_DIAG, "", "ex2", "causal_block_skip"),
    M("a", "diagonal_skipped", F_STOP, F_STOP.replace("(pid_q + 1) * BQ", "pid_q * BQ"), "ex2", "causal_block_skip"),
    M("a", "future_tiles_loaded", F_STOP, F_STOP.replace("tl.minimum(S, (pid_q + 1) * BQ)", "S"), "ex2",
      "causal_block_skip"),
    M("a", "causal_hides_diagonal", F_DIAG, F_DIAG.replace("<=", "<"), "ex2", "off_by_one"),
    M("a", "keys_past_S_scored", F_SEEN, "seen = keys[None, :] >= 0  # ex3: keys past the end are not keys", "ex3",
      "load_mask"),
    # issue 48 item 4: lab 05's online-softmax, mask, stride and tile mistakes, each named
    M("a", "rescale_after_update", "        p = tl.exp(s - m_safe[:, None])\n        alpha = tl.exp(m_i - m_safe)",
      "        m_i = m_new\n        p = tl.exp(s - m_safe[:, None])\n        alpha = tl.exp(m_i - m_safe)", "ex1", "online_rescale"),
    M("a", "double_scale", "s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale  # (BQ, BK)",
      "s = tl.dot(q.to(tl.float32) * scale, tl.trans(k.to(tl.float32))) * scale  # (BQ, BK)", "ex1", "wrong_scale"),
    M("a", "causal_reversed", FWD_SEEN, FWD_SEEN.replace("keys[None, :] <= rows[:, None]", "rows[:, None] <= keys[None, :]"), "ex2", "causal_future"),
    M("a", "causal_tile_local", FWD_SEEN, FWD_SEEN.replace("keys[None, :] <= rows[:, None]", "tl.arange(0, BK)[None, :] <= tl.arange(0, BQ)[:, None]"), "ex2", "tile_local_index"),
    M("a", "last_tile_dropped", "    for start in range(0, stop, BK):\n        keys = start + tl.arange(0, BK)\n        k = tl.load(K + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)\n        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale  # (BQ, BK)",
      "    for start in range(0, stop // BK * BK, BK):\n        keys = start + tl.arange(0, BK)\n        k = tl.load(K + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)\n        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale  # (BQ, BK)", "ex3", "dropped_tile"),
    M("a", "k_transposed_load", "        k = tl.load(K + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)\n        s = tl.dot",
      "        k = tl.load(K + bhk * S * E + keys[:, None] + cols_e[None, :] * S, mask=keys[:, None] < S, other=0.0)\n        s = tl.dot", "ex1", "wrong_strides"),
    # stores past the end: the interpreter wrote there (SIGSEGV, glibc's 'double free'); now stopped and named
    M("a", "o_store_unmasked", O_ST, O_ST.replace(", mask=rows[:, None] < L)", ")"), "ex3", "store_mask"),
    M("a", "lse_store_unmasked", "    tl.store(LSE + bh * L + rows, lse, mask=rows < L)",
      "    tl.store(LSE + bh * L + rows, lse)", "ex3", "store_mask"),
    M("a", "row_mask_le", O_ST, O_ST.replace("rows[:, None] < L)", "rows[:, None] <= L)"), "ex3", "store_mask"),
    M("a", "program_ids_swapped", "    pid_q = tl.program_id(0)\n    bh = tl.program_id(1)\n    b = bh // H\n    h = bh % H\n"
      "    bhk = b * Hkv + h // (H // Hkv)  # ex7", "    pid_q = tl.program_id(1)\n    bh = tl.program_id(0)\n"
      "    b = bh // H\n    h = bh % H\n    bhk = b * Hkv + h // (H // Hkv)  # ex7", "ex2", "head_offset"),
    # the dQ kernel's key loop not stopped at the diagonal under CAUSAL (masked inside: right values, 0 x NaN)
    M("a", "dq_visits_masked_tiles", "    stop = S\n    if CAUSAL:\n        stop = tl.minimum(S, (pid_q + 1) * BQ)\n"
      "    for start in range(0, stop, BK):\n        keys = start + tl.arange(0, BK)\n        k = tl.load(K + bhk * S * E + "
      "keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)\n        v = tl.load",
      "    stop = S\n    for start in range(0, stop, BK):\n        keys = start + tl.arange(0, BK)\n        k = tl.load(K + "
      "bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)\n        v = tl.load",
      "ex5", "causal_block_skip"),
    M("a", "D_wrong_axis", "tl.store(D + bh * L + rows, tl.sum(o * do, 1), mask=rows < L)", "tl.store(D + bh * L + rows, tl.sum(o * do, 0), mask=rows < L)", "ex4", "backward_d_term"),
    # (K loaded without mask= alone is not in the corpus: its scores past S are masked to -inf by
    # tl.where, so no value shows it under the interpreter; on a GPU it may fault. The README says so.)
    M("a", "v_loaded_without_mask", F_V, F_V.replace(", mask=keys[:, None] < S, other=0.0", ""), "ex3", "load_mask"),
    # issue 48: masked, but without other=: the interpreter gave 0.0 (full marks); a GPU leaves garbage
    M("a", "v_masked_without_other", F_V, F_V.replace(", other=0.0", ""), "ex3", "load_mask"),
    M("a", "key_mask_drops_last_key", F_SEEN, "seen = keys[None, :] < S - 1  # ex3: keys past the end are not keys",
      "ex3", "off_by_one"),
    # key S read and scored: past the end of the last head's keys, so a load past the end
    M("a", "key_mask_lets_S_in", F_SEEN, "seen = keys[None, :] <= S  # ex3: keys past the end are not keys", "ex3",
      "load_mask", (F_K, F_K.replace("mask=keys[:, None] < S", "mask=keys[:, None] <= S")),
      (F_V, F_V.replace("mask=keys[:, None] < S", "mask=keys[:, None] <= S"))),
    M("a", "D_without_O", D_SUM, "tl.store(D + bh * L + rows, tl.sum(do, 1), mask=rows < L)", "ex4", "backward_d_term"),
    M("a", "D_without_dO", D_SUM, "tl.store(D + bh * L + rows, tl.sum(o, 1), mask=rows < L)", "ex4", "backward_d_term"),
    M("a", "ds_without_D", B_DS + "\n            dk", "ds = p * dp\n            dk", "ex5", "backward_d_term",
      (B_DS + "\n        dq", "ds = p * dp\n        dq")),
    M("a", "dk_without_scale", B_DK, "dk += tl.dot(tl.trans(ds), q.to(tl.float32))", "ex5", "backward_scale"),
    M("a", "dq_without_scale", B_DQ, "dq += tl.dot(ds, k.to(tl.float32))", "ex5", "backward_scale"),
    M("a", "dkdv_accumulated_in_input_dtype", B_ACC,
      "dk = tl.zeros([BK, E], K.dtype.element_ty)\n    dv = tl.zeros([BK, E], V.dtype.element_ty)", "ex5",
      "accumulate_dtype", (B_DV, "dv += tl.dot(tl.trans(p), do.to(tl.float32)).to(V.dtype.element_ty)"),
      (B_DK, "dk += (tl.dot(tl.trans(ds), q.to(tl.float32)) * scale).to(K.dtype.element_ty)")),
    M("a", "backward_without_causal_mask", B_CAUSAL_KV,
      "            p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)  # P rebuilt", "ex5", "backward_mask",
      (B_CAUSAL_Q, "        p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)\n        dp")),
    M("a", "function_backward_not_causal", "dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.is_causal)",
      "dq, dk, dv = flash_backward(q, k, v, o, lse, do)", "ex6", "causal_block_skip"),
    M("a", "gqa_modulo_heads", F_GQA, "bhk = b * Hkv + h % Hkv  # ex7", "ex7", "gqa_group_mapping"),
    M("a", "gqa_dkdv_first_head_only", B_GROUP, "for g in range(0, 1):", "ex7", "gqa_grad_sum"),
    M("a", "gqa_dq_modulo_heads", B_DQ_HEAD, "bhk = b * Hkv + h % Hkv\n    rows", "ex7", "gqa_group_mapping"),
]

# ---------------------------------------------------------------- solution b (tests/corpus/lab05_b.py)
SOLUTIONS["b"] = "tests/corpus/lab05_b.py"

BF_OUT = "out = out * corr[:, None] + tl.dot(w, vt)"
BF_DENOM = "denom = denom * corr + tl.sum(w, 1)"
BF_W = "w = tl.exp2(x - base[:, None])"
BF_QS = "qs = tl.load(q_ptrs, mask=offs_q[:, None] < L, other=0.0).to(tl.float32) * (scale * 1.4426950408889634)"
BF_LSE = "(m + tl.log2(safe)) * 0.6931471805599453"
BF_DIAG = "offs_k, S, E, BK, True)"
BF_SECOND = ("        m, denom, out = _attend(qs, kt_ptrs, v_ptrs, m, denom, out, full, tl.minimum(q_start + BQ, S), "
             "offs_q,\n                                offs_k, S, E, BK, True)\n")
BF_OK_DIAG = "ok = ok & (offs_q[:, None] >= cols[None, :])"
BF_OK = "ok = cols[None, :] < S"
BF_V = "vt = tl.load(v_ptrs, mask=cols[:, None] < S, other=0.0).to(tl.float32)  # (BK, E)"
BF_FULL = "full = tl.minimum(q_start, S)"
BD_SUM = "delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)"
BB_DST = "dst = pt * (dpt - delta[None, :])"
BB_DS = "ds = p * (dp - delta[:, None])"
BB_DK_SCALE = "    dk_acc = dk_acc * scale\n"
BB_DQ_SCALE = "    dq_acc = dq_acc * scale\n"
BB_ACC = "dk_acc = tl.zeros([BK, E], dtype=tl.float32)\n    dv_acc = tl.zeros([BK, E], dtype=tl.float32)"
BB_DV = "dv_acc += tl.dot(pt, do)"
BB_DK = "dk_acc += tl.dot(dst, tl.trans(qt))"
BB_KV_CAUSAL = "            if CAUSAL:\n                keep = keep & (offs_k[:, None] <= rows[None, :])\n"
BB_Q_CAUSAL = "        if CAUSAL:\n            keep = keep & (cols[None, :] <= offs_q[:, None])\n"
BB_Q_LO = "q_lo = k_start - k_start % BQ"
B_GQA_F = "kv_head = (head // H) * Hkv + (head % H) // group  # ex7"
B_GQA_DQ = "kv_head = (head // H) * Hkv + (head % H) // (H // Hkv)  # ex7"

MUTANTS += [
    M("b", "acc_not_rescaled", BF_OUT, "out = out + tl.dot(w, vt)", "ex1", "online_rescale"),
    M("b", "denom_not_rescaled", BF_DENOM, "denom = denom + tl.sum(w, 1)", "ex1", "online_rescale"),
    M("b", "stale_max", BF_W, 'w = tl.exp2(x - tl.where(m == float("-inf"), 0.0, m)[:, None])', "ex1",
      "online_rescale"),
    M("b", "forward_no_scale", BF_QS, BF_QS.replace("(scale * 1.4426950408889634)", "1.4426950408889634"), "ex1",
      "missing_scale"),
    M("b", "forward_natural_scores_in_exp2", BF_QS, BF_QS.replace("(scale * 1.4426950408889634)", "scale"), "ex1",
      "wrong_scale"),
    M("b", "exp_of_base2_scores", BF_W, "w = tl.exp(x - base[:, None])", "ex1", "wrong_scale",
      ("corr = tl.exp2(m - base)", "corr = tl.exp(m - base)")),
    M("b", "lse_base2", BF_LSE, "m + tl.log2(safe)", "ex1", "lse_saved"),
    M("b", "lse_is_max", BF_LSE, "m * 0.6931471805599453", "ex1", "lse_saved"),
    M("b", "lse_without_max", BF_LSE, "tl.log2(safe) * 0.6931471805599453", "ex1", "lse_saved"),
    M("b", "diagonal_unmasked", BF_DIAG, "offs_k, S, E, BK, False)", "ex2", "causal_block_skip"),
    M("b", "diagonal_skipped", BF_SECOND, "", "ex2", "causal_block_skip"),
    M("b", "unmasked_pass_through_diagonal", BF_FULL, "full = tl.minimum(q_start + BQ, S)", "ex2",
      "causal_block_skip"),
    M("b", "future_tiles_computed", BF_SECOND, BF_SECOND.replace("tl.minimum(q_start + BQ, S)", "S"), "ex2",
      "causal_block_skip"),
    M("b", "causal_hides_diagonal", BF_OK_DIAG, BF_OK_DIAG.replace(">=", ">"), "ex2", "off_by_one"),
    M("b", "keys_past_S_scored", BF_OK, "ok = cols[None, :] >= 0", "ex3", "load_mask"),
    M("b", "v_loaded_without_mask", BF_V, "vt = tl.load(v_ptrs).to(tl.float32)  # (BK, E)", "ex3", "load_mask"),
    M("b", "v_masked_without_other", BF_V, BF_V.replace(", other=0.0", ""), "ex3", "load_mask"),
    M("b", "key_mask_drops_last_key", BF_OK, "ok = cols[None, :] < S - 1", "ex3", "off_by_one"),
    M("b", "D_without_O", BD_SUM, "delta = tl.sum(do.to(tl.float32), axis=1)", "ex4", "backward_d_term"),
    M("b", "D_of_O_squared", BD_SUM, "delta = tl.sum(o.to(tl.float32) * o.to(tl.float32), axis=1)", "ex4",
      "backward_d_term"),
    M("b", "ds_without_D", BB_DST, "dst = pt * dpt", "ex5", "backward_d_term", (BB_DS, "ds = p * dp")),
    M("b", "dk_without_scale", BB_DK_SCALE, "", "ex5", "backward_scale"),
    M("b", "dq_without_scale", BB_DQ_SCALE, "", "ex5", "backward_scale"),
    M("b", "dkdv_accumulated_in_input_dtype", BB_ACC,
      "dk_acc = tl.zeros([BK, E], dtype=K.dtype.element_ty)\n    dv_acc = tl.zeros([BK, E], dtype=V.dtype.element_ty)",
      "ex5", "accumulate_dtype", (BB_DV, "dv_acc += tl.dot(pt, do).to(V.dtype.element_ty)"),
      (BB_DK, "dk_acc += tl.dot(dst, tl.trans(qt)).to(K.dtype.element_ty)")),
    M("b", "backward_without_causal_mask", BB_KV_CAUSAL, "", "ex5", "backward_mask", (BB_Q_CAUSAL, "")),
    M("b", "dkdv_skips_the_diagonal_query_tile", BB_Q_LO, "q_lo = k_start - k_start % BQ + BQ", "ex5",
      "causal_block_skip"),
    M("b", "function_backward_not_causal", "grads = flash_backward(q, k, v, o, lse, grad_out, is_causal=ctx.is_causal)",
      "grads = flash_backward(q, k, v, o, lse, grad_out)", "ex6", "causal_block_skip"),
    M("b", "gqa_modulo_heads", B_GQA_F, "kv_head = (head // H) * Hkv + (head % H) % Hkv  # ex7", "ex7",
      "gqa_group_mapping"),
    M("b", "gqa_dkdv_first_head_only", "for j in range(0, group):", "for j in range(0, 1):", "ex7",
      "gqa_grad_sum"),
    M("b", "gqa_dq_modulo_heads", B_GQA_DQ, "kv_head = (head // H) * Hkv + (head % H) % Hkv  # ex7", "ex7",
      "gqa_group_mapping"),
]

# ------------------------------------------------------------------ c: a third, independent solution
# (issue 48), written from the brief alone by a separate author: base-2 softmax with log2(e) folded
# into the scale, the key loop in a helper kernel, causal in two stages (the tiles before the
# diagonal unmasked, then the diagonal tile masked), the backward in exp2 too.
SOLUTIONS["c"] = "tests/corpus/lab05_c.py"
SEL = "        if DIAG:\n            keep = keep & (keys[None, :] <= q_rows[:, None])"

MUTANTS += [
    # ex1: the online softmax
    M("c", "sum_not_rescaled", "run_sum = run_sum * shrink + tl.sum(weights, axis=1)",
      "run_sum = run_sum + tl.sum(weights, axis=1)", "ex1", "online_rescale"),
    M("c", "acc_not_rescaled", "out = out * shrink[:, None] + tl.dot(", "out = out + tl.dot(", "ex1", "online_rescale"),
    M("c", "stale_max", "        run_max = new_max\n    return out, run_sum, run_max",
      "    return out, run_sum, run_max", "ex1", "online_rescale"),
    M("c", "exp_with_log2e_scale", "weights = tl.exp2(scores - new_max[:, None])",
      "weights = tl.exp(scores - new_max[:, None])", "ex1", "wrong_scale",
      ("shrink = tl.exp2(run_max - new_max)", "shrink = tl.exp(run_max - new_max)")),
    M("c", "lse_base2", "log_se = (run_max + tl.log2(run_sum)) * 0.6931471805599453",
      "log_se = run_max + tl.log2(run_sum)", "ex1", "lse_saved"),
    M("c", "no_final_divide", "    out = out / run_sum[:, None]\n", "", "ex1", "final_divide"),
    M("c", "kv_read_transposed", "kv_off = keys[:, None] * E + cols[None, :]\n        k_tile",
      "kv_off = keys[:, None] + cols[None, :] * S\n        k_tile", "ex1", "wrong_strides"),
    # ex2: causal
    M("c", "diagonal_skipped", "tl.minimum(diag + BQ, S), S, qk_scale, E, BK, True)",
      "tl.minimum(diag, S), S, qk_scale, E, BK, True)", "ex2", "causal_block_skip"),
    M("c", "diagonal_unmasked", "tl.minimum(diag + BQ, S), S, qk_scale, E, BK, True)",
      "tl.minimum(diag + BQ, S), S, qk_scale, E, BK, False)", "ex2", "causal_block_skip"),
    M("c", "future_tiles_loaded", "tl.minimum(diag + BQ, S), S, qk_scale, E, BK, True)",
      "S, S, qk_scale, E, BK, True)", "ex2", "causal_block_skip"),
    M("c", "causal_local_rows", SEL, SEL.replace("q_rows[:, None]", "tl.arange(0, BK)[:, None]"), "ex2",
      "tile_local_index"),
    # ex3: ragged edges
    M("c", "v_load_unmasked", "v_tile = tl.load(v_base + kv_off, mask=key_ok[:, None], other=0.0)",
      "v_tile = tl.load(v_base + kv_off)", "ex3", "load_mask"),
    M("c", "keys_past_S_weighted",
      "        keep = key_ok[None, :]\n" + SEL + "\n        scores = tl.where(keep, scores, float(\"-inf\"))",
      "        if DIAG:\n            scores = tl.where(keys[None, :] <= q_rows[:, None], scores, float(\"-inf\"))",
      "ex3", "load_mask"),
    M("c", "o_store_unmasked", "tl.store(O + q_off, out.to(O.dtype.element_ty), mask=row_ok[:, None])",
      "tl.store(O + q_off, out.to(O.dtype.element_ty))", "ex3", "store_mask"),
    M("c", "floor_key_tiles", "cols, 0, S, S,\n", "cols, 0, S // BK * BK, S,\n", "ex3", "dropped_tile"),
    # ex4: the preprocess
    M("c", "d_sum_wrong_axis", "delta = tl.sum(o_tile * do_tile, axis=1)", "delta = tl.sum(o_tile * do_tile, axis=0)",
      "ex4", "backward_d_term"),
    # ex5: the backward kernels
    M("c", "d_term_missing_both", "        dscores = probs * (dprobs - delta[:, None])\n        dq_acc",
      "        dscores = probs * dprobs\n        dq_acc", "ex5", "backward_d_term",
      ("            dscores = probs * (dprobs - delta[:, None])\n", "            dscores = probs * dprobs\n")),
    M("c", "dk_unscaled", "    dk_acc = dk_acc * scale\n", "", "ex5", "backward_scale"),
    M("c", "dv_f16_accumulator", "dv_acc = tl.zeros([BK, E], tl.float32)", "dv_acc = tl.zeros([BK, E], V.dtype.element_ty)",
      "ex5", "accumulate_dtype",
      ("dv_acc += tl.dot(tl.trans(probs).to(do_tile.dtype), do_tile)",
       "dv_acc += tl.dot(tl.trans(probs).to(do_tile.dtype), do_tile).to(V.dtype.element_ty)")),
    M("c", "dkdv_diagonal_skipped", "first = (ktile * BK) // BQ * BQ", "first = (ktile + 1) * BK", "ex5",
      "causal_block_skip"),
    # ex6: the autograd Function
    # ex7: GQA
    M("c", "gqa_fwd_modulo", "kv_flat = batch * Hkv + head // (H // Hkv)", "kv_flat = batch * Hkv + head % Hkv",
      "ex7", "gqa_group_mapping"),
    M("c", "gqa_dkdv_one_head", "for g in range(0, group):", "for g in range(0, 1):", "ex7", "gqa_grad_sum"),
    # the backward's dQ kernel alone, and dV
    M("c", "dq_no_d_term", "        dscores = probs * (dprobs - delta[:, None])\n        dq_acc",
      "        dscores = probs * dprobs\n        dq_acc", "ex5", "backward_d_term"),
    M("c", "dv_scaled", "    dk_acc = dk_acc * scale\n", "    dk_acc = dk_acc * scale\n    dv_acc = dv_acc * scale\n",
      "ex5", "backward_scale"),
    M("c", "dq_diagonal_skipped", "last = tl.minimum((tile + 1) * BQ, S)", "last = tl.minimum(tile * BQ, S)",
      "ex5", "causal_block_skip"),
]

# ------------------------------------------------------------------ d: a fourth, independent solution
# written from the brief alone: pointers advanced inside the loops (k_ptrs += BK * E), natural
# exponentials with the scale multiplied into q once when it is loaded, masks as tl.where(..., -inf),
# the causal key loops cut by a min() on their end (dK/dV's query loop by its start); dK takes its
# scale from the pre-scaled q.
SOLUTIONS["d"] = "tests/corpus/lab05_d.py"
D_ACC = "acc = acc * alpha[:, None] + tl.dot(p, v)"
D_QF = "q = tl.load(q_ptrs, mask=rows[:, None] < L, other=0.0).to(tl.float32) * scale  # scaled once, here"
D_SF = "        s = tl.dot(q, tl.trans(k))\n        s = tl.where(offs_k[None, :] < S, s, float(\"-inf\"))  # ex3"
D_LSE = "m_i + tl.log(l_i), mask=rows < L)"
D_END = "end = tl.minimum(S, (pid_q + 1) * BQ)  # ex2: no key tile after this query tile's last row"
D_DIAG = ("            s = tl.where(offs_k[None, :] <= rows[:, None], s, float(\"-inf\"))  # ex2: inside the diagonal "
          "tile\n")
D_SEEN = "s = tl.where(offs_k[None, :] < S, s, float(\"-inf\"))  # ex3: keys past S get no weight"
D_VF = ("        v = tl.load(v_ptrs, mask=offs_k[:, None] < S, other=0.0).to(tl.float32)\n"
        "        s = tl.dot(q, tl.trans(k))\n        s = tl.where(offs_k[None, :] < S, s, float(\"-inf\"))  # ex3")
D_ROWSUM = "tl.store(D + bh * L + rows, tl.sum(do * o, 1), mask=rows < L)"
D_DS_KV = "            ds = p * (dp - di[:, None])\n"
D_DS_Q = "        ds = p * (dp - di[:, None])\n"
D_QKV = "            q = tl.load(q_ptrs, mask=rows[:, None] < L, other=0.0).to(tl.float32) * scale\n"
D_CAUSAL_KV = ("            if CAUSAL:\n"
               "                s = tl.where(keys[None, :] <= rows[:, None], s, float(\"-inf\"))\n")
D_CAUSAL_Q = ("        if CAUSAL:\n            s = tl.where(offs_k[None, :] <= rows[:, None], s, float(\"-inf\"))\n"
              "        p = tl.exp(s - lse[:, None])\n        dp")
D_END_Q = "    if CAUSAL:\n        end = tl.minimum(S, (pid_q + 1) * BQ)\n    for"

MUTANTS += [
    # ex1: the online softmax, the scale, lse, the final divide
    M("d", "acc_not_rescaled", D_ACC, "acc = acc + tl.dot(p, v)", "ex1", "online_rescale"),
    M("d", "l_not_rescaled", "l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)", "ex1", "online_rescale"),
    M("d", "max_never_updated", "        m_i = m_new\n", "", "ex1", "online_rescale"),
    M("d", "forward_no_scale", D_QF, D_QF.replace(" * scale", ""), "ex1", "missing_scale"),
    M("d", "scores_scaled_twice", D_SF, D_SF.replace("tl.trans(k))\n", "tl.trans(k)) * scale\n"), "ex1", "wrong_scale"),
    M("d", "lse_log2", D_LSE, "m_i + tl.log2(l_i), mask=rows < L)", "ex1", "lse_saved"),
    M("d", "lse_without_max", D_LSE, "tl.log(l_i), mask=rows < L)", "ex1", "lse_saved"),
    M("d", "no_final_divide", "out = acc / l_i[:, None]", "out = acc", "ex1", "final_divide"),
    # ex2: causal
    M("d", "diagonal_skipped", D_END, D_END.replace("(pid_q + 1) * BQ", "pid_q * BQ"), "ex2", "causal_block_skip"),
    M("d", "future_tiles_loaded", D_END, D_END.replace("tl.minimum(S, (pid_q + 1) * BQ)", "S"), "ex2",
      "causal_block_skip"),
    M("d", "causal_end_max", D_END, D_END.replace("tl.minimum", "tl.maximum"), "ex2", "causal_block_skip"),
    M("d", "diagonal_unmasked", D_DIAG, "", "ex2", "causal_block_skip",
      ("        if CAUSAL:\n        m_new", "        m_new")),
    M("d", "causal_hides_diagonal", D_DIAG, D_DIAG.replace("<=", "<"), "ex2", "off_by_one"),
    # ex3: ragged edges
    M("d", "keys_past_S_scored", "        " + D_SEEN + "\n", "", "ex3", "load_mask"),
    M("d", "v_loaded_without_mask", D_VF, D_VF.replace("v_ptrs, mask=offs_k[:, None] < S, other=0.0)", "v_ptrs)"),
      "ex3", "load_mask"),
    M("d", "v_masked_without_other", D_VF,
      D_VF.replace("< S, other=0.0).to(tl.float32)\n        s", "< S).to(tl.float32)\n        s"), "ex3", "load_mask"),
    M("d", "o_store_unmasked", "tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rows[:, None] < L)",
      "tl.store(o_ptrs, out.to(O.dtype.element_ty))", "ex3", "store_mask"),
    M("d", "lse_store_le", D_LSE, "m_i + tl.log(l_i), mask=rows <= L)", "ex3", "store_mask"),
    M("d", "key_mask_drops_last_key", D_SEEN, D_SEEN.replace("< S, s", "< S - 1, s"), "ex3", "off_by_one"),
    M("d", "floor_key_tiles", D_END + "\n    for start in range(0, end, BK):",
      D_END + "\n    for start in range(0, end // BK * BK, BK):", "ex3", "dropped_tile"),
    # ex4: D
    M("d", "D_without_O", D_ROWSUM, D_ROWSUM.replace("tl.sum(do * o, 1)", "tl.sum(do, 1)"), "ex4", "backward_d_term"),
    M("d", "D_wrong_axis", D_ROWSUM, D_ROWSUM.replace("tl.sum(do * o, 1)", "tl.sum(do * o, 0)"), "ex4",
      "backward_d_term"),
    M("d", "D_store_unmasked", D_ROWSUM, D_ROWSUM.replace(", mask=rows < L)", ")"), "ex4", "store_mask"),
    # ex5: the backward kernels
    M("d", "ds_without_D", D_DS_KV, "            ds = p * dp\n", "ex5", "backward_d_term",
      (D_DS_Q, "        ds = p * dp\n")),
    M("d", "dq_without_scale", "dq * scale, mask=", "dq, mask=", "ex5", "backward_scale"),
    M("d", "dkdv_q_unscaled", D_QKV, D_QKV.replace(" * scale\n", "\n"), "ex5", "backward_scale"),
    M("d", "dv_f16_accumulator", "dv = tl.zeros([BK, E], tl.float32)", "dv = tl.zeros([BK, E], V.dtype.element_ty)",
      "ex5", "accumulate_dtype",
      ("dv += tl.dot(tl.trans(p), do)", "dv += tl.dot(tl.trans(p), do).to(V.dtype.element_ty)")),
    M("d", "backward_without_causal_mask", D_CAUSAL_KV, "", "ex5", "backward_mask",
      (D_CAUSAL_Q, "        p = tl.exp(s - lse[:, None])\n        dp")),
    M("d", "dq_diagonal_skipped", D_END_Q, D_END_Q.replace("(pid_q + 1) * BQ", "pid_q * BQ"), "ex5",
      "causal_block_skip"),
    M("d", "dq_visits_future_tiles", D_END_Q, "    for", "ex5", "causal_block_skip"),
    M("d", "dkdv_begins_after_key_tile", "begin = (pid_k * BK) // BQ * BQ", "begin = pid_k * BK + BK", "ex5",
      "causal_block_skip"),
    M("d", "dkdv_q_loaded_without_mask", D_QKV, "            q = tl.load(q_ptrs).to(tl.float32) * scale\n", "ex5",
      "load_mask"),
    M("d", "dk_store_unmasked", "tl.store(DK + kv_offs, dk, mask=keys[:, None] < S)", "tl.store(DK + kv_offs, dk)",
      "ex5", "store_mask"),
    # ex6: the autograd Function
    M("d", "function_backward_not_causal", "flash_backward(q, k, v, o, lse, do, ctx.is_causal)",
      "flash_backward(q, k, v, o, lse, do)", "ex6", "causal_block_skip"),
    # ex7: grouped heads
    M("d", "gqa_modulo_heads", "(bh % H) // (H // Hkv)  # ex7: the key", "(bh % H) % Hkv  # ex7: the key", "ex7",
      "gqa_group_mapping"),
    M("d", "gqa_dq_modulo_heads", "(bh % H) // (H // Hkv)  # ex7\n", "(bh % H) % Hkv  # ex7\n", "ex7",
      "gqa_group_mapping"),
]

# issue 48: the "d" mistakes the grader did not name when its author wrote them, named since
MUTANTS += [
    M("d", "dk_scaled_twice", "dk += tl.dot(tl.trans(ds), q)  # q carries",
      "dk += tl.dot(tl.trans(ds), q) * scale  # q carries", "ex5", "backward_scale"),
    M("d", "grads_dk_dv_swapped", "return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None",
      "return dq.to(q.dtype), dv.to(v.dtype), dk.to(k.dtype), None", "ex6", "order"),
    M("d", "causal_reversed", 's = tl.where(offs_k[None, :] <= rows[:, None], s, float("-inf"))  # ex2',
      's = tl.where(offs_k[None, :] >= rows[:, None], s, float("-inf"))  # ex2', "ex2", "causal_future"),
]
# issue 62, item 5's first held-out corpus: classes it left unnamed, now bug models (attnlab.bugmodels)
DQ_V = ("        v = tl.load(V + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)\n"
        "        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale\n")
MUTANTS += [
    M("a", "dq_scale_with_log2e", B_DQ, "dq += tl.dot(ds, k.to(tl.float32)) * scale * 1.4426950408889634", "ex5",
      "backward_scale"),
    M("a", "dq_v_never_advanced", DQ_V, DQ_V.replace("keys[:, None] * E", "(keys - start)[:, None] * E"), "ex5",
      "stale_tile"),
    M("a", "gqa_group_head_never_advanced", "bh = b * H + hk * r + g", "bh = b * H + hk * r", "ex7", "gqa_grad_sum"),
]
MUTANTS += [
    # issue 62, item 2: ex5 has a case with B = 2 now; with B = 1 everywhere but ex7 this was ex7's alone
    M("a", "dq_kv_head_without_batch", B_DQ_HEAD, "bhk = h // (H // Hkv)\n    rows", "ex5", "head_offset"),
    # issue 62's held-out corpora: pointer offsets, named by the (batch, head) each program reached (grading/offsets.py)
    M("a", "dkdv_lse_without_head", "            lse = tl.load(LSE + bh * L + rows,", "            lse = tl.load(LSE + rows,",
      "ex5", "head_offset"),
    M("a", "dkdv_q_offset_with_S", "            q = tl.load(Q + bh * L * E", "            q = tl.load(Q + bh * S * E", "ex5",
      "head_offset"),
    M("a", "dkdv_lse_along_keys", "p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)  # P rebuilt",
      "p = tl.where(seen, tl.exp(s - lse[None, :]), 0.0)  # P rebuilt", "ex5", "wrong_axis"),
    M("a", "dq_d_along_keys", "        ds = p * (dp - d[:, None])\n        dq +=", "        ds = p * (dp - d[None, :])\n        dq +=",
      "ex5", "wrong_axis"),
    M("a", "dv_stored_as_float16", "tl.store(DV + bhk * S * E + keys[:, None] * E + cols_e[None, :], dv, mask",
      "tl.store(DV + bhk * S * E + keys[:, None] * E + cols_e[None, :], dv.to(tl.float16), mask", "ex5", "low_precision"),
    M("a", "dq_d_at_kv_head", "    d = tl.load(D + bh * L + rows, mask=rows < L, other=0.0)\n    dq = tl.zeros",
      "    d = tl.load(D + bhk * L + rows, mask=rows < L, other=0.0)\n    dq = tl.zeros", "ex7", "head_offset"),
]


MUTANTS += [  # issue 62's second held-out corpus: pointers not advanced, a transposed tile product or mask
    M("b", "dkdv_q_pointer_not_advanced", "            qt_ptrs += BQ * E\n", "", "ex5", "stale_tile"),
    M("b", "dkdv_do_pointer_not_advanced", "            do_ptrs += BQ * E\n", "", "ex5", "stale_tile"),
    M("b", "dkdv_dp_query_major", "dpt = tl.dot(v, tl.trans(do))", "dpt = tl.dot(do, tl.trans(v))", "ex5",
      "backward_operand"),
    M("b", "dkdv_mask_query_major", "keep = keep & (offs_k[:, None] <= rows[None, :])",
      "keep = keep & (rows[:, None] >= offs_k[None, :])", "ex5", "backward_mask"),
    M("a", "dv_without_transpose", "dv += tl.dot(tl.trans(p), do.to(tl.float32))", "dv += tl.dot(p, do.to(tl.float32))",
      "ex5", "backward_operand"),
]


MUTANTS += [  # issue 62's third held-out corpus: what each program read, past a tensor's end too
    M("b", "dq_pointers_step_elements", "        kt_ptrs += BK * E\n        vt_ptrs += BK * E\n",
      "        kt_ptrs += BK\n        vt_ptrs += BK\n", "ex5", "stale_tile"),
    M("b", "dq_kv_head_without_modulo", "kv_head = (head // H) * Hkv + (head % H) // (H // Hkv)  # ex7",
      "kv_head = (head // H) * Hkv + head // (H // Hkv)  # ex7", "ex7", "head_offset"),
    M("b", "D_stored_with_E", "tl.store(D + tl.program_id(1) * L + offs_q, delta, mask=offs_q < L)",
      "tl.store(D + tl.program_id(1) * L * E + offs_q, delta, mask=offs_q < L)", "ex4", "head_offset"),
]


MUTANTS += [  # issue 62's fifth held-out corpus: a causal mask with a position inside the tile (bugmodels' local_k)
    M("a", "dq_mask_key_inside_its_tile", "            seen = seen & (keys[None, :] <= rows[:, None])\n        p = tl.where",
      "            seen = seen & (tl.arange(0, BK)[None, :] <= rows[:, None])\n        p = tl.where", "ex5", "tile_local_index"),
]
