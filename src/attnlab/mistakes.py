"""The named mistakes: one vocabulary for the doctor, the grader and every lab.

Each code names a mistake a learner or an engineer makes in attention code, with a hint
that says how to fix it. :mod:`attnlab.doctor` names the ones it can fit from probes
(:data:`DOCTOR_CODES`); the labs' checks (:mod:`attnlab.labs`) name these and
the ones that only a single exercise can see (``order``, ``off_by_one``, ...). Every
code either of them emits is a key of :data:`CODES` (a test walks the checks' source to
hold them to it), so a class report can count mistakes across labs by one name.
"""

from __future__ import annotations

__all__ = ["CODES", "DOCTOR_CODES", "BACKWARD_CODES", "hint", "as_markdown"]

CODES: dict[str, str] = {
    # the scores
    "missing_scale": "the scores are not scaled: multiply Q @ K^T by 1/sqrt(d_k) (E, the query size), "
                     "or the weights come out too peaked",
    "wrong_scale": "the scores are scaled by the wrong factor: the default is 1/sqrt(E) with E the "
                   "query/key size, and an explicit `scale` argument replaces it",
    "wrong_transpose": "the scores need Q @ K^T over the last two dims: use K.transpose(-2, -1) "
                       "(K.T reverses every dim of a 3-D or 4-D tensor)",
    # the softmax
    "unstable_softmax": "softmax overflows on large scores: subtract each row's maximum before exp",
    "softmax_dim": "softmax normalises the wrong axis: each query's row over the keys (dim=-1) must sum to 1",
    "keepdim": "a reduction along a dim (sum, max, amax) drops that dim, so the result no longer broadcasts against "
               "the scores: pass keepdim=True (x.sum(dim=dim, keepdim=True))",
    "fully_masked_nan": "a row whose keys are all masked must give 0, not NaN (or an average): "
                        "zero the weights of rows with no key left",
    # the values
    "value_swapped": "the weights must multiply V: Q or K is used where V belongs",
    "order": "the results come back in the wrong order, or two inputs are swapped: return them, and use them, "
             "in the order the signature says",
    # masks
    "mask_polarity": "the bool mask is inverted: True means 'attend', so fill -inf where the mask is False",
    "mask_dtype": "a mask must be a bool tensor (True = attend): a float 0/1 mask is *added* to the scores by SDPA, "
                  "so build it with dtype=torch.bool",
    "mask_ignored": "the mask (or is_causal) has no effect on the output: apply it to the scores, as -inf where it "
                    "is False, before the softmax",
    "mask_after_softmax": "the mask is applied after softmax: mask the scores with -inf before softmax, "
                          "so each row still sums to 1",
    "mask_fill_zero": "masked scores are set to 0, which still gets weight after softmax: fill with -inf",
    "mask_fill_finite": "masked scores use a large finite number: use float('-inf'), so masked keys get exactly "
                        "0 weight and fully masked rows can be detected",
    "mask_multiplied": "the scores are multiplied by the mask: masking means -inf where the mask is False, not 0",
    "off_by_one": "a boundary is off by one: a sequence of length n has positions 0..n-1 (use <, not <=), and a "
                  "causal mask keeps its diagonal (query i sees key i: tril(), not tril(-1) or tril(1))",
    "causal_future": "the causal mask looks the wrong way: query i may see keys j <= i (the past, tril()), not "
                     "j >= i (triu())",
    "causal_alignment": "the causal mask is aligned to the wrong corner: with is_causal=True query i sees keys 0..i "
                        "(top-left, torch.ones(L, S).tril()), also when L != S; the L new queries of a KV "
                        "cache of S keys see 0..i + S - L (bottom-right, tril(S - L))",
    "padding_query_side": "the padding mask hides padded queries instead of padded keys: padding is a mask "
                          "over the keys, shape [B, 1, 1, S], so no real query attends to a padding token",
    "mask_combined_or": "masks are combined with |: a key is visible only where every mask allows it, "
                        "so combine them with &",
    # heads, groups, caches
    "heads_mixed": "the heads are split or merged by a reshape without the transpose, so each head mixes "
                   "positions: [B, L, D] -> view [B, L, H, E] -> transpose(1, 2), and back the same way",
    "missing_out_proj": "the output projection is missing: after merging the heads, multiply by W_O",
    "gqa_group_mapping": "query head h must use key/value head h // (H / Hkv): repeat each key/value head in "
                         "place (repeat_interleave), not tile them (repeat)",
    "kv_cache_order": "the new keys and values go after the cached ones: torch.cat([cache, new], dim=2)",
    # FlashAttention: the online softmax, the tiles, the backward
    "online_rescale": "when a block raises the running max m_i, what was summed under the old max (l_i, and "
                      "acc) must be multiplied by exp(m_old - m_new) before the block's terms are added",
    "final_divide": "the online softmax sums unnormalised weights: divide once at the end, each row's acc by its "
                    "own l_i (o = acc / l_i[..., None]), not never and not by anything else",
    "lse_saved": "the forward must return the natural log-sum-exp of each query row's scaled scores, "
                 "lse = m_i + log(l_i) (torch.log, not log2; one per row, [B, H, L]): the backward rebuilds "
                 "P = exp(scores - lse) from it",
    "causal_block_skip": "under is_causal, skip only the key blocks wholly after the query block, and mask "
                         "inside the diagonal block (key j > query i gets -inf); skipping the diagonal block or "
                         "leaving it unmasked changes the answer",
    "backward_scale": "the backward needs the softmax scale where the forward used it: P = exp(scale * Q K^T - lse), "
                      "dQ = dS @ K * scale and dK = dS^T @ Q * scale (dV = P^T dO has none)",
    "backward_d_term": "dS = P * (dP - D) with D = rowsum(dO * O) per query row: without the D term the "
                       "gradients of Q and K are wrong (dV is not affected)",
    "softmax_backward": "the softmax's backward multiplies by P: dS = P * (dP - D), elementwise; dS = dP - D gives "
                        "every masked and unlikely key a gradient",
    "backward_accumulate": "a gradient tile is assigned where it must be accumulated: dQ sums over the key tiles, "
                           "dK and dV over the query tiles (and the group's heads), so write dq += ..., with the "
                           "accumulator zeroed once per output tile",
    "backward_p": "the backward rebuilds P = exp(scale * Q K^T - lse) from the forward's saved lse, one per query "
                  "row: not from a tile's own max, not exp(S) / lse, and with lse in the scores' units",
    "backward_operand": "each product of the backward has its own operands: dP = dO V^T, dV = P^T dO, dQ = scale * "
                        "dS K, dK = scale * dS^T Q; another tensor of the same shape gives plausible numbers",
    "stale_tile": "a pointer or offset is not advanced in its loop, so every tile reads the first tile's values: "
                  "step it with the loop (ptr += BK * stride, or index by the loop variable)",
    "exp_base": "exp and exp2 are mixed: exp2(x) = exp(x * ln 2), so a base-2 kernel folds log2(e) into its scores "
                "(and its lse) and uses exp2 throughout, a natural one uses exp throughout",
    "backward_mask": "the backward must apply the forward's mask where it recomputes P = exp(S - lse): the same "
                     "attn_mask and the same causal corner (top-left for is_causal), or masked keys get gradients",
    "gqa_grad_sum": "with grouped heads each key/value head serves H / Hkv query heads: its dK and dV are the sum "
                    "over that group (reshape (B, Hkv, r, S, E) and .sum(2)), not one head's, not the mean",
    "sink_grad": "a sink joins each row's softmax denominator: the backward's lse must include it, and "
                 "d sink_h = -sum over the rows of p_sink * D with p_sink = exp(sink_h - lse) and "
                 "D = rowsum(dO * O): a sum over batch and rows, negative, never dropped",
    "low_precision": "a product runs at less precision than its float32 inputs (TF32, tl.dot's default and "
                     "torch.backends.cuda.matmul.allow_tf32; or operands cast to bf16/fp16): pass "
                     "input_precision='ieee' to tl.dot, or keep float32 operands, where float32 is asked",
    "grad_missing": "no gradient reaches an input that needs one: a .detach(), .data, torch.no_grad() or a "
                    "custom Function's backward returning None (or zeros) for it",
    "grad_test_blind": "this gradient test cannot fail: its loss makes every gradient smaller than its tolerance "
                       "(out.mean() over many elements). Compare with a random cotangent, "
                       "loss = (out * torch.randn_like(out)).sum(), against a float64 reference, with a tolerance "
                       "from torch's own error (attnlab.testing.assert_close_to_sdpa does this)",
    # GPU kernels (lab 05, Triton)
    "load_mask": "a tile that runs past the end of L or S reads memory that is not the tensor's: load with "
                 "mask= and other=0.0 (rows < L, keys < S), store with mask=, and give keys past S a score of "
                 "-inf so they get no weight",
    "store_mask": "a store past the end of a tensor writes memory that is not the tensor's (on a GPU another "
                  "tensor, or a fault; here the grader stops it): store with mask= (rows < L, keys < S), the same "
                  "mask as the tile's loads",
    "head_offset": "each program's pointers start at its own (batch, head): Q, O, dO, dQ + (b * H + h) * L * E, lse "
                   "and D + (b * H + h) * L, K, V, dK, dV + (b * Hkv + h // (H // Hkv)) * S * E; an offset with "
                   "another tensor's sizes (S for L, H for Hkv), without the batch, or at another head reads or "
                   "writes another head's rows",
    "wrong_strides": "a tile is read with the wrong strides: in a contiguous (.., N, E) tensor the element (row i, "
                     "column e) is at base + i * E + e (pass and use the tensor's strides when it may not be "
                     "contiguous); reading it as i + e * N loads its transpose",
    "tile_local_index": "masks and bounds compare global positions: rows = pid_q * BQ + tl.arange(0, BQ) and keys = "
                        "start + tl.arange(0, BK); tl.arange alone is the position inside the tile, the same in "
                        "every tile",
    "dropped_tile": "the last, partial tile is part of the loop: range(0, S, BK) (or tl.cdiv(S, BK) tiles) with its "
                    "keys past S masked; a floor (S // BK * BK) drops the keys of the partial tile",
    "accumulate_dtype": "accumulate in float32 (tl.zeros(..., tl.float32)), whatever the inputs' dtype: a float16 "
                        "or bfloat16 accumulator loses precision over the tiles and overflows past 65504 (float16); "
                        "cast once, when storing",
    "kernel_not_launched": "the answer came back but your @triton.jit kernel for this exercise never ran: the "
                           "points are for the kernel, so the given launcher must launch it on its grid and "
                           "its stores must make the answer",
    "scores_materialized": "an [L, S] tensor (the scores or the weights) is built or saved: tiled attention keeps "
                           "one [block_q, block_k] tile at a time and saves lse ([B, H, L]) for the backward",
    # reading the weights
    "wrong_axis": "row i of the weights belongs to query i: index [:, i, :], not a column",
    "batch_only": "the result must keep the batch dim: index every batch element, not only the first",
    # dropout
    "dropout_scale": "dropout must keep each weight with probability 1-p and scale the kept ones "
                     "by 1/(1-p), so the expected output is unchanged",
    "block_max": "the running max m_i is each row's own (a max over the keys, dim=-1): the max of a whole "
                 "block, over every row, is a shift the softmax allows, but a row far below the block's largest "
                 "score underflows to exp(...) = 0 and its m_i and lse are wrong",
    # whole-function symptoms and states
    "mutates_input": "the function changed a tensor its caller passed (an in-place op on an argument: "
                     "masked_fill_, -=, x[...] = ...): use the out-of-place form (masked_fill, x = x - m) so "
                     "the caller's scores are left as they were",
    "shape_error": "the function fails or returns the wrong shape on valid inputs: check broadcasting "
                   "over leading dims, L != S, and Ev != E",
    "not_implemented": "the exercise still raises NotImplementedError: replace the raise line with your code",
    "memory_limit": "the exercise allocated past its memory limit: something far larger than the answer is built "
                    "(an [L, S] or [B, H, L, S] intermediate where a tile will do, a broadcast that grew a dim by "
                    "accident, a list that keeps every step)",
    "policy": "the lab's rule refused a construct in your file, named above with its line: torch's softmax or "
              "SDPA, an import outside the lab's list (os, sys, numpy...), eval, exec or open, a private or dunder "
              "attribute, or a decorator or hook the lab does not allow; the file is not run until it is gone "
              "(each lab's rule says what its code is built from)",
    "cp_sinks": "under context parallelism each sink joins each row's softmax once: every rank's share of the "
                "row merges its log-sum-exp without the sink, and the sink is added once, after the merge (or by "
                "one rank only), never dropped and never once per rank",
    "cp_lse_merge": "partial results from the key/value shards merge by their log-sum-exps in one base: o = sum_j "
                    "exp(lse_j - lse) o_j with lse = logsumexp_j(lse_j), natural units throughout (a base-2 kernel "
                    "converts its lse before the merge)",
    "cp_causal_offset": "a shard's causal mask compares absolute positions: query rank r, row i is position "
                        "positions(r, W, n, layout)[i]; a mask built from the shard's own 0..n-1 hides or shows "
                        "the wrong keys of every other shard",
    "cp_layout": "the positions a rank holds follow its layout: zigzag gives rank r chunks r and 2W - 1 - r "
                 "(attnlab.distributed.positions); a mask or merge that takes the shards in rank order treats "
                 "them as contiguous",
    "cp_missing_shard": "every rank's queries must meet every key/value shard they may see: a ring of W ranks "
                        "takes W steps (its own shard, then W - 1 received); one step short drops a shard",
    "cp_heads": "the heads a rank attends come back to the slots they left: Ulysses scatters heads in contiguous "
                "groups (rank r: heads r*H/W .. (r+1)*H/W - 1) and gathers them the same way",
    "cp_grad_reduce": "a key/value shard's gradient sums over every rank's queries: the contributions computed on "
                      "other ranks travel back (the ring's dK/dV pass on, a gather's backward reduces); only the "
                      "local queries' share is missing the rest",
    "unknown": "the output differs from SDPA in a way the doctor has no model for",
}

# what the doctor can name from its probes (each has at least two buggy implementations in its tests)
DOCTOR_CODES = ("missing_scale", "wrong_scale", "unstable_softmax", "softmax_dim", "wrong_transpose",
                "value_swapped", "mask_polarity", "mask_after_softmax", "mask_fill_zero", "mask_fill_finite",
                "mask_ignored", "causal_alignment", "causal_future", "off_by_one", "fully_masked_nan",
                "gqa_group_mapping", "dropout_scale", "shape_error", "unknown")

# what `attnlab doctor --backward` (attnlab.doctor.diagnose_backward) and `--grad-test` name; each is
# named on the backward corpus (tests/corpus/backward.py) by tests/core/test_doctor_backward.py
BACKWARD_CODES = ("grad_missing", "gqa_group_mapping", "gqa_grad_sum", "lse_saved", "backward_scale",
                  "softmax_backward", "backward_d_term", "backward_mask", "sink_grad", "low_precision",
                  "grad_test_blind", "shape_error", "unknown")

# what `attnlab doctor --context-parallel` (attnlab.doctor.diagnose_context_parallel) names; each is named on a
# planted fault (tests/helpers/cp_faults.py) by tests/distributed/test_cp_doctor.py
CP_CODES = ("cp_sinks", "cp_lse_merge", "cp_causal_offset", "cp_layout", "cp_missing_shard", "cp_heads",
            "cp_grad_reduce", "unknown")


def hint(code: str) -> str:
    """The hint of a code; a ``KeyError`` names the vocabulary when the code is not in it."""
    try:
        return CODES[code]
    except KeyError:
        raise KeyError(f"{code!r} is not a named mistake; the vocabulary is attnlab.mistakes.CODES: "
                       f"{sorted(CODES)}") from None


def as_markdown() -> str:
    """The vocabulary as the documentation's page (``docs/mistakes.md``, which a test holds equal
    to this): each code, whether the doctor names it, and its hint."""
    def named(code: str) -> str:
        return ", ".join(w for w, codes in (("forward", DOCTOR_CODES), ("backward", BACKWARD_CODES),
                                             ("context parallel", CP_CODES)) if code in codes)

    rows = [f"| `{code}` | {named(code)} | {text.replace('|', '&#124;')} |" for code, text in CODES.items()]
    return ("# Named mistakes\n\n"
            "One vocabulary for the grader's checks in every lab and for the doctor "
            "(`attnlab.mistakes.CODES`): a failed check that recognises a mistake prints `-> [code]` and "
            "this hint, and the class report counts learners by code. The page is generated from the code "
            "(`python -m attnlab.mistakes > docs/mistakes.md`); a test keeps them equal.\n\n"
            "| code | the doctor names it (`attnlab doctor`, `--backward`, `--context-parallel`) | hint |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":  # python -m attnlab.mistakes > docs/mistakes.md
    print(as_markdown(), end="")
