"""Lab 04's buggy variants, as data for tests/labs/test_every_lab.py: each is a list of
edits to the lab's solution and the (exercise, code) it must be named by; every code at least
twice over all variants (:data:`NAMED`: the codes the lab must name)."""

LAB = "04-flash-attention"
SEED = 5
NAMED = {"online_rescale", "lse_saved", "causal_block_skip", "backward_d_term", "scores_materialized"}
# printed by the walkthrough run on the solution
WALKTHROUGH = ("running max after each block", "max |tiled - SDPA|", "max |gradient - autograd|")

EX1_SUM = "        l_i = l_i * torch.exp(m_i - m_safe) + torch.exp(chunk - m_safe[:, None]).sum(dim=-1)"
ACC = "            acc = acc * alpha[..., None] + p @ v[:, :, ks:ke]"
L_SUM = "            l_i = l_i * alpha + p.sum(dim=-1)"
LSE = "        lse[:, :, qs:qe] = m_i + torch.log(l_i)"
K_STOP = "        k_stop = min(S, qe) if is_causal else S"
FWD_SCORES = "            s = q_i @ k[:, :, ks:ke].transpose(-2, -1)  # [B, H, bq, bk]\n"
BWD_SCORES = "            s = (q_i @ k_j.transpose(-2, -1)) * scale  # [B, H, bq, bk]\n"
MASKING = ("            if is_causal:\n                mask = causal_block_mask(qs, qe, ks, ke)\n"
           "                if mask is not None:\n                    s = s.masked_fill(~mask, float(\"-inf\"))\n")
DIAG = "    return cols <= rows"
D_TERM = "            ds = p * (dp - D[:, :, qs:qe, None])"
DQ = "            dq[:, :, qs:qe] += (ds @ k_j) * scale"
DK = "            dk[:, :, ks:ke] += (ds.transpose(-2, -1) @ q_i) * scale"
SAVE = "        ctx.save_for_backward(q, k, v, o, lse)"
UNPACK = ("        q, k, v, o, lse = ctx.saved_tensors", "        q, k, v, o, lse = ctx.saved_tensors[:5]")

# one mistake per exercise in each variant
VARIANTS = {
    "A": ([(EX1_SUM, "        l_i = l_i + torch.exp(chunk - m_safe[:, None]).sum(dim=-1)"),
           (ACC, "            acc = acc + p @ v[:, :, ks:ke]"),
           (D_TERM, "            ds = p * dp")],
          [("ex1", "online_rescale"), ("ex2", "online_rescale"), ("ex4", "backward_d_term")]),
    "B": ([(EX1_SUM, "        l_i = l_i * torch.exp(m_safe - m_i) + torch.exp(chunk - m_safe[:, None]).sum(dim=-1)"),
           (L_SUM, "            l_i = l_i + p.sum(dim=-1)"),
           ("    D = (do * o).sum(dim=-1)  # [B, H, L]", "    D = torch.zeros_like(lse)  # [B, H, L]")],
          [("ex1", "online_rescale"), ("ex2", "online_rescale"), ("ex4", "backward_d_term")]),
    "C": ([(LSE, "        lse[:, :, qs:qe] = m_i + torch.log2(l_i)"),
           (DQ, "            dq[:, :, qs:qe] += ds @ k_j"), (DK, "            dk[:, :, ks:ke] += ds.transpose(-2, -1) @ q_i")],
          [("ex2", "lse_saved"), ("ex4", "backward_scale")]),
    "D": ([(LSE, "        lse[:, :, qs:qe] = m_i"),
           (DQ, "            dq[:, :, qs:qe] += torch.matmul(ds, k_j)"),
           (DK, "            dk[:, :, ks:ke] += torch.matmul(ds.transpose(-2, -1), q_i)"),
           (SAVE, "        ctx.save_for_backward(q, k, v, o, lse, q @ k.transpose(-2, -1))"), UNPACK],
          [("ex2", "lse_saved"), ("ex4", "backward_scale"), ("ex5", "scores_materialized")]),
    "E": ([(FWD_SCORES + MASKING, FWD_SCORES), (BWD_SCORES + MASKING, BWD_SCORES)],
          [("ex2", "causal_block_skip"), ("ex4", "backward_mask")]),
    # the backward alone rebuilds P without the causal mask (the forward masks)
    "E2": ([(BWD_SCORES + MASKING, BWD_SCORES)], [("ex4", "backward_mask")]),
    "F": ([(K_STOP, "        k_stop = min(S, qs) if is_causal else S"),
           (FWD_SCORES, "            s = (q * scale @ k.transpose(-2, -1))[:, :, qs:qe, ks:ke]  # [B, H, bq, bk]\n")],
          [("ex2", "causal_block_skip"), ("ex3", "scores_materialized")]),
    "G": ([(DIAG, "    return cols < rows"),
           ("    scale = 1.0 / math.sqrt(E)\n    o = torch.empty",
            "    scale = 1.0 / math.sqrt(E)\n    scores = q @ k.transpose(-2, -1)  # [B, H, L, S]: never used\n"
            "    o = torch.empty")],
          [("ex2", "off_by_one"), ("ex3", "scores_materialized")]),
    "H": ([(DIAG, "    return rows - cols >= 1"),
           (LSE, "        lse[:, :, qs:qe] = (m_i + torch.log(l_i)) / math.log(2)"),
           (SAVE, "        p = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - lse[..., None])\n"
                  "        ctx.save_for_backward(q, k, v, o, lse, p)"), UNPACK],
          [("ex2", "off_by_one"), ("ex2", "lse_saved"), ("ex5", "scores_materialized")]),
    # every tile computed, the future ones masked to -inf: right answers, but the work (and 0 x NaN)
    # of the tiles it should skip
    "I": ([(K_STOP, "        k_stop = S")], [("ex2", "causal_block_skip")]),
    # the same loop with V's NaN cleaned first (a seventh attacker's road past the skip check): one NaN
    # at a key the later queries attend to must reach them, and does not
    "I2": ([(K_STOP, "        k_stop = S"),
            ("    lse = torch.empty(B, H, L, dtype=q.dtype)\n",
             "    lse = torch.empty(B, H, L, dtype=q.dtype)\n    v = v.nan_to_num()\n")],
           [("ex2", "causal_block_skip")]),
}
