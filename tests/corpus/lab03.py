"""Lab 03's mistakes, on the instructor's solution (``a``: view/transpose, repeat_interleave,
tril(diagonal=P)) and on an independent one (``b``: permute, einsum, expand + reshape, index
comparisons).
Solution ``c`` (issue 48, independent): one fused projection, unflatten/swapaxes, queries
grouped under their KV head."""

from corpus import M

LAB = "03-multi-head"
SOLUTIONS = {"a": "labs/track1/03-multi-head/solutions/multihead.py", "b": "tests/corpus/lab03_b.py"}

A_SPLIT = "return x.view(B, L, H, D // H).transpose(1, 2)"
A_MERGE = "return x.transpose(1, 2).reshape(B, L, H * E)"
A_QKV = "q, k, v = (split_heads(x @ W, H) for W in (W_Q, W_K, W_V))"
A_SCORES3 = "    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, L, L]\n"
A_MASK3 = '        scores = scores.masked_fill(~mask, float("-inf"))\n    return merge_heads'
A_OUT3 = "return merge_heads(softmax_last(scores) @ v) @ W_O"
A_GQA = "    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])\n    return softmax_last(scores) @ v\n"
A_CACHE = "mask = torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=P)"
B_SPLIT = "return x.reshape(B, L, H, E).permute(0, 2, 1, 3)"
B_MERGE = "return x.permute(0, 2, 1, 3).reshape(B, L, H * E)"
B_SCORES3 = 'scores = torch.einsum("bhle,bhse->bhls", q, k) / math.sqrt(head_dim)'
B_WHERE3 = 'scores = torch.where(mask, scores, torch.full_like(scores, float("-inf")))'
B_GQA = 'scores = torch.einsum("bhle,bhse->bhls", q, k) * q.size(-1) ** -0.5'
B_POS = "position = torch.arange(L)[:, None] + P"

MUTANTS = [
    # ------------------------------------------------------------------ a
    M("a", "split_without_transpose", A_SPLIT, "return x.reshape(B, H, L, D // H)", "ex1", "heads_mixed"),
    M("a", "split_strided", A_SPLIT, "return x.view(B, L, D // H, H).permute(0, 3, 1, 2)", "ex1", "heads_mixed"),
    M("a", "merge_without_transpose", A_MERGE, "return x.reshape(B, L, H * E)", "ex2", "heads_mixed"),
    M("a", "merge_head_last", A_MERGE, "return x.permute(0, 2, 3, 1).reshape(B, L, H * E)", "ex2", "heads_mixed"),
    M("a", "no_out_proj", A_OUT3, "return merge_heads(softmax_last(scores) @ v)", "ex3", "missing_out_proj"),
    M("a", "scale_by_model_size", A_SCORES3, "    scores = q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1])\n",
      "ex3", "wrong_scale"),
    M("a", "no_scale", A_SCORES3, "    scores = q @ k.transpose(-2, -1)\n", "ex3", "missing_scale"),
    M("a", "mask_inverted", A_MASK3, '        scores = scores.masked_fill(mask, float("-inf"))\n    return merge_heads',
      "ex3", "mask_polarity"),
    M("a", "mask_ignored", "    if mask is not None:\n        scores = scores.masked_fill", "    if False:\n        scores = scores.masked_fill",
      "ex3", "mask_ignored"),
    M("a", "k_v_projections_swapped", A_QKV, "q, k, v = (split_heads(x @ W, H) for W in (W_Q, W_V, W_K))", "ex3",
      "order"),
    M("a", "values_from_W_K", A_QKV, "q, k, v = (split_heads(x @ W, H) for W in (W_Q, W_K, W_K))", "ex3",
      "value_swapped"),
    M("a", "layer_softmax_over_queries", A_OUT3,
      "return merge_heads(softmax_last(scores.transpose(-2, -1)).transpose(-2, -1) @ v) @ W_O", "ex3", "softmax_dim"),
    M("a", "repeat_tiles", "return kv.repeat_interleave(groups, dim=1)", "return kv.repeat(1, groups, 1, 1)", "ex4",
      "gqa_group_mapping"),
    M("a", "cat_tiles", "return kv.repeat_interleave(groups, dim=1)", "return torch.cat([kv] * groups, dim=1)", "ex4",
      "gqa_group_mapping"),
    M("a", "gqa_tiled_inline", "k, v = repeat_kv(k, groups), repeat_kv(v, groups)",
      "k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)", "ex5", "gqa_group_mapping"),
    M("a", "gqa_no_scale", A_GQA, "    scores = q @ k.transpose(-2, -1)\n    return softmax_last(scores) @ v\n", "ex5",
      "missing_scale"),
    M("a", "gqa_scale_by_Ev", A_GQA, "    scores = q @ k.transpose(-2, -1) / math.sqrt(v.shape[-1])\n"
      "    return softmax_last(scores) @ v\n", "ex5", "wrong_scale"),
    M("a", "gqa_softmax_over_queries", A_GQA, "    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
      "    return softmax_last(scores.transpose(-2, -1)).transpose(-2, -1) @ v\n", "ex5", "softmax_dim"),
    M("a", "cache_appended_first", "k = torch.cat([k_cache, k_new], dim=2)", "k = torch.cat([k_new, k_cache], dim=2)",
      "ex6", "kv_cache_order", ("v = torch.cat([v_cache, v_new], dim=2)", "v = torch.cat([v_new, v_cache], dim=2)")),
    M("a", "cache_mask_top_left", A_CACHE, "mask = torch.ones(L, P + L, dtype=torch.bool).tril()", "ex6",
      "causal_alignment"),
    M("a", "cache_mask_off_by_one", A_CACHE, "mask = torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=P - 1)",
      "ex6", "off_by_one"),
    M("a", "cache_mask_sees_next", A_CACHE, "mask = torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=P + 1)",
      "ex6", "off_by_one"),
    M("a", "cache_mask_diagonal_L", A_CACHE, "mask = torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=L)",
      "ex6", "causal_alignment"),
    M("a", "cache_mask_inverted", A_CACHE, "mask = ~torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=P)", "ex6",
      "mask_polarity"),
    M("a", "cache_mask_triu", A_CACHE, "mask = torch.ones(L, P + L, dtype=torch.bool).triu(diagonal=P)", "ex6",
      "causal_future"),
    M("a", "cache_no_mask", '.masked_fill(~mask, float("-inf"))\n    return softmax_last', "\n    return softmax_last",
      "ex6", "mask_ignored"),
    # ------------------------------------------------------------------ b
    M("b", "split_without_permute", B_SPLIT, "return x.reshape(B, H, L, E)", "ex1", "heads_mixed"),
    M("b", "split_strided", B_SPLIT, "return x.reshape(B, L, E, H).permute(0, 3, 1, 2)", "ex1", "heads_mixed"),
    M("b", "merge_without_permute", B_MERGE, "return x.reshape(B, L, H * E)", "ex2", "heads_mixed"),
    M("b", "merge_head_last", B_MERGE, "return x.permute(0, 2, 3, 1).reshape(B, L, H * E)", "ex2", "heads_mixed"),
    M("b", "scale_by_model_size", "head_dim = q.shape[-1]", "head_dim = x.shape[-1]", "ex3", "wrong_scale"),
    M("b", "no_out_proj", "return merge_heads(heads) @ W_O", "return merge_heads(heads)", "ex3", "missing_out_proj"),
    M("b", "mask_where_swapped", B_WHERE3, 'scores = torch.where(mask, torch.full_like(scores, float("-inf")), scores)',
      "ex3", "mask_polarity"),
    M("b", "no_scale", B_SCORES3, 'scores = torch.einsum("bhle,bhse->bhls", q, k)', "ex3", "missing_scale"),
    M("b", "mask_dropped", B_WHERE3, "pass", "ex3", "mask_ignored"),
    M("b", "values_from_W_K", "v = split_heads(x @ W_V, H)", "v = split_heads(x @ W_K, H)", "ex3", "value_swapped"),
    M("b", "values_from_W_Q", "v = split_heads(x @ W_V, H)", "v = split_heads(x @ W_Q, H)", "ex3", "value_swapped"),
    M("b", "k_v_projections_swapped", "k = split_heads(x @ W_K, H)", "k = split_heads(x @ W_V, H)", "ex3", "order",
      ("v = split_heads(x @ W_V, H)", "v = split_heads(x @ W_K, H)")),
    M("b", "softmax_over_queries", 'heads = torch.einsum("bhls,bhse->bhle", softmax_last(scores), v)',
      'heads = torch.einsum("bhls,bhse->bhle", softmax_last(scores.transpose(-1, -2)).transpose(-1, -2), v)', "ex3",
      "softmax_dim"),
    M("b", "repeat_expands_groups_first", "return kv[:, :, None, :, :].expand(B, Hkv, groups, S, E)",
      "return kv[:, None, :, :, :].expand(B, groups, Hkv, S, E)", "ex4", "gqa_group_mapping"),
    M("b", "repeat_tiles", "return kv[:, :, None, :, :].expand(B, Hkv, groups, S, E).reshape(B, Hkv * groups, S, E)",
      "return kv.repeat(1, groups, 1, 1)", "ex4", "gqa_group_mapping"),
    M("b", "gqa_no_scale", B_GQA, 'scores = torch.einsum("bhle,bhse->bhls", q, k)', "ex5", "missing_scale"),
    M("b", "gqa_times_sqrt_E", B_GQA, 'scores = torch.einsum("bhle,bhse->bhls", q, k) * q.size(-1) ** 0.5', "ex5",
      "wrong_scale"),
    M("b", "gqa_scale_by_L", B_GQA, 'scores = torch.einsum("bhle,bhse->bhls", q, k) * q.size(-2) ** -0.5', "ex5",
      "wrong_scale"),
    M("b", "gqa_tiled_inline", "    k = repeat_kv(k, groups)\n    v = repeat_kv(v, groups)\n",
      "    k = torch.cat([k] * groups, dim=1)\n    v = torch.cat([v] * groups, dim=1)\n", "ex5", "gqa_group_mapping"),
    M("b", "cache_no_offset", B_POS, "position = torch.arange(L)[:, None]", "ex6", "causal_alignment"),
    M("b", "cache_strict", "visible = torch.arange(S)[None, :] <= position",
      "visible = torch.arange(S)[None, :] < position", "ex6", "off_by_one"),
    M("b", "cache_one_ahead", B_POS, "position = torch.arange(L)[:, None] + P + 1", "ex6", "off_by_one"),
    M("b", "cache_appended_first", "k = torch.cat((k_cache, k_new), dim=-2)", "k = torch.cat((k_new, k_cache), dim=-2)",
      "ex6", "kv_cache_order", ("v = torch.cat((v_cache, v_new), dim=-2)", "v = torch.cat((v_new, v_cache), dim=-2)")),
    M("b", "cache_mask_inverted", 'scores = scores.masked_fill(~visible, float("-inf"))',
      'scores = scores.masked_fill(visible, float("-inf"))', "ex6", "mask_polarity"),
    M("b", "cache_no_mask", '    scores = scores.masked_fill(~visible, float("-inf"))\n', "", "ex6", "mask_ignored"),
]

# ------------------------------------------------------------------ c
# a third independent solution: fused QKV projection cut with chunk, unflatten/swapaxes/flatten
# for the heads, queries scaled before the product, an additive -inf bias for the mask, repeat_kv
# as an index (arange // groups), GQA by grouping the query heads under their key/value head,
# and the cache's *blocked* entries as triu(P + 1)
SOLUTIONS["c"] = "tests/corpus/lab03_c.py"

C_SPLIT = "per_position = x.unflatten(-1, (H, x.shape[-1] // H))  # [B, L, H, E]"
C_MERGE = "per_position = x.swapaxes(1, 2)  # [B, L, H, E]"
C_QKV = "W_QKV = torch.cat([W_Q, W_K, W_V], dim=1)  # [D, 3D]"
C_SCALE3 = "    q = q * head_size ** -0.5\n"
C_BIAS = '        scores = scores + bias.masked_fill(mask.logical_not(), float("-inf"))\n'
C_HEADS = "heads = softmax_last(scores) @ v"
C_INDEX = "source = torch.arange(n_heads, device=kv.device) // groups"
C_GQA_SCALE = "    grouped = grouped * q.shape[-1] ** -0.5\n"
C_GQA_OUT = "out = softmax_last(scores) @ v.unsqueeze(2)"
C_FUTURE = "future = torch.ones(L, P + L, dtype=torch.bool, device=q.device).triu(P + 1)"
C_SCORES6 = "scores = (q * q.shape[-1] ** -0.5) @ keys.mT"
C_FILL6 = 'scores = scores.masked_fill(future, float("-inf"))'

MUTANTS += [
    M("c", "split_reshape_not_swap", "return per_position.swapaxes(1, 2)",
      "return per_position.reshape(x.shape[0], H, x.shape[1], -1)", "ex1", "heads_mixed"),
    M("c", "split_unflatten_head_last", C_SPLIT,
      "per_position = x.unflatten(-1, (x.shape[-1] // H, H)).mT  # [B, L, H, E]", "ex1", "heads_mixed"),
    M("c", "merge_reshape_not_swap", C_MERGE,
      "per_position = x.reshape(x.shape[0], x.shape[2], x.shape[1], -1)  # [B, L, H, E]", "ex2", "heads_mixed"),
    M("c", "merge_head_last", C_MERGE, "per_position = x.swapaxes(1, 2).mT  # [B, L, E, H]", "ex2", "heads_mixed"),
    M("c", "no_out_proj", "return merge_heads(heads) @ W_O", "return merge_heads(heads)", "ex3", "missing_out_proj"),
    M("c", "scale_by_model_size", "head_size = q.shape[-1]", "head_size = x.shape[-1]", "ex3", "wrong_scale"),
    M("c", "no_scale", C_SCALE3, "", "ex3", "missing_scale"),
    M("c", "fused_k_v_swapped", C_QKV, "W_QKV = torch.cat([W_Q, W_V, W_K], dim=1)  # [D, 3D]", "ex3", "order"),
    M("c", "fused_values_from_W_K", C_QKV, "W_QKV = torch.cat([W_Q, W_K, W_K], dim=1)  # [D, 3D]", "ex3",
      "value_swapped"),
    M("c", "mask_inverted", C_BIAS, '        scores = scores + bias.masked_fill(mask, float("-inf"))\n', "ex3",
      "mask_polarity"),
    M("c", "mask_fill_not_assigned", C_BIAS,
      '        bias.masked_fill(mask.logical_not(), float("-inf"))\n        scores = scores + bias\n', "ex3",
      "mask_ignored"),
    M("c", "softmax_over_queries", C_HEADS, "heads = softmax_last(scores.mT).mT @ v", "ex3", "softmax_dim"),
    M("c", "values_are_keys", C_HEADS, "heads = softmax_last(scores) @ k", "ex3", "value_swapped"),
    M("c", "keys_T", "scores = q @ k.mT  # [B, H, L, L]", "scores = q @ k.T  # [B, H, L, L]", "ex3", "wrong_transpose"),
    M("c", "repeat_modulo", C_INDEX, "source = torch.arange(n_heads, device=kv.device) % kv.shape[1]", "ex4",
      "gqa_group_mapping"),
    M("c", "gqa_groups_outer", "grouped = q.unflatten(1, (n_kv, -1))", "grouped = q.unflatten(1, (-1, n_kv))", "ex5",
      "gqa_group_mapping", ("k.unsqueeze(2).mT", "k.unsqueeze(1).mT"), ("v.unsqueeze(2)", "v.unsqueeze(1)")),
    M("c", "gqa_no_scale", C_GQA_SCALE, "", "ex5", "missing_scale"),
    M("c", "gqa_scale_by_Ev", C_GQA_SCALE, "    grouped = grouped * v.shape[-1] ** -0.5\n", "ex5", "wrong_scale"),
    M("c", "gqa_scale_by_E", C_GQA_SCALE, "    grouped = grouped / q.shape[-1]\n", "ex5", "wrong_scale"),
    M("c", "gqa_softmax_over_queries", C_GQA_OUT, "out = softmax_last(scores.mT).mT @ v.unsqueeze(2)", "ex5",
      "softmax_dim"),
    M("c", "gqa_values_are_keys", C_GQA_OUT, "out = softmax_last(scores) @ k.unsqueeze(2)", "ex5", "value_swapped"),
    M("c", "gqa_scales_q_in_place", C_GQA_SCALE, "    grouped *= q.shape[-1] ** -0.5\n", "ex5", "mutates_input"),
    M("c", "cache_appended_first", "keys = torch.cat((k_cache, k_new), dim=-2)",
      "keys = torch.cat((k_new, k_cache), dim=-2)", "ex6", "kv_cache_order",
      ("values = torch.cat((v_cache, v_new), dim=-2)", "values = torch.cat((v_new, v_cache), dim=-2)")),
    M("c", "cache_mask_top_left", C_FUTURE,
      "future = torch.ones(L, P + L, dtype=torch.bool, device=q.device).triu(1)", "ex6", "causal_alignment"),
    M("c", "cache_mask_offset_L", C_FUTURE,
      "future = torch.ones(L, P + L, dtype=torch.bool, device=q.device).triu(L + 1)", "ex6", "causal_alignment"),
    M("c", "cache_mask_blocks_diagonal", C_FUTURE,
      "future = torch.ones(L, P + L, dtype=torch.bool, device=q.device).triu(P)", "ex6", "off_by_one"),
    M("c", "cache_mask_sees_next", C_FUTURE,
      "future = torch.ones(L, P + L, dtype=torch.bool, device=q.device).triu(P + 2)", "ex6", "off_by_one"),
    M("c", "cache_blocks_past", C_FUTURE,
      "future = torch.ones(L, P + L, dtype=torch.bool, device=q.device).tril(P - 1)", "ex6", "causal_future"),
    M("c", "cache_mask_inverted", C_FILL6, 'scores = scores.masked_fill(~future, float("-inf"))', "ex6",
      "mask_polarity"),
    M("c", "cache_no_mask", "    " + C_FILL6 + "\n", "", "ex6", "mask_ignored"),
    M("c", "cache_scales_q_in_place", C_SCORES6, "q *= q.shape[-1] ** -0.5\n    scores = q @ keys.mT", "ex6",
      "mutates_input"),
]

# ------------------------------------------------------------------ d
# a fourth independent solution: an explicit loop over the heads that slices each head's features
# out of the projected tensor and joins the head outputs with torch.cat (merge_heads the same
# way), GQA by indexing key/value head h // group inside the loop, and the cache's mask from
# torch.arange positions (query P + i sees key j <= P + i)
SOLUTIONS["d"] = "tests/corpus/lab03_d.py"

D_SPLIT = "return x.view(B, L, H, E).transpose(1, 2)"
D_MERGE = "return torch.cat(pieces, dim=-1)"
D_SCORES3 = "scores = q_h @ k_h.transpose(-2, -1) / math.sqrt(E)  # [B, L, L]"
D_FILL3 = 'scores = scores.masked_fill(~mask[:, h], float("-inf"))'
D_CONCAT = "concat = torch.cat(outputs, dim=-1)"
D_SLICE = "start, end = h * E, (h + 1) * E"
D_G = "g = h // groups"
D_KH = "k_h = k[..., h // group, :, :]"
D_VH = "v_h = v[..., h // group, :, :]"
D_SCORES5 = "scores = q_h @ k_h.transpose(-2, -1) / math.sqrt(E)\n        outs"
D_OUT5 = "outs.append(softmax_last(scores) @ v_h)"
D_QPOS = "q_pos = P + torch.arange(L, device=q.device)"
D_KPOS = "k_pos = torch.arange(P + L, device=q.device)"
D_ALLOWED = "allowed = k_pos[None, :] <= q_pos[:, None]"
D_FILL6 = 'scores = scores.masked_fill(~allowed, float("-inf"))'

MUTANTS += [
    M("d", "split_view_heads_first", D_SPLIT, "return x.view(B, H, L, E)", "ex1", "heads_mixed"),
    M("d", "split_strided", D_SPLIT, "return x.view(B, L, E, H).permute(0, 3, 1, 2)", "ex1", "heads_mixed"),
    M("d", "merge_stack_interleaves", D_MERGE, "return torch.stack(pieces, dim=-1).flatten(-2)", "ex2",
      "heads_mixed"),
    M("d", "merge_reshape_no_loop", D_MERGE, "return x.reshape(x.shape[0], x.shape[2], -1)", "ex2", "heads_mixed"),
    M("d", "no_out_proj", "return concat @ W_O", "return concat", "ex3", "missing_out_proj"),
    M("d", "scale_by_model_size", D_SCORES3, "scores = q_h @ k_h.transpose(-2, -1) / math.sqrt(D)  # [B, L, L]",
      "ex3", "wrong_scale"),
    M("d", "no_scale", D_SCORES3, "scores = q_h @ k_h.transpose(-2, -1)  # [B, L, L]", "ex3", "missing_scale"),
    M("d", "keys_T", D_SCORES3, "scores = q_h @ k_h.T / math.sqrt(E)  # [B, L, L]", "ex3", "wrong_transpose"),
    M("d", "mask_inverted", D_FILL3, 'scores = scores.masked_fill(mask[:, h], float("-inf"))', "ex3",
      "mask_polarity"),
    M("d", "mask_after_softmax",
      "        if mask is not None:\n            " + D_FILL3 + "\n        weights = softmax_last(scores)\n",
      "        weights = softmax_last(scores)\n        if mask is not None:\n"
      "            weights = weights.masked_fill(~mask[:, h], 0.0)\n", "ex3", "mask_after_softmax"),
    M("d", "mask_fill_not_assigned", D_FILL3, 'scores.masked_fill(~mask[:, h], float("-inf"))', "ex3",
      "mask_ignored"),
    M("d", "values_from_W_K", "V = x @ W_V", "V = x @ W_K", "ex3", "value_swapped"),
    M("d", "k_v_projections_swapped", "K = x @ W_K", "K = x @ W_V", "ex3", "order", ("V = x @ W_V", "V = x @ W_K")),
    M("d", "softmax_over_queries", "weights = softmax_last(scores)",
      "weights = softmax_last(scores.transpose(-2, -1)).transpose(-2, -1)", "ex3", "softmax_dim"),
    M("d", "repeat_modulo", D_G, "g = h % Hkv", "ex4", "gqa_group_mapping"),
    M("d", "repeat_cats_whole_kv", "return torch.cat(heads, dim=1)", "return torch.cat([kv] * groups, dim=1)", "ex4",
      "gqa_group_mapping"),
    M("d", "gqa_head_modulo", D_KH, "k_h = k[..., h % Hkv, :, :]", "ex5", "gqa_group_mapping",
      (D_VH, "v_h = v[..., h % Hkv, :, :]")),
    M("d", "gqa_no_scale", D_SCORES5, "scores = q_h @ k_h.transpose(-2, -1)\n        outs", "ex5", "missing_scale"),
    M("d", "gqa_scale_by_Ev", "E = q.shape[-1]", "E = v.shape[-1]", "ex5", "wrong_scale"),
    M("d", "gqa_values_are_keys", D_OUT5, "outs.append(softmax_last(scores) @ k_h)", "ex5", "value_swapped"),
    M("d", "gqa_softmax_over_queries", D_OUT5,
      "outs.append(softmax_last(scores.transpose(-2, -1)).transpose(-2, -1) @ v_h)", "ex5", "softmax_dim"),
    M("d", "cache_appended_first", "keys = torch.cat([k_cache, k_new], dim=2)",
      "keys = torch.cat([k_new, k_cache], dim=2)", "ex6", "kv_cache_order",
      ("values = torch.cat([v_cache, v_new], dim=2)", "values = torch.cat([v_new, v_cache], dim=2)")),
    M("d", "cache_no_offset", D_QPOS, "q_pos = torch.arange(L, device=q.device)", "ex6", "causal_alignment"),
    M("d", "cache_offset_L", D_QPOS, "q_pos = L + torch.arange(L, device=q.device)", "ex6", "causal_alignment"),
    M("d", "cache_offset_on_keys_too", D_KPOS, "k_pos = P + torch.arange(P + L, device=q.device)", "ex6",
      "causal_alignment"),
    M("d", "cache_strict", D_ALLOWED, "allowed = k_pos[None, :] < q_pos[:, None]", "ex6", "off_by_one"),
    M("d", "cache_future", D_ALLOWED, "allowed = k_pos[None, :] >= q_pos[:, None]", "ex6", "causal_future"),
    M("d", "cache_mask_inverted", D_FILL6, 'scores = scores.masked_fill(allowed, float("-inf"))', "ex6",
      "mask_polarity"),
    M("d", "cache_no_mask", "    " + D_FILL6 + "\n", "", "ex6", "mask_ignored"),
    M("d", "cache_no_scale", "scores = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])",
      "scores = q @ keys.transpose(-2, -1)", "ex6", "missing_scale"),
    M("d", "cache_values_are_keys", "out = softmax_last(scores) @ values", "out = softmax_last(scores) @ keys", "ex6",
      "value_swapped"),
    M("d", "cache_returned_swapped", "return out, keys, values", "return out, values, keys", "ex6", "order"),
]

# issue 48: the "c" mistakes the grader did not name when its author wrote them, named since
C_RETURN = "return softmax_last(scores) @ values, keys, values"
MUTANTS += [
    M("c", "scale_by_head_count", "head_size = q.shape[-1]", "head_size = q.shape[1]", "ex3", "wrong_scale"),
    M("c", "times_sqrt_E", "q = q * head_size ** -0.5", "q = q * head_size ** 0.5", "ex3", "wrong_scale"),
    M("c", "split_before_chunk", "q, k, v = (split_heads(t, H) for t in (x @ W_QKV).chunk(3, dim=-1))",
      "q, k, v = split_heads(x @ W_QKV, H).chunk(3, dim=-1)", "ex3", "heads_mixed"),
    M("c", "mask_multiplied", 'scores = scores + bias.masked_fill(mask.logical_not(), float("-inf"))',
      "scores = scores * mask", "ex3", "mask_fill_zero"),  # the same numbers as a fill of 0
    M("c", "mask_after_softmax",
      "    if mask is not None:\n        bias = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)\n"
      '        scores = scores + bias.masked_fill(mask.logical_not(), float("-inf"))\n'
      "    heads = softmax_last(scores) @ v\n",
      "    weights = softmax_last(scores)\n    if mask is not None:\n"
      "        weights = weights.masked_fill(mask.logical_not(), 0.0)\n    heads = weights @ v\n",
      "ex3", "mask_after_softmax"),
    M("c", "repeat_divides_by_Hkv", "torch.arange(n_heads, device=kv.device) // groups",
      "torch.arange(n_heads, device=kv.device) // kv.shape[1]", "ex4", "gqa_group_mapping"),
    M("c", "cache_fill_zero", 'scores.masked_fill(future, float("-inf"))', "scores.masked_fill(future, 0.0)", "ex6",
      "mask_fill_zero"),
    M("c", "cache_no_scale", "scores = (q * q.shape[-1] ** -0.5) @ keys.mT", "scores = q @ keys.mT", "ex6",
      "missing_scale"),
    M("c", "cache_softmax_over_queries", C_RETURN, "return softmax_last(scores.mT).mT @ values, keys, values",
      "ex6", "softmax_dim"),
    M("c", "cache_values_are_keys", C_RETURN, "return softmax_last(scores) @ keys, keys, values", "ex6",
      "value_swapped"),
    M("c", "cache_returns_v_k", C_RETURN, "return softmax_last(scores) @ values, values, keys", "ex6", "order"),
    M("c", "cache_returns_old_caches", C_RETURN, "return softmax_last(scores) @ values, k_cache, v_cache", "ex6",
      "kv_cache_order"),
]
MUTANTS += [
    M("c", "mask_inverted_in_place", "mask.logical_not()", "mask.logical_not_()", "ex3", "mutates_input"),
    M("d", "split_transpose_before_view", "return x.view(B, L, H, E).transpose(1, 2)",
      "return x.transpose(1, 2).reshape(B, H, L, E)", "ex1", "heads_mixed"),
    M("d", "mask_fill_zero", 'masked_fill(~mask[:, h], float("-inf"))', "masked_fill(~mask[:, h], 0.0)", "ex3",
      "mask_fill_zero"),
    M("d", "heads_strided_slices", "q_h = Q[:, :, start:end]", "q_h = Q[:, :, h::H]", "ex3", "heads_mixed",
      ("k_h = K[:, :, start:end]", "k_h = K[:, :, h::H]"), ("v_h = V[:, :, start:end]", "v_h = V[:, :, h::H]")),
]
