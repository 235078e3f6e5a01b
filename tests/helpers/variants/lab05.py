"""Lab 05's buggy variants (several mistakes at once, across exercises), as data for
tests/labs/test_every_lab.py; the single mistakes are in tests/corpus/lab05.py, whose edits
these reuse."""

from corpus.lab05 import (B_ACC, B_DK, B_DS, B_DV, B_GROUP, D_SUM, F_ACC, F_DIAG, F_GQA, F_K, F_L, F_LSE, F_SEEN,
                          F_STOP, F_V)

LAB = "05-triton-flash"
SEED = 5
NAMED = {"online_rescale", "lse_saved", "causal_block_skip", "load_mask", "backward_d_term", "accumulate_dtype",
         "gqa_group_mapping", "gqa_grad_sum", "causal_alignment"}
# printed by the walkthrough run on the solution
WALKTHROUGH = ("max |O - SDPA|", "is_causal=True", "max |dv - torch|", "GQA: max |O - SDPA|",
               # issue 48 item 7: the tile grid one program covers, and its m_i, l_i, acc tile by tile
               "program pid_q = 1: queries 16..31, is_causal", "<- this program", "tile max", "alpha",
               "your kernel's O")

NO_MASK = ", mask=keys[:, None] < S, other=0.0"
FP16_ACC = [(B_ACC, "dk = tl.zeros([BK, E], K.dtype.element_ty)\n    dv = tl.zeros([BK, E], V.dtype.element_ty)"),
            (B_DV, "dv += tl.dot(tl.trans(p), do.to(tl.float32)).to(V.dtype.element_ty)"),
            (B_DK, "dk += (tl.dot(tl.trans(ds), q.to(tl.float32)) * scale).to(K.dtype.element_ty)")]

BR_KV = "            if CAUSAL:\n                seen = seen & (keys[None, :] <= rows[:, None])\n            p = tl.where"
BR_Q = "        if CAUSAL:\n            seen = seen & (keys[None, :] <= rows[:, None])\n        p = tl.where"
GROUP_HEAD = "for g in range(0, r):\n        bh = b * H + hk * r + g"
DQ_HEAD = "    bhk = b * Hkv + h // (H // Hkv)\n    rows"

VARIANTS = {
    "A": ([(F_ACC, "acc = acc + tl.dot(p, v.to(tl.float32))"),
           (D_SUM, "tl.store(D + bh * L + rows, tl.sum(do, 1), mask=rows < L)")],
          [("ex1", "online_rescale"), ("ex4", "backward_d_term")]),
    "B": ([(F_L, "l_i = l_i + tl.sum(p, 1)"),
           (B_DS + "\n            dk", "ds = p * dp\n            dk"), (B_DS + "\n        dq", "ds = p * dp\n        dq")],
          [("ex1", "online_rescale"), ("ex5", "backward_d_term")]),
    "C": ([(F_GQA, "bhk = b * Hkv + h % Hkv  # ex7")] + FP16_ACC,
          [("ex5", "accumulate_dtype"), ("ex7", "gqa_group_mapping")]),
    "D": ([(F_LSE, "lse = m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))"),
           (F_STOP, F_STOP.replace("tl.minimum(S, (pid_q + 1) * BQ)", "S")),
           (F_SEEN, "seen = keys[None, :] <= S  # ex3: keys past the end are not keys"),
           (F_K, F_K.replace("mask=keys[:, None] < S", "mask=keys[:, None] <= S")),
           (F_V, F_V.replace("mask=keys[:, None] < S", "mask=keys[:, None] <= S"))] + FP16_ACC,
          [("ex1", "lse_saved"), ("ex2", "causal_block_skip"), ("ex3", "load_mask"), ("ex5", "accumulate_dtype")]),
    # the forward's causal mistake breaks ex7's (causal) forward too; its backward is named on its own
    "E": ([(F_LSE, "lse = m_i"), (F_DIAG, ""), (B_GROUP, "for g in range(0, 1):")],
          [("ex1", "lse_saved"), ("ex2", "causal_block_skip"), ("ex7", "gqa_grad_sum")]),
    "F": ([(F_V, F_V.replace(NO_MASK, ""))], [("ex3", "load_mask")]),
    # dK/dV's accumulators zeroed again for each query head of the group: the last head's share stays
    "G": ([(GROUP_HEAD, "for g in range(0, r):\n        dk = tl.zeros([BK, E], tl.float32)\n"
                        "        dv = tl.zeros([BK, E], tl.float32)\n        bh = b * H + hk * r + g")],
          [("ex7", "gqa_grad_sum")]),
    # the dQ kernel reads key/value head h % Hkv (the forward's is right)
    "H": ([(DQ_HEAD, "    bhk = b * Hkv + h % Hkv\n    rows")],
          [("ex7", "gqa_group_mapping")]),
    # the backward's causal mask aligned bottom-right (j <= i + S - L), in both kernels and in the dK/dV one
    # alone: invisible on square cases, it scored 100 in ex5 before its rectangular causal cases (issue 62)
    "I": ([(BR_KV, BR_KV.replace("rows[:, None])", "rows[:, None] + S - L)")),
           (BR_Q, BR_Q.replace("rows[:, None])", "rows[:, None] + S - L)"))], [("ex5", "causal_alignment")]),
    "J": ([(BR_KV, BR_KV.replace("rows[:, None])", "rows[:, None] + S - L)"))], [("ex5", "causal_alignment")]),
    # the dQ kernel visits every key tile and cleans K and V of NaN (tl.where(v == v, v, 0)): right values,
    # and the skip case's NaN never shows; one NaN at a key the later queries see must reach their dq
    "S2": ([("dq = tl.zeros([BQ, E], tl.float32)\n    stop = S\n    if CAUSAL:\n        stop = tl.minimum(S, (pid_q + 1) * BQ)\n",
             "dq = tl.zeros([BQ, E], tl.float32)\n    stop = S\n"),
            ("        dp = tl.dot(do.to(tl.float32), tl.trans(v.to(tl.float32)))\n        ds = p * (dp - d[:, None])\n",
             "        k = tl.where(k == k, k, 0.0)\n        v = tl.where(v == v, v, 0.0)\n"
             "        dp = tl.dot(do.to(tl.float32), tl.trans(v.to(tl.float32)))\n        ds = p * (dp - d[:, None])\n")],
           [("ex5", "causal_block_skip")]),
}
