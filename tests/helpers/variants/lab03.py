"""Lab 03's buggy variants, as data for tests/labs/test_every_lab.py: each is a list of
edits to the lab's solution and the (exercise, code) it must be named by; every code at least
twice over all variants (:data:`NAMED`: the codes the lab must name)."""

LAB = "03-multi-head"
SEED = 5
NAMED = {"heads_mixed", "gqa_group_mapping", "causal_alignment", "missing_out_proj", "wrong_scale",
         "kv_cache_order"}
WALKTHROUGH = ("head 1 of position 0: [4.0, 5.0, 6.0, 7.0]", "[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]",
               "cache length: 7",
               "max |cached decoding - full causal forward|")  # printed by the walkthrough run on the solution

SPLIT = "return x.view(B, L, H, D // H).transpose(1, 2)  # [B, L, H, E] -> [B, H, L, E]"
MERGE = "return x.transpose(1, 2).reshape(B, L, H * E)  # [B, L, H, E] -> [B, L, D]"
OUT_PROJ = "return merge_heads(softmax_last(scores) @ v) @ W_O"
MHA_SCALE = ("    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, L, L]")
REPEAT = "return kv.repeat_interleave(groups, dim=1)"
GQA_REPEAT = "k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # [B, H, S, E]"
CACHE_MASK = "mask = torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=P)  # query i sees keys 0 .. P + i"
CACHE_CAT = "k = torch.cat([k_cache, k_new], dim=2)  # [B, H, P + L, E]"

# one mistake per exercise in each variant (ex3 calls split/merge_heads, so those stay right there)
VARIANTS = {
    "A": ([(SPLIT, "return x.reshape(B, H, L, D // H)"),
           (MERGE, "return x.reshape(B, L, H * E)"),
           (REPEAT, "return kv.repeat(1, groups, 1, 1)"),
           (CACHE_MASK, "mask = torch.ones(L, P + L, dtype=torch.bool).tril()")],
          [("ex1", "heads_mixed"), ("ex2", "heads_mixed"), ("ex4", "gqa_group_mapping"), ("ex6", "causal_alignment")]),
    "B": ([(OUT_PROJ, "return merge_heads(softmax_last(scores) @ v)"),
           (GQA_REPEAT, "k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)"),
           (CACHE_MASK, "mask = torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=0)")],
          [("ex3", "missing_out_proj"), ("ex5", "gqa_group_mapping"), ("ex6", "causal_alignment")]),
    "C": ([(MHA_SCALE, "    scores = q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1])"),
           (CACHE_CAT, "k = torch.cat([k_new, k_cache], dim=2)"),
           ("v = torch.cat([v_cache, v_new], dim=2)", "v = torch.cat([v_new, v_cache], dim=2)")],
          [("ex3", "wrong_scale"), ("ex6", "kv_cache_order")]),
    "D": ([(MHA_SCALE, "    scores = q @ k.transpose(-2, -1) / math.sqrt(W_Q.shape[0])"),
           (REPEAT, "return torch.cat([kv] * groups, dim=1)"),
           (CACHE_CAT, "k = torch.cat((k_new, k_cache), 2)"),
           ("v = torch.cat([v_cache, v_new], dim=2)", "v = torch.cat((v_new, v_cache), 2)")],
          [("ex3", "wrong_scale"), ("ex4", "gqa_group_mapping"), ("ex6", "kv_cache_order")]),
    "E": ([(OUT_PROJ, "y = merge_heads(softmax_last(scores) @ v)\n    return y"),
           (GQA_REPEAT, "k, v = torch.cat([k] * groups, 1), torch.cat([v] * groups, 1)")],
          [("ex3", "missing_out_proj"), ("ex5", "gqa_group_mapping")]),
    "F": ([(SPLIT, "return x.view(B, L, D // H, H).permute(0, 3, 1, 2)"),
           (MERGE, "return x.view(B, L, H * E)")],
          [("ex1", "heads_mixed"), ("ex2", "heads_mixed")]),
}
