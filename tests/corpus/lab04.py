"""Lab 04's mistakes, on the instructor's solution (``a``: per-head tiles, alpha, masked_fill)
and on an independent one (``b``: heads flattened, einsum, a correction factor, the backward's
loops the other way round).
Solution ``c`` (issue 48, independent): base 2, while loops, the running max from the first tile."""

from corpus import M

LAB = "04-flash-attention"
SOLUTIONS = {"a": "labs/track1/04-flash-attention/solutions/flash.py", "b": "tests/corpus/lab04_b.py"}

A1_L = "l_i = l_i * torch.exp(m_i - m_safe) + torch.exp(chunk - m_safe[:, None]).sum(dim=-1)"
A2_P = "p = torch.exp(s - m_safe[..., None])  # [B, H, bq, bk]"
A2_L = "l_i = l_i * alpha + p.sum(dim=-1)"
A2_ACC = "acc = acc * alpha[..., None] + p @ v[:, :, ks:ke]"
A2_LSE = "lse[:, :, qs:qe] = m_i + torch.log(l_i)"
A2_Q = "q_i = q[:, :, qs:qe] * scale  # [B, H, bq, E]"
A2_STOP = "k_stop = min(S, qe) if is_causal else S"
A2_MASK = ("            if is_causal:\n                mask = causal_block_mask(qs, qe, ks, ke)\n                if mask is not None:\n"
           "                    s = s.masked_fill(~mask, float(\"-inf\"))\n            m_new")
A4_DS = "ds = p * (dp - D[:, :, qs:qe, None])"
A4_DQ = "dq[:, :, qs:qe] += (ds @ k_j) * scale"
A4_DK = "dk[:, :, ks:ke] += (ds.transpose(-2, -1) @ q_i) * scale"
A4_S = "s = (q_i @ k_j.transpose(-2, -1)) * scale  # [B, H, bq, bk]"
A4_MASK = ("            if is_causal:\n                mask = causal_block_mask(qs, qe, ks, ke)\n                if mask is not None:\n"
           "                    s = s.masked_fill(~mask, float(\"-inf\"))\n            p = torch.exp")
B1_SUM = "running_sum = running_sum * correction + torch.exp(chunk - shift.unsqueeze(1)).sum(dim=1)"
B2_P = "p = torch.exp(s - shift[..., None])"
B2_L = "l_i = correction * l_i + p.sum(dim=-1)"
B2_ACC = 'acc = correction[..., None] * acc + torch.einsum("nqk,nkv->nqv", p, vf[:, k0:k1])'
B2_LSE = "lse[:, q0:q1] = m_i + torch.log(l_i)"
B2_S = 's = torch.einsum("nqe,nke->nqk", qb, kf[:, k0:k1]) * sm_scale'
B2_WHERE = ('                if keep is not None:\n                    s = torch.where(keep, s, torch.full_like(s, float("-inf")))\n'
            '            m_new')
B4_DS = "ds = p * (dp - D[:, :, q0:q1, None])"
B4_DQ = 'dq[:, :, q0:q1] += torch.einsum("bhqk,bhke->bhqe", ds, kb) * sm_scale'
B4_DK = 'dk[:, :, k0:k1] += torch.einsum("bhqk,bhqe->bhke", ds, qb) * sm_scale'
B4_S = 's = torch.einsum("bhqe,bhke->bhqk", qb, kb) * sm_scale\n            if is_causal:\n                keep = causal_block_mask(q0, q1, k0, k1)\n                if keep is not None:\n                    s = torch.where(keep, s, torch.full_like(s, float("-inf")))\n            p = torch.exp'

MUTANTS = [
    # ------------------------------------------------------------------ a
    M("a", "stream_l_not_rescaled", A1_L, "l_i = l_i + torch.exp(chunk - m_safe[:, None]).sum(dim=-1)", "ex1",
      "online_rescale"),
    M("a", "stream_rescale_inverted", A1_L, "l_i = l_i * torch.exp(m_safe - m_i) + torch.exp(chunk - m_safe[:, None]).sum(dim=-1)",
      "ex1", "online_rescale"),
    M("a", "stream_unsafe_max", "        m_safe = safe_max(m_new)\n        # what was summed", "        m_safe = m_new\n        # what was summed",
      "ex1", "online_rescale"),
    M("a", "stream_max_never_updated", "        m_i = m_new\n    return m_i, l_i", "    return m_i, l_i", "ex1",
      "online_rescale"),
    M("a", "acc_not_rescaled", A2_ACC, "acc = acc + p @ v[:, :, ks:ke]", "ex2", "online_rescale"),
    M("a", "l_not_rescaled", A2_L, "l_i = l_i + p.sum(dim=-1)", "ex2", "online_rescale"),
    M("a", "stale_max", A2_P, "p = torch.exp(s - safe_max(m_i)[..., None])", "ex2", "online_rescale"),
    M("a", "no_final_divide", "o[:, :, qs:qe] = acc / l_i[..., None]", "o[:, :, qs:qe] = acc", "ex2", "final_divide"),
    M("a", "lse_log2", A2_LSE, "lse[:, :, qs:qe] = m_i + torch.log2(l_i)", "ex2", "lse_saved"),
    M("a", "lse_without_max", A2_LSE, "lse[:, :, qs:qe] = torch.log(l_i)", "ex2", "lse_saved"),
    M("a", "lse_is_max", A2_LSE, "lse[:, :, qs:qe] = m_i", "ex2", "lse_saved"),
    M("a", "diagonal_unmasked", A2_MASK, "            m_new", "ex2", "causal_block_skip"),
    M("a", "diagonal_skipped", A2_STOP, "k_stop = min(S, qs) if is_causal else S", "ex2", "causal_block_skip"),
    M("a", "future_tiles_computed", A2_STOP, "k_stop = S", "ex2", "causal_block_skip"),
    M("a", "forward_no_scale", A2_Q, "q_i = q[:, :, qs:qe]  # [B, H, bq, E]", "ex2", "missing_scale"),
    M("a", "forward_divides_by_E", "    scale = 1.0 / math.sqrt(E)\n    o = torch.empty", "    scale = 1.0 / E\n    o = torch.empty",
      "ex2", "wrong_scale"),
    M("a", "forward_scale_by_Ev", "    scale = 1.0 / math.sqrt(E)\n    o = torch.empty", "    scale = 1.0 / math.sqrt(Ev)\n    o = torch.empty",
      "ex2", "wrong_scale"),
    M("a", "full_scores_for_the_max", "    scale = 1.0 / math.sqrt(E)\n    o = torch.empty",
      "    scale = 1.0 / math.sqrt(E)\n    row_max = (q @ k.transpose(-2, -1)).amax(dim=-1)  # [B, H, L]\n    o = torch.empty",
      "ex3", "scores_materialized"),
    M("a", "no_D_term", A4_DS, "ds = p * dp", "ex4", "backward_d_term"),
    M("a", "D_of_the_tile", A4_DS, "ds = p * (dp - (dp * p).sum(-1, keepdim=True))", "ex4", "backward_d_term"),
    M("a", "dq_dk_without_scale", A4_DQ, "dq[:, :, qs:qe] += ds @ k_j", "ex4", "backward_scale",
      (A4_DK, "dk[:, :, ks:ke] += ds.transpose(-2, -1) @ q_i")),
    M("a", "dq_without_scale", A4_DQ, "dq[:, :, qs:qe] += ds @ k_j", "ex4", "backward_scale"),
    M("a", "P_rebuilt_unscaled", A4_S, "s = q_i @ k_j.transpose(-2, -1)  # [B, H, bq, bk]", "ex4", "backward_scale"),
    M("a", "backward_unmasked", A4_MASK, "            p = torch.exp", "ex4", "backward_mask"),
    M("a", "function_grads_swapped", "        return dq, dk, dv, None  # no gradient for is_causal",
      "        return dk, dq, dv, None", "ex5", "order"),
    M("a", "function_saves_weights", "ctx.save_for_backward(q, k, v, o, lse)",
      "ctx.save_for_backward(q, k, v, o, lse, torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - lse[..., None]))",
      "ex5", "scores_materialized", ("q, k, v, o, lse = ctx.saved_tensors", "q, k, v, o, lse, weights = ctx.saved_tensors")),
    M("a", "function_backward_not_causal", "dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.is_causal)",
      "dq, dk, dv = flash_backward(q, k, v, o, lse, do)", "ex5", "causal_block_skip"),
    # ------------------------------------------------------------------ b
    M("b", "no_final_divide", "out[:, q0:q1] = acc / l_i[..., None]", "out[:, q0:q1] = acc", "ex2", "final_divide"),
    M("b", "stream_no_correction", B1_SUM, "running_sum = running_sum + torch.exp(chunk - shift.unsqueeze(1)).sum(dim=1)",
      "ex1", "online_rescale"),
    M("b", "stream_correction_inverted", "correction = torch.exp(running_max - shift)",
      "correction = torch.exp(shift - running_max)", "ex1", "online_rescale"),
    M("b", "stream_unsafe_shift", "        shift = safe_max(new_max)\n        correction = torch.exp(running_max",
      "        shift = new_max\n        correction = torch.exp(running_max", "ex1", "online_rescale"),
    # issue 48: the max of the whole block (every row's) in place of each row's own
    M("a", "block_max", "m_new = torch.maximum(m_i, chunk.amax(dim=-1))  # [R]",
      "m_new = torch.maximum(m_i, chunk.amax().expand(R))  # [R]", "ex1", "block_max"),
    M("b", "block_max", "new_max = torch.maximum(running_max, chunk.max(dim=1).values)",
      "new_max = torch.maximum(running_max, chunk.max().expand(rows))", "ex1", "block_max"),
    M("b", "acc_not_rescaled", B2_ACC, 'acc = acc + torch.einsum("nqk,nkv->nqv", p, vf[:, k0:k1])', "ex2",
      "online_rescale"),
    M("b", "l_not_rescaled", B2_L, "l_i = l_i + p.sum(dim=-1)", "ex2", "online_rescale"),
    M("b", "stale_max", B2_P, "p = torch.exp(s - safe_max(m_i)[..., None])", "ex2", "online_rescale"),
    M("b", "lse_log2", B2_LSE, "lse[:, q0:q1] = m_i + torch.log2(l_i)", "ex2", "lse_saved"),
    M("b", "lse_without_max", B2_LSE, "lse[:, q0:q1] = torch.log(l_i)", "ex2", "lse_saved"),
    M("b", "lse_base_2_whole", B2_LSE, "lse[:, q0:q1] = (m_i + torch.log(l_i)) / math.log(2)", "ex2", "lse_saved"),
    M("b", "diagonal_unmasked", B2_WHERE, "            m_new", "ex2", "causal_block_skip"),
    M("b", "diagonal_skipped", "last_key = min(S, q1) if is_causal else S", "last_key = min(S, q0) if is_causal else S",
      "ex2", "causal_block_skip"),
    M("b", "future_tiles_computed", "last_key = min(S, q1) if is_causal else S", "last_key = S", "ex2",
      "causal_block_skip"),
    M("b", "forward_no_scale", B2_S, 's = torch.einsum("nqe,nke->nqk", qb, kf[:, k0:k1])', "ex2", "missing_scale"),
    M("b", "forward_times_sqrt_E", "sm_scale = E ** -0.5", "sm_scale = E ** 0.5", "ex2", "wrong_scale"),
    M("b", "forward_scale_by_Ev", "sm_scale = E ** -0.5", "sm_scale = Ev ** -0.5", "ex2", "wrong_scale"),
    M("b", "full_scores_for_the_max", "    out = qf.new_zeros(B * H, L, Ev)\n",
      '    row_max = torch.einsum("nqe,nke->nqk", qf, kf).amax(dim=-1)  # [B * H, L]\n    out = qf.new_zeros(B * H, L, Ev)\n',
      "ex3", "scores_materialized"),
    M("b", "no_D_term", B4_DS, "ds = p * dp", "ex4", "backward_d_term"),
    M("b", "D_of_the_tile", B4_DS, "ds = p * (dp - torch.einsum(\"bhqk,bhqk->bhq\", p, dp)[..., None])", "ex4",
      "backward_d_term"),
    M("b", "dq_dk_without_scale", B4_DQ, 'dq[:, :, q0:q1] += torch.einsum("bhqk,bhke->bhqe", ds, kb)', "ex4",
      "backward_scale", (B4_DK, 'dk[:, :, k0:k1] += torch.einsum("bhqk,bhqe->bhke", ds, qb)')),
    M("b", "dk_without_scale", B4_DK, 'dk[:, :, k0:k1] += torch.einsum("bhqk,bhqe->bhke", ds, qb)', "ex4",
      "backward_scale"),
    M("b", "P_rebuilt_unscaled", 's = torch.einsum("bhqe,bhke->bhqk", qb, kb) * sm_scale',
      's = torch.einsum("bhqe,bhke->bhqk", qb, kb)', "ex4", "backward_scale"),
    M("b", "backward_unmasked", B4_S, 's = torch.einsum("bhqe,bhke->bhqk", qb, kb) * sm_scale\n            p = torch.exp',
      "ex4", "backward_mask"),
    M("b", "function_grads_swapped", "        return dq, dk, dv, None", "        return dk, dq, dv, None", "ex5", "order"),
    M("b", "function_saves_weights", "ctx.save_for_backward(q, k, v, out, lse)",
      "ctx.save_for_backward(q, k, v, out, lse, torch.exp(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 - lse[..., None]))",
      "ex5", "scores_materialized", ("q, k, v, out, lse = ctx.saved_tensors", "q, k, v, out, lse, p = ctx.saved_tensors")),
    M("b", "function_backward_not_causal", "dq, dk, dv = flash_backward(q, k, v, out, lse, grad_out, ctx.is_causal)",
      "dq, dk, dv = flash_backward(q, k, v, out, lse, grad_out)", "ex5", "causal_block_skip"),
    # issue 62's held-out corpora: a product that does not line up, P from a tile's own max
    M("b", "dq_einsum_ds_transposed", 'torch.einsum("bhqk,bhke->bhqe", ds, kb)', 'torch.einsum("bhkq,bhke->bhqe", ds, kb)',
      "ex4", "backward_operand"),
    M("b", "backward_p_tile_max", "p = torch.exp(s - lse[:, :, q0:q1, None])", "p = torch.exp(s - s.amax(dim=-1, keepdim=True))",
      "ex4", "backward_p"),
]


MUTANTS += [  # issue 62's held-out corpora, on solution a: shape errors that name their line
    M("a", "dv_p_not_transposed", "dv[:, :, ks:ke] += p.transpose(-2, -1) @ do_i", "dv[:, :, ks:ke] += p @ do_i", "ex4",
      "backward_operand"),
    M("a", "backward_mask_transposed", "* scale  # [B, H, bq, bk]\n            if is_causal:\n                mask = "
      "causal_block_mask(qs, qe, ks, ke)", "* scale  # [B, H, bq, bk]\n            if is_causal:\n                mask = "
      "causal_block_mask(ks, ke, qs, qe)", "ex4", "backward_mask"),
    M("a", "lse_without_trailing_dim", "p = torch.exp(s - lse[:, :, qs:qe, None])", "p = torch.exp(s - lse[:, :, qs:qe])",
      "ex4", "keepdim"),
    M("a", "backward_mask_fill_zero", "                    s = s.masked_fill(~mask, float(\"-inf\"))\n            p = torch.exp",
      "                    s = s.masked_fill(~mask, 0.0)\n            p = torch.exp", "ex4", "mask_fill_zero"),
    M("a", "saved_unpacked_out_of_order", "q, k, v, o, lse = ctx.saved_tensors", "q, k, v, lse, o = ctx.saved_tensors",
      "ex5", "order"),
]


# ---------------------------------------------------------------------- c
# solution "c" (third independent one): base-2 exponentials (log2(e) folded into the scale), while loops, the
# running max initialised from the first key tile, the backward's outer loop over key tiles with P from exp2
SOLUTIONS["c"] = "tests/corpus/lab04_c.py"

C1_L = "l_i = l_i * torch.exp2((m_i - shift) * LOG2E) + torch.exp2((chunk - shift[:, None]) * LOG2E).sum(dim=-1)"
C2_BITS = "bits = LOG2E / math.sqrt(E)"
C2_STOP = "k_end = min(qe, S) if is_causal else S"
C2_LSE = "lse[:, :, qs:qe] = (m_i + torch.log2(l_i)) * LN2"
C2_MASK = ("            if is_causal:\n                keep = causal_block_mask(qs, qe, ks, ke)\n                if keep is not None:\n"
           "                    s2 = torch.where(keep.to(s2.device), s2, float(\"-inf\"))\n            tile_max")
C4_MASK = ("            if is_causal:\n                keep = causal_block_mask(qs, qe, ks, ke)\n                if keep is not None:\n"
           "                    s2 = torch.where(keep.to(s2.device), s2, float(\"-inf\"))\n            p = torch.exp2")
C4_DS = "ds = p * (dp - delta[:, :, qs:qe, None])"
C4_DQ = "dq[:, :, qs:qe] += (ds @ k_j) * scale"
C4_DK = "dk_j += (ds.transpose(-2, -1) @ q_i) * scale"
C4_LSE2 = "lse2 = lse.float() * LOG2E"

MUTANTS += [
    # ex1: the online softmax, base 2, the state started from the first block
    M("c", "stream_l_not_rescaled", C1_L,
      "l_i = l_i + torch.exp2((chunk - shift[:, None]) * LOG2E).sum(dim=-1)", "ex1", "online_rescale"),
    M("c", "stream_rescale_inverted", C1_L,
      "l_i = l_i * torch.exp2((shift - m_i) * LOG2E) + torch.exp2((chunk - shift[:, None]) * LOG2E).sum(dim=-1)",
      "ex1", "online_rescale"),
    M("c", "stream_head_unsafe_max", "l_i = torch.exp2((head - safe_max(m_i)[:, None]) * LOG2E).sum(dim=-1)",
      "l_i = torch.exp2((head - m_i[:, None]) * LOG2E).sum(dim=-1)", "ex1", "online_rescale"),
    M("c", "stream_block_max", "m_new = torch.maximum(m_i, chunk.amax(dim=-1))",
      "m_new = torch.maximum(m_i, chunk.amax().expand_as(m_i))", "ex1", "block_max",
      ("m_i = head.amax(dim=-1)", "m_i = head.amax().expand(x.shape[0])")),
    M("c", "stream_shifts_x_in_place", C1_L,
      "chunk -= shift[:, None]\n        l_i = l_i * torch.exp2((m_i - shift) * LOG2E) + torch.exp2(chunk * LOG2E).sum(dim=-1)",
      "ex1", "mutates_input"),
    # ex2: the tiled forward
    M("c", "acc_not_rescaled", "acc = acc * rescale[..., None] + p @ v[:, :, ks:ke].float()",
      "acc = acc + p @ v[:, :, ks:ke].float()", "ex2", "online_rescale"),
    M("c", "l_not_rescaled", "l_i = l_i * rescale + p.sum(dim=-1)", "l_i = l_i + p.sum(dim=-1)", "ex2", "online_rescale"),
    M("c", "no_final_divide", "out[:, :, qs:qe] = (acc / l_i[..., None]).to(q.dtype)", "out[:, :, qs:qe] = acc.to(q.dtype)",
      "ex2", "final_divide"),
    M("c", "lse_left_in_base_2", C2_LSE, "lse[:, :, qs:qe] = m_i + torch.log2(l_i)", "ex2", "lse_saved"),
    M("c", "lse_max_converted_log2_not", C2_LSE, "lse[:, :, qs:qe] = m_i * LN2 + torch.log2(l_i)", "ex2", "lse_saved"),
    M("c", "lse_is_max", C2_LSE, "lse[:, :, qs:qe] = m_i * LN2", "ex2", "lse_saved"),
    M("c", "lse_without_max", C2_LSE, "lse[:, :, qs:qe] = torch.log(l_i)", "ex2", "lse_saved"),
    M("c", "diagonal_unmasked", C2_MASK, "            tile_max", "ex2", "causal_block_skip"),
    M("c", "future_tiles_computed", C2_STOP, "k_end = S", "ex2", "causal_block_skip"),
    M("c", "forward_no_scale", C2_BITS, "bits = LOG2E", "ex2", "missing_scale"),
    M("c", "forward_scale_by_Ev", C2_BITS, "bits = LOG2E / math.sqrt(Ev)", "ex2", "wrong_scale"),
    M("c", "forward_divides_by_E", C2_BITS, "bits = LOG2E / E", "ex2", "wrong_scale"),
    M("c", "forward_scales_q_in_place", "q_i = q[:, :, qs:qe].float() * bits",
      "q_i = q[:, :, qs:qe].float()\n        q_i *= bits", "ex2", "mutates_input"),
    # ex3: every row's max known up front, from the whole score matrix
    M("c", "full_scores_for_the_max", "        m_i = l_i = acc = None\n",
      "        m_i, l_i, acc = row_max[:, :, qs:qe], 0.0, 0.0\n", "ex3", "scores_materialized",
      ("    qs = 0\n    while qs < L:",
       "    row_max = (q.float() @ k.float().transpose(-2, -1)).amax(dim=-1) * bits  # [B, H, L]\n    qs = 0\n    while qs < L:")),
    # ex4: the backward, key tiles outside
    M("c", "no_D_term", C4_DS, "ds = p * dp", "ex4", "backward_d_term"),
    M("c", "D_of_the_tile", C4_DS, "ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))", "ex4", "backward_d_term"),
    M("c", "dq_dk_without_scale", C4_DQ, "dq[:, :, qs:qe] += ds @ k_j", "ex4", "backward_scale",
      (C4_DK, "dk_j += ds.transpose(-2, -1) @ q_i")),
    M("c", "dq_without_scale", C4_DQ, "dq[:, :, qs:qe] += ds @ k_j", "ex4", "backward_scale"),
    M("c", "dk_without_scale", C4_DK, "dk_j += ds.transpose(-2, -1) @ q_i", "ex4", "backward_scale"),
    M("c", "P_rebuilt_unscaled", "bits = scale * LOG2E", "bits = LOG2E", "ex4", "backward_scale"),
    M("c", "lse_scaled_in_place", C4_LSE2, "lse2 = lse.float()\n    lse2 *= LOG2E", "ex4", "mutates_input"),
    M("c", "backward_unmasked", C4_MASK, "            p = torch.exp2", "ex4", "backward_mask"),
    # ex5: the autograd Function
    M("c", "function_grads_swapped", "        return dq, dk, dv, None", "        return dk, dq, dv, None", "ex5", "order"),
    M("c", "function_saves_weights", "ctx.save_for_backward(q, k, v, o, lse)",
      "ctx.save_for_backward(q, k, v, o, lse, torch.exp2((q @ k.transpose(-2, -1)) * (LOG2E / math.sqrt(q.shape[-1]))"
      " - lse[..., None] * LOG2E))", "ex5", "scores_materialized",
      ("q, k, v, o, lse = ctx.saved_tensors", "q, k, v, o, lse, weights = ctx.saved_tensors")),
    M("c", "function_backward_not_causal", "dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.is_causal)",
      "dq, dk, dv = flash_backward(q, k, v, o, lse, do)", "ex5", "causal_block_skip"),
]


# ---------------------------------------------------------------------- d
# solution "d" (fourth independent one): natural exponentials, tiles from torch.split zipped with their start offsets,
# m_i and l_i as [..., bq, 1] columns (keepdim=True), query tiles outside and key tiles inside in both passes, the
# backward's dK and dV kept as lists of per-key-tile sums accumulated across the query tiles
SOLUTIONS["d"] = "tests/corpus/lab04_d.py"

D1_L = "l_i = l_i * torch.exp(m_i - m_safe) + torch.exp(chunk - m_safe).sum(dim=-1, keepdim=True)"
D1_MAX = "m_new = torch.maximum(m_i, chunk.amax(dim=-1, keepdim=True))"
D2_SCALE = "scale = 1.0 / math.sqrt(q.shape[-1])\n    q_tiles = list(zip(range(0, L, block_q), torch.split(q, block_q, dim=-2)))"
D2_STOP = ("            if is_causal and k_start > q_end - 1:\n"
           "                break  # this key tile and every later one is after the whole query tile\n")
D2_S = "s = (q_i @ k_j.transpose(-2, -1)) * scale  # [B, H, bq, bk]"
D2_MASK = ("            if is_causal:\n                keep = causal_block_mask(q_start, q_end, k_start, k_end)\n"
           "                if keep is not None:\n                    s = s.masked_fill(~keep.to(s.device), float(\"-inf\"))\n"
           "            m_new")
D2_LSE = "lses.append(m_i + torch.log(l_i))"
D2_LOOP = "    outs, lses = [], []\n    for q_start, q_i in q_tiles:"
D4_MASK = D2_MASK[:-len("m_new")] + "p = torch.exp"
D4_DS = "ds = p * (dp - d_i)"
D4_DQ = "dq_i = dq_i + (ds @ k_j) * scale"
D4_DK = "dk_tiles[j] = dk_tiles[j] + (ds.transpose(-2, -1) @ q_i) * scale"

MUTANTS += [
    # ex1: the online softmax, m_i and l_i as [R, 1] columns
    M("d", "stream_l_not_rescaled", D1_L, "l_i = l_i + torch.exp(chunk - m_safe).sum(dim=-1, keepdim=True)", "ex1",
      "online_rescale"),
    M("d", "stream_rescale_inverted", D1_L,
      "l_i = l_i * torch.exp(m_safe - m_i) + torch.exp(chunk - m_safe).sum(dim=-1, keepdim=True)", "ex1", "online_rescale"),
    M("d", "stream_unsafe_max", "        m_safe = safe_max(m_new)\n        l_i", "        m_safe = m_new\n        l_i", "ex1",
      "online_rescale"),
    M("d", "stream_max_never_updated", "        m_i = m_new\n    return m_i.squeeze(-1)", "    return m_i.squeeze(-1)",
      "ex1", "online_rescale"),
    # dim=-1 forgotten, keepdim=True kept: the [1, 1] max of the whole block still broadcasts
    M("d", "stream_block_max", D1_MAX, "m_new = torch.maximum(m_i, chunk.amax(keepdim=True))", "ex1", "block_max"),
    M("d", "stream_max_without_keepdim", D1_MAX, "m_new = torch.maximum(m_i, chunk.amax(dim=-1))", "ex1", "keepdim"),
    # chunk is a view of x (torch.split): shifting it in place shifts the caller's x
    M("d", "stream_shifts_chunk_in_place", D1_L,
      "chunk -= m_safe\n        l_i = l_i * torch.exp(m_i - m_safe) + torch.exp(chunk).sum(dim=-1, keepdim=True)", "ex1",
      "mutates_input"),
    # ex2: the tiled forward
    M("d", "acc_not_rescaled", "acc = acc * rescale + p @ v_j", "acc = acc + p @ v_j", "ex2", "online_rescale"),
    M("d", "l_not_rescaled", "l_i = l_i * rescale + p.sum(dim=-1, keepdim=True)", "l_i = l_i + p.sum(dim=-1, keepdim=True)",
      "ex2", "online_rescale"),
    M("d", "stale_max", "p = torch.exp(s - m_safe)", "p = torch.exp(s - safe_max(m_i))", "ex2", "online_rescale"),
    M("d", "max_without_keepdim", "m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))",
      "m_new = torch.maximum(m_i, s.amax(dim=-1))", "ex2", "keepdim"),
    M("d", "no_final_divide", "outs.append(acc / l_i)", "outs.append(acc)", "ex2", "final_divide"),
    M("d", "lse_log2", D2_LSE, "lses.append(m_i + torch.log2(l_i))", "ex2", "lse_saved"),
    M("d", "lse_without_max", D2_LSE, "lses.append(torch.log(l_i))", "ex2", "lse_saved"),
    M("d", "lse_is_max", D2_LSE, "lses.append(m_i)", "ex2", "lse_saved"),
    M("d", "lse_is_the_sum", D2_LSE, "lses.append(l_i)", "ex2", "lse_saved"),
    M("d", "diagonal_unmasked", D2_MASK, "            m_new", "ex2", "causal_block_skip"),
    M("d", "diagonal_skipped", D2_STOP, D2_STOP.replace("k_start > q_end - 1", "k_start >= q_start"), "ex2",
      "causal_block_skip"),
    M("d", "future_tiles_computed", D2_STOP, "", "ex2", "causal_block_skip"),
    M("d", "one_future_tile_computed", D2_STOP, D2_STOP.replace("k_start > q_end - 1", "k_start > q_end"), "ex2",
      "causal_block_skip"),
    M("d", "forward_no_scale", D2_S, "s = q_i @ k_j.transpose(-2, -1)  # [B, H, bq, bk]", "ex2", "missing_scale"),
    M("d", "forward_scale_by_Ev", D2_SCALE, D2_SCALE.replace("math.sqrt(q.shape[-1])", "math.sqrt(v.shape[-1])"), "ex2",
      "wrong_scale"),
    M("d", "forward_times_sqrt_E", D2_SCALE, D2_SCALE.replace("1.0 / math.sqrt(q.shape[-1])", "math.sqrt(q.shape[-1])"),
      "ex2", "wrong_scale"),
    # q_i is a view of q (torch.split): scaling it in place scales the caller's q
    M("d", "forward_scales_q_tile_in_place", D2_S, "s = q_i @ k_j.transpose(-2, -1)  # [B, H, bq, bk]", "ex2",
      "mutates_input", ("        l_i = torch.zeros_like(m_i)\n",
                        "        l_i = torch.zeros_like(m_i)\n        q_i *= scale  # once per query tile\n")),
    # ex3: an [L, S] tensor after all
    M("d", "full_scores_for_the_max", D2_LOOP,
      "    row_max = (q @ k.transpose(-2, -1) * scale).amax(dim=-1, keepdim=True)  # [B, H, L, 1], known up front\n"
      "    outs, lses = [], []\n    for (q_start, q_i), m_start in zip(q_tiles, torch.split(row_max, block_q, dim=-2)):",
      "ex3", "scores_materialized",
      ('m_i = torch.full((*q_i.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device)', "m_i = m_start")),
    M("d", "scores_cut_into_tiles", D2_LOOP,
      "    scores = (q @ k.transpose(-2, -1)) * scale  # [B, H, L, S], read tile by tile below\n" + D2_LOOP, "ex3",
      "scores_materialized", (D2_S, "s = scores[..., q_start:q_end, k_start:k_end]  # [B, H, bq, bk]")),
    # ex4: the backward, query tiles outside, dK and dV accumulated across them
    M("d", "no_D_term", D4_DS, "ds = p * dp", "ex4", "backward_d_term"),
    M("d", "D_of_the_tile", D4_DS, "ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))", "ex4", "backward_d_term"),
    M("d", "D_without_keepdim", "D = (do * o).sum(dim=-1, keepdim=True)", "D = (do * o).sum(dim=-1)", "ex4", "keepdim"),
    M("d", "dq_dk_without_scale", D4_DQ, "dq_i = dq_i + ds @ k_j", "ex4", "backward_scale",
      (D4_DK, "dk_tiles[j] = dk_tiles[j] + ds.transpose(-2, -1) @ q_i")),
    M("d", "dk_without_scale", D4_DK, "dk_tiles[j] = dk_tiles[j] + ds.transpose(-2, -1) @ q_i", "ex4", "backward_scale"),
    M("d", "P_rebuilt_unscaled", "s = (q_i @ k_j.transpose(-2, -1)) * scale\n", "s = q_i @ k_j.transpose(-2, -1)\n", "ex4",
      "backward_scale"),
    M("d", "backward_unmasked", D4_MASK, "            p = torch.exp", "ex4", "backward_mask"),
    M("d", "dk_ds_T", D4_DK, "dk_tiles[j] = dk_tiles[j] + (ds.T @ q_i) * scale", "ex4", "wrong_transpose"),
    # ex5: the autograd Function
    M("d", "function_grads_swapped", "        return dq, dk, dv, None", "        return dk, dq, dv, None", "ex5", "order"),
    M("d", "function_saves_scores", "ctx.save_for_backward(q, k, v, o, lse)",
      "ctx.save_for_backward(q, k, v, o, lse, q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))", "ex5",
      "scores_materialized", ("q, k, v, o, lse = ctx.saved_tensors", "q, k, v, o, lse, scores = ctx.saved_tensors")),
    M("d", "function_backward_not_causal", "dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.is_causal)",
      "dq, dk, dv = flash_backward(q, k, v, o, lse, do)", "ex5", "causal_block_skip"),
]

# issue 48: the "c" mistakes the grader did not name when its author wrote them, named since
C_RESCALE = "rescale = torch.exp2(m_i - m_new)"
MUTANTS += [
    M("c", "max_never_updated", "            m_i = m_new\n            ks = ke", "            ks = ke", "ex2",
      "online_rescale"),
    M("c", "stale_max", "p = torch.exp2(s2 - m_new[..., None])", "p = torch.exp2(s2 - m_i[..., None])", "ex2",
      "online_rescale"),
    M("c", "rescale_inverted", C_RESCALE, "rescale = torch.exp2(m_new - m_i)", "ex2", "online_rescale"),
    M("c", "rescale_natural_exp", C_RESCALE, "rescale = torch.exp(m_i - m_new)", "ex2", "online_rescale"),
    M("c", "forward_forgets_log2e", "bits = LOG2E / math.sqrt(E)", "bits = 1.0 / math.sqrt(E)", "ex2", "wrong_scale"),
    M("c", "D_without_O", "delta = (do.float() * o.float()).sum(dim=-1)", "delta = do.float().sum(dim=-1)", "ex4",
      "backward_d_term"),
    M("c", "dv_scaled", "dv_j += p.transpose(-2, -1) @ do_i", "dv_j += (p.transpose(-2, -1) @ do_i) * scale", "ex4",
      "backward_scale"),
    M("c", "lse_not_in_base_2", "lse2 = lse.float() * LOG2E", "lse2 = lse.float()", "ex4", "lse_saved"),
    M("c", "function_forward_not_causal", "o, lse = flash_forward(q, k, v, is_causal)",
      "o, lse = flash_forward(q, k, v)", "ex5", "causal_block_skip"),
]
MUTANTS += [
    M("d", "lse_left_a_column", "torch.cat(lses, dim=-2).squeeze(-1)", "torch.cat(lses, dim=-2)", "ex2", "lse_saved"),
]
# issue 62, item 5's first held-out corpus: classes it left unnamed, now bug models (attnlab.bugmodels) or
# error-line rules (attnlab.grading.errors)
A4_P = "p = torch.exp(s - lse[:, :, qs:qe, None])  # [B, H, bq, bk]"
MUTANTS += [
    M("a", "backward_scale_over_E", "    scale = 1.0 / math.sqrt(E)\n    D = (do", "    scale = 1.0 / E\n    D = (do",
      "ex4", "wrong_scale"),
    M("a", "ds_sign_flipped", A4_DS, "ds = p * (D[:, :, qs:qe, None] - dp)", "ex4", "softmax_backward"),
    M("a", "D_from_do_do", "D = (do * o).sum(dim=-1)  # [B, H, L]", "D = (do * do).sum(dim=-1)  # [B, H, L]", "ex4",
      "backward_d_term"),
    M("a", "dk_from_p", A4_DK, "dk[:, :, ks:ke] += (p.transpose(-2, -1) @ q_i) * scale", "ex4", "softmax_backward"),
    M("a", "p_divided_by_lse", A4_P, "p = torch.exp(s) / lse[:, :, qs:qe, None]  # [B, H, bq, bk]", "ex4", "backward_p"),
    M("a", "backward_mask_inverted", '                    s = s.masked_fill(~mask, float("-inf"))\n            p = torch.exp(s - lse',
      '                    s = s.masked_fill(mask, float("-inf"))\n            p = torch.exp(s - lse', "ex4", "backward_mask"),
    M("a", "dq_from_v", A4_DQ, "dq[:, :, qs:qe] += (ds @ v_j) * scale", "ex4", "backward_operand"),
    M("a", "lse_by_key_tile", A4_P, "p = torch.exp(s - lse[:, :, ks:ke, None])  # [B, H, bq, bk]", "ex4", "wrong_axis"),
]
MUTANTS += [
    # issue 62, item 2: the tiled forward's running max taken over the whole tile (every row's): ex2 scored it
    # whole until a case with rows of very different scale
    M("a", "forward_block_max", "m_new = torch.maximum(m_i, s.amax(dim=-1))",
      "m_new = torch.maximum(m_i, s.amax(dim=(-2, -1))[..., None].expand_as(m_i))", "ex2", "block_max"),
]
MUTANTS += [
    # the first held-out corpus: the Function's backward with O and dO swapped, or three gradients for four inputs
    M("a", "function_o_do_swapped", "dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.is_causal)",
      "dq, dk, dv = flash_backward(q, k, v, do, lse, o, ctx.is_causal)", "ex5", "order"),
    M("a", "function_three_gradients", "        return dq, dk, dv, None  # no gradient for is_causal",
      "        return dq, dk, dv", "ex5", "order"),
]


MUTANTS += [  # issue 62's third held-out corpus: named by what the gradients are made of (bugmodels.flash_fits)
    M("a", "D_einsum_typo", "D = (do * o).sum(dim=-1)  # [B, H, L]", 'D = torch.einsum("bhld,bhmd->bhl", do, o)  # [B, H, L]',
      "ex4", "backward_d_term"),
    M("a", "query_loop_short_of_the_partial_tile", "        for qs in range(0, L, block_q):\n            qe = min(qs + block_q, L)\n            if is_causal and ks",
      "        for qs in range(0, L - block_q + 1, block_q):\n            qe = min(qs + block_q, L)\n            if is_causal and ks", "ex4",
      "dropped_tile"),
    M("a", "p_from_the_tiles_largest_lse", "p = torch.exp(s - lse[:, :, qs:qe, None])  # [B, H, bq, bk]",
      "p = torch.exp(s - lse[:, :, qs:qe, None].amax(dim=-2, keepdim=True))  # [B, H, bq, bk]", "ex4", "backward_p"),
]
MUTANTS += [  # issue 62's fourth held-out corpus: a softmax per key tile, the causal mask's rows offset by one
    M("a", "p_renormalised_per_tile", "            dv[:, :, ks:ke] += p.transpose(-2, -1) @ do_i",
      "            p = p / p.sum(dim=-1, keepdim=True)\n            dv[:, :, ks:ke] += p.transpose(-2, -1) @ do_i", "ex4",
      "backward_p"),
    M("a", "backward_mask_rows_offset_by_one", "mask = causal_block_mask(qs, qe, ks, ke)\n                if mask is not None:\n"
      "                    s = s.masked_fill(~mask, float(\"-inf\"))\n            p = torch.exp",
      "mask = causal_block_mask(qs + 1, qe + 1, ks, ke)\n                if mask is not None:\n"
      "                    s = s.masked_fill(~mask, float(\"-inf\"))\n            p = torch.exp", "ex4", "off_by_one"),
]
