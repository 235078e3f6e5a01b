"""Lab 02's buggy variants, as data for tests/labs/test_every_lab.py: each is a list of
edits to the lab's solution and the (exercise, code) it must be named by; every code at least
twice over all variants (:data:`NAMED`: the codes the lab must name)."""

LAB = "02-masks"
SEED = 11
NAMED = {"mask_polarity", "off_by_one", "causal_alignment", "causal_future", "mask_after_softmax", "fully_masked_nan",
         "padding_query_side", "mask_combined_or"}
# printed by the walkthrough run on the solution
WALKTHROUGH = ("# # # . .", "max |yours - torch SDPA|")

EX1 = "return torch.ones(L, S, dtype=torch.bool).tril()"
EX2 = "return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)"
EX3 = "return (torch.arange(S) < lengths[:, None])[:, None, None, :]"
EX4 = "return a & b"
EX5_GUARD = "    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # an empty row: no -inf - -inf\n"
EX5_DIV = "return e / torch.where(total == 0, torch.ones_like(total), total)"
EX6 = "return (~key_padding_mask)[:, None, None, :]"
EX7 = "scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])"
EX5_BODY = ('''    s = scores.masked_fill(~mask, float("-inf"))\n''' + "    m = s.amax(dim=-1, keepdim=True)\n" + EX5_GUARD
            + "    e = torch.exp(s - m)\n    total = e.sum(dim=-1, keepdim=True)\n    " + EX5_DIV)
SOFTMAX_THEN_MASK = ("    m = scores.amax(dim=-1, keepdim=True)\n    e = torch.exp(scores - m)\n"
                     "    w = e / e.sum(dim=-1, keepdim=True)\n    return {}")

# each variant: edits, and the (exercise, code) each must name; every code at least twice overall
VARIANTS = {
    "A": ([(EX1, "return ~torch.ones(L, S, dtype=torch.bool).tril()"),
           (EX2, "return torch.ones(L, S, dtype=torch.bool).tril()"),
           (EX3, "return (torch.arange(S) < lengths[:, None])[:, None, :, None]"),
           (EX4, "return a | b"),
           (EX5_BODY, SOFTMAX_THEN_MASK.format("w * mask")),
           (EX6, "return key_padding_mask[:, None, None, :]")],
          [("ex1", "mask_polarity"), ("ex2", "causal_alignment"), ("ex3", "padding_query_side"),
           ("ex4", "mask_combined_or"), ("ex5", "mask_after_softmax"), ("ex6", "mask_polarity")]),
    "B": ([(EX1, "return torch.ones(L, S, dtype=torch.bool).triu()"),
           (EX2, "return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L + 1)"),
           (EX3, "return (torch.arange(S) <= lengths[:, None])[:, None, None, :]"),
           (EX4, "return torch.logical_or(a, b)"),
           (EX5_GUARD, ""), (EX5_DIV, "return e / total")],
          [("ex1", "causal_future"), ("ex2", "off_by_one"), ("ex3", "off_by_one"), ("ex4", "mask_combined_or"),
           ("ex5", "fully_masked_nan")]),
    "C": ([(EX1, "return torch.ones(L, S, dtype=torch.bool).tril(-1)"),
           (EX2, "return ~torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)"),
           (EX3, "return (torch.arange(S) < lengths[:, None]).unsqueeze(1).unsqueeze(-1)"),
           (EX5_BODY, SOFTMAX_THEN_MASK.format("torch.where(mask, w, torch.zeros_like(w))")),
           (EX6, "return key_padding_mask.unsqueeze(1).unsqueeze(1)")],
          [("ex1", "off_by_one"), ("ex2", "mask_polarity"), ("ex3", "padding_query_side"),
           ("ex5", "mask_after_softmax"), ("ex6", "mask_polarity")]),
    "D": ([(EX2, "return torch.ones(L, S, dtype=torch.bool).triu(diagonal=S - L)"),
           (EX1, "return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)"),
           (EX3, "return (torch.arange(S) >= lengths[:, None])[:, None, None, :]"),
           (EX5_DIV, "return e / total"), (EX5_GUARD, ""),
           (EX7, "scores = Q @ K.transpose(-2, -1)")],
          [("ex1", "causal_alignment"), ("ex2", "causal_future"), ("ex3", "mask_polarity"),
           ("ex5", "fully_masked_nan")]),
}
