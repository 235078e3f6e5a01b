"""The backward corpus: attention kernels whose BACKWARD is wrong, each rebuilt from a public report,
and correct ones, for the attention doctor to name (or to clear); and engineers' gradient tests,
blind or sound.

Every kernel has torch SDPA's signature plus ``sinks`` (:mod:`corpus.backward_kernels` holds them)::

    fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, sinks=None)

``CASES``: :class:`Case` (``expected`` = the code the doctor should name, ``None`` for a correct kernel).
``GRAD_TESTS``: :class:`GradTest` (``expected`` = ``"grad_test_blind"`` or ``None`` for a sound test).

Run ``PYTHONPATH=src:tests python tests/corpus/backward.py`` for the self-check: every kernel against a
float64 reference of its own, forward and gradients, on small inputs with and without a causal mask,
a bool mask, grouped heads and sinks; and every gradient test run against the corpus at its own shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

try:
    from corpus.backward_kernels import BUGGY, CORRECT
except ImportError:  # run as a script from tests/corpus
    from backward_kernels import BUGGY, CORRECT


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable               # the kernel, SDPA's signature plus sinks
    expected: Optional[str]    # the code the doctor should name, or None for a correct kernel
    source: str                # the public report it is rebuilt from (URL) or "correct"
    note: str                  # one line: what the mistake is, as the report describes it


@dataclass(frozen=True)
class GradTest:                # an engineer's gradient TEST, not a kernel
    name: str
    loss: Callable             # loss(out) -> scalar tensor, as their test reduces the output
    atol: float
    rtol: float
    shape: tuple               # (B, H, L, E) their test uses (S = L, Ev = E)
    expected: Optional[str]    # "grad_test_blind" or None
    source: str
    note: str


GH = "https://github.com/"
TRITON_7216 = GH + "triton-lang/triton/issues/7216"
TRITON_4541 = GH + "triton-lang/triton/issues/4541"
TRITON_5660 = GH + "triton-lang/triton/issues/5660"
TRITON_919 = GH + "triton-lang/triton/issues/919"
TRITON_1934 = GH + "triton-lang/triton/issues/1934"
FFPA_300 = GH + "xlite-dev/ffpa-attn/pull/300"
LEVANTER_449 = GH + "marin-community/levanter/pull/449"
NSA_27 = GH + "XunhaoLai/native-sparse-attention-triton/issues/27"
FA_2651 = GH + "Dao-AILab/flash-attention/issues/2651"
V100_11 = GH + "ai-bond/flash-attention-v100/pull/11"
FASTVIDEO_1730 = GH + "hao-ai-lab/FastVideo/pull/1730"
FSA_109 = GH + "HKUSTDial/flash-sparse-attention/pull/109"
SSD_203 = GH + "amdegroot/ssd.pytorch/issues/203"
TE_3551 = GH + "NVIDIA/TransformerEngine/pull/3551"
FA_1973 = GH + "Dao-AILab/flash-attention/issues/1973"
FA_2102 = GH + "Dao-AILab/flash-attention/issues/2102"
AITER_1576 = GH + "ROCm/aiter/pull/1576"
AITER_2321 = GH + "ROCm/aiter/pull/2321"
EVIN_6 = GH + "evintunador/triton_docs_tutorials/issues/6"
GYM_200 = GH + "meta-pytorch/attention-gym/pull/200"
VLLM_FA_34 = GH + "vllm-project/flash-attention/pull/34"
APRENDER_2203 = GH + "paiml/aprender/pull/2203"
MEGATRON_205 = GH + "ISEEKYAN/Megatron-LM/pull/205"
FA_1908 = GH + "Dao-AILab/flash-attention/pull/1908"
OPENFOLD3_258 = GH + "aqlaboratory/openfold-3/pull/258"
FA_2706 = GH + "Dao-AILab/flash-attention/pull/2706"
FA_1909 = GH + "Dao-AILab/flash-attention/issues/1909"
MNEMOSYNE_987 = GH + "HomericIntelligence/Mnemosyne/pull/987"


def _bug(name: str, code: str, source: str, note: str) -> Case:
    return Case(name, BUGGY[name], code, source, note)


def _ok(name: str, note: str) -> Case:
    return Case(name, CORRECT[name], None, "correct", note)


CASES: list[Case] = [
    # backward_scale (6)
    _bug("ds_unscaled", "backward_scale", V100_11,
         "dS = exp(S - lse) * (dOV - row_dot) needs * scale: without it dQ and dK both miss the softmax scale"),
    _bug("dk_unscaled", "backward_scale", FA_2651,
         "softmax_scale lost on the way to the dK scaling: dK = dS^T Q unscaled while dQ keeps the scale"),
    _bug("dq_unscaled", "backward_scale", V100_11,
         "the backward dQ kernel reviewed for its scale: dQ = dS K without the scale (dK scaled)"),
    _bug("dq_scale_twice", "backward_scale", FASTVIDEO_1730,
         "K pre-scaled by sm_scale for the backward's logit recompute, then dQ = scale * dS K_scaled: scale^2"),
    _bug("p_unscaled", "backward_scale", FASTVIDEO_1730,
         "the backward's logit recompute scaled differently from the forward: P = exp(Q K^T - lse), no scale"),
    _bug("dv_scaled", "backward_scale", TRITON_919,
         "the scale folded into the backward's P/dS lands on dV too: dV = scale * P^T dO"),
    # backward_d_term (3), softmax_backward (1)
    _bug("d_missing", "backward_d_term", TRITON_919,
         "D (Delta, rowsum(dO*O)) is computed by the preprocess but dS = P * dP never subtracts it"),
    _bug("d_rowsum_do", "backward_d_term", TRITON_1934,
         "the _bwd_preprocess Delta computed as rowsum(dO) without O"),
    _bug("d_detached_lse", "backward_d_term", SSD_203,
         "plain autograd: the log-sum-exp detached like the max (x.data.max()), dropping D from the gradient"),
    _bug("softmax_no_p", "softmax_backward", FSA_109,
         "the pointwise dS = p * (dp - d) changed: dS = dP - D, not multiplied by P"),
    # issue 62's doctor misses: variants of the reports named, each once missed by the models
    _bug("softmax_saved_p_unmasked", "softmax_backward", FSA_109,
         "the same dS = dP - D with P saved from the forward: masked keys (P = 0) get dP - D too"),
    _bug("scale_recomputed", "backward_scale", FASTVIDEO_1730,
         "the backward recomputes softmax_scale = 1/sqrt(E) where the forward honoured the caller's scale="),
    _bug("gqa_fold_repeat", "gqa_group_mapping", NSA_27,
         "dK/dV folded over the group with repeat's layout (h -> h % Hkv); the forward used repeat_interleave"),
    _bug("sink_full_lse_p_keys", "sink_grad", FA_2102,
         "P recomputed with the keys' lse (the sink left out) while the sink's gradient uses the full lse"),
    # backward_mask (4)
    _bug("mask_causal_dropped", "backward_mask", TRITON_7216,
         "the backward rebuilds P = exp(S - lse) without ever applying the causal mask"),
    _bug("mask_bool_dropped", "backward_mask", TRITON_4541,
         "the backward ignores a mask the forward applied (ctx.causal there; the bool attn_mask here)"),
    _bug("mask_bottom_right", "backward_mask", FFPA_300,
         "the backward's causal mask is aligned bottom-right (j <= i + S - L), the forward's top-left"),
    _bug("mask_always_causal", "backward_mask", TRITON_5660,
         "the backward masks causally also when causal=False: gradients far off with causal=False only"),
    # gqa_grad_sum (2), gqa_group_mapping (1)
    _bug("gqa_first_head", "gqa_grad_sum", LEVANTER_449,
         "K, V broadcast over the group in the forward, never un-broadcast: dK/dV from one query head"),
    _bug("gqa_mean", "gqa_grad_sum", LEVANTER_449,
         "dK/dV reduced over the group's query heads by a mean; the gradient of a broadcast is a sum"),
    _bug("gqa_modulo", "gqa_group_mapping", NSA_27,
         "backward_dkdv splits the query head index with % where the forward used //: h % Hkv for h // g"),
    # lse_saved (2)
    _bug("lse_base2", "lse_saved", GYM_200,
         "the forward keeps the lse in log2 units (m*log2e + log2 l); the backward reads it as natural"),
    _bug("lse_max_only", "lse_saved", VLLM_FA_34,
         "softmax_lse fix: the forward saved the row max m for the lse, not m + log l"),
    # sink_grad (5)
    _bug("sink_zero", "sink_grad", TE_3551, "the sink's gradient came back as an exact zero"),
    _bug("sink_sign", "sink_grad", FA_1973,
         "the learnable sink's gradient not properly computed: + sum p_sink * D, the sign flipped"),
    _bug("sink_no_psink", "sink_grad", AITER_2321,
         "d_sink accumulated as -sum D over the rows, without the sink's probability p_sink"),
    _bug("sink_mean", "sink_grad", AITER_1576,
         "the sink's gradient must be a sum reduction per query head; here it is a mean over the rows"),
    _bug("sink_lse_keys", "sink_grad", FA_2102,
         "only the forward has the sink; the backward recomputes P with the lse of the keys alone"),
    # low_precision (2)
    _bug("tf32_backward", "low_precision", EVIN_6,
         "fp32 tl.dot defaults to TF32: forward test passes, backward fails (10-bit mantissa operands)"),
    _bug("bf16_backward", "low_precision", FASTVIDEO_1730,
         "bf16 rounding inside the backward: P and dS rounded to bfloat16 before their matmuls"),
    # grad_missing (2)
    _bug("key_detached", "grad_missing", APRENDER_2203,
         "the attention graph severed at K (plain autograd): no gradient reaches key"),
    _bug("value_grad_none", "grad_missing", MEGATRON_205,
         "the Function's backward returns None in an input's slot (value here) though it computed it"),
    # correct (10)
    _ok("torch_sdpa", "torch.nn.functional.scaled_dot_product_attention; sinks refused (ValueError)"),
    _ok("torch_sdpa_sink_key", "torch's SDPA, the sink as a zero key/value whose logit a float mask sets"),
    _ok("attnlab_functional", "attnlab.functional.scaled_dot_product_attention; dropout refused"),
    _ok("attnlab_tiled", "attnlab.tiled.flash_attention wrapped to SDPA's signature; dropout refused"),
    _ok("attnlab_dispatch", "attnlab.dispatch.attention; dropout refused"),
    _ok("einsum_attention", "plain autograd in grouped einsums, the sink a softmax column"),
    _ok("chunked_attention", "plain autograd over key chunks with an online softmax, the max detached"),
    _ok("fa2_matrix", "custom Function: FA2's backward on whole matrices, GQA sums and the sink's gradient"),
    _ok("fa2_tiled", "custom Function: online-softmax forward, FA2's backward looped over key blocks"),
    _ok("fa2_einsum", "custom Function: FA2's backward in grouped einsums"),
]


# --------------------------------------------------------------------------- engineers' gradient tests


def _mean(out):
    return out.mean()


def _sum(out):
    return out.sum()


def _cotangent(shape: tuple, seed: int) -> Callable:
    """loss(out) = (out * g).sum() with g a fixed standard-normal tensor of the test's shape (Ev = E)."""

    def loss(out):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"the test's cotangent has shape {shape}, the output {tuple(out.shape)}")
        return (out * g.to(out.device, out.dtype)).sum()

    return loss


# The numbers in the notes are measured by the self-check below (inputs: standard normal q, k, v, S = L,
# seed 1; errors against a float64 reference): "caught" counts the corpus's mistakes that need no mask,
# grouped heads or sinks (17 of them) and that the test fails on.
GRAD_TESTS: list[GradTest] = [
    GradTest("mean_1024", _mean, 1e-5, 1.3e-6, (1, 8, 1024, 64), "grad_test_blind", OPENFOLD3_258,
             "out.mean() over 524288 outputs: every gradient <= 3.6e-6 < atol 1e-5, so a zero or absent gradient "
             "passes; D missing (off by 4.9e-7), dV scaled (2.6e-6), lse base 2 (3.5e-6), TF32 (1.8e-9) pass; "
             "only mistakes that inflate gradients several-fold fail (dS unscaled 2.5e-5, D = rowsum dO 1.5e-5, "
             "lse = max 2.1e-4, dS without P 9.8e-4; dQ unscaled 1.08e-5 just over): caught 7 of 17"),
    GradTest("mean_loose", _mean, 1e-3, 1e-3, (4, 16, 256, 64), "grad_test_blind", MNEMOSYNE_987,
             "out.mean() with atol 1e-3 loosened to pass: every gradient <= 2.7e-6, a thousandth of atol; dS "
             "unscaled is off by 1.9e-5, dS without P 1.9e-4, D missing 3.6e-7: all pass; only P without the "
             "scale (gradients overflowing to 3.7e9) fails: caught 1 of 17"),
    GradTest("cotangent_small", _cotangent((2, 4, 64, 32), 0), 1e-5, 1e-5, (2, 4, 64, 32), None, FA_2706,
             "(out * g).sum(), g a seeded randn of the output's shape: gradients up to 2.2; every mistake fails "
             "(smallest: TF32, off by 1.0e-3 = 78x its tolerance; D missing 5.9e-1), correct kernels use <= 0.08 "
             "of the tolerance: caught 17 of 17"),
    GradTest("sum_small", _sum, 1e-5, 1e-5, (1, 2, 16, 16), None, FA_1909,
             "out.sum() (dO = ones): no cancellation in attention's backward, gradients up to 2.0; every mistake "
             "fails (smallest: TF32, off by 1.2e-3 = 55x; D missing 8.8e-1), correct kernels <= 0.03 of the "
             "tolerance: caught 17 of 17"),
    GradTest("mean_scaled_tol", _mean, 1e-9, 1e-5, (1, 4, 128, 32), None, OPENFOLD3_258,
             "out.mean() again, but atol 1e-9 sits below the gradients (up to 1.5e-4): every mistake fails "
             "(smallest: TF32, off by 6.0e-8 = 37x; D missing 2.1e-5), correct kernels <= 0.04 of the "
             "tolerance: caught 17 of 17; the loss alone does not make a test blind"),
]


# --------------------------------------------------------------------------- the self-check


def reference(q, k, v, mask=None, causal=False, scale=None, sinks=None):
    """float64 attention through plain torch ops (autograd differentiates it)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, L, E = q.shape
    S, g = k.shape[-2], H // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (1.0 / math.sqrt(E) if scale is None else scale) * q @ k.transpose(-1, -2)
    keep = torch.ones(L, S, dtype=torch.bool).tril() if causal else mask
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, L, 1)], -1)
    return torch.softmax(s, -1)[..., :S] @ v


CONFIGS = {  # name: (Hkv, causal, mask, sinks, scale)
    "plain": (4, False, False, False, None),
    "causal": (4, True, False, False, None),
    "mask": (4, False, True, False, None),
    "gqa": (2, False, False, False, None),
    "sinks": (4, False, False, True, None),
    "gqa+causal+sinks": (2, True, False, True, 0.5),
    "gqa+mask+sinks": (2, False, True, True, None),
}
# the mistakes that need a feature must leave the plain config exact
CLEAN_ON_PLAIN = {"backward_mask", "gqa_grad_sum", "gqa_group_mapping", "sink_grad"}
CLEAN_EXCEPTIONS = {"mask_always_causal"}


def _inputs(config: str, seed: int = 0, B=1, H=4, L=6, S=9, E=8, Ev=5):
    Hkv, causal, use_mask, use_sinks, scale = CONFIGS[config]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen).requires_grad_()
               for shape in ((B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev)))
    mask = None
    if use_mask:
        mask = torch.rand(B, H, L, S, generator=gen) < 0.6
        mask[..., torch.arange(L), torch.arange(L) + 2] = True  # no row fully masked
    sinks = torch.randn(H, generator=gen).requires_grad_() if use_sinks else None
    kw = dict(attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=Hkv != H, sinks=sinks)
    ref_kw = dict(mask=mask, causal=causal, scale=scale, sinks=sinks)
    return (q, k, v), kw, ref_kw, torch.randn(B, H, L, Ev, generator=gen)


def _rel(a, b) -> float:
    a = torch.zeros_like(b) if a is None else a.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def run_case(fn, config: str):
    """(forward's relative error, the worst gradient's relative error) against :func:`reference`."""
    (q, k, v), kw, ref_kw, cot = _inputs(config)
    out = fn(q, k, v, **kw)
    wrt = [q, k, v] + ([kw["sinks"]] if kw["sinks"] is not None else [])
    grads = torch.autograd.grad(out, wrt, cot, allow_unused=True)
    ref = reference(q, k, v, **ref_kw)
    ref_grads = torch.autograd.grad(ref, wrt, cot.double())
    return _rel(out.detach(), ref.detach()), max(_rel(g, r) for g, r in zip(grads, ref_grads))


def self_check() -> bool:
    ok = True
    cols = list(CONFIGS)
    print(f"{'case':22s} {'expected':18s} {'fwd':>8s} " + " ".join(f"{c[:16]:>16s}" for c in cols) + "  verdict")
    for case in CASES:
        fwd_worst, grads = 0.0, {}
        for config in cols:
            try:
                fwd, grad = run_case(case.fn, config)
            except ValueError:  # a feature the kernel refuses, by name
                grads[config] = None
                continue
            fwd_worst, grads[config] = max(fwd_worst, fwd), grad
        ran = [g for g in grads.values() if g is not None]
        worst = max(ran)
        if case.expected is None:
            good = fwd_worst < 1e-5 and worst < 1e-5
        elif case.expected == "low_precision":
            good = fwd_worst < 1e-5 and 1e-5 < worst < 1e-2
        else:
            good = fwd_worst < 1e-5 and worst > 1e-3
        if case.expected in CLEAN_ON_PLAIN and case.name not in CLEAN_EXCEPTIONS:
            good = good and grads["plain"] is not None and grads["plain"] < 1e-5
        good = good and len(ran) >= 4  # plain, causal, mask and gqa at least
        ok = ok and good
        cells = " ".join(f"{'refused':>16s}" if grads[c] is None else f"{grads[c]:16.1e}" for c in cols)
        print(f"{case.name:22s} {str(case.expected):18s} {fwd_worst:8.1e} {cells}  {'ok' if good else 'FAIL'}")
    return ok


def _test_grads(fn, test: GradTest, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    grads = torch.autograd.grad(test.loss(fn(q, k, v)), [q, k, v], allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))]


def check_grad_tests() -> bool:
    """Each test run against the corpus at its shape: a blind one has every gradient under atol and passes
    a zero gradient and D missing; a sound one fails every mistake that needs no feature and passes every
    correct kernel."""
    ok = True
    needs_feature = {c.name for c in CASES
                     if c.expected in CLEAN_ON_PLAIN and c.name not in CLEAN_EXCEPTIONS}
    mistakes = [c for c in CASES if c.expected is not None and c.name not in needs_feature]
    correct = [c for c in CASES if c.expected is None]
    print(f"\n{'grad test':16s} {'expected':16s} {'max|grad|':>10s} {'atol':>8s}  caught  correct pass  verdict")
    for test in GRAD_TESTS:
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(*test.shape, generator=gen) for _ in range(3))
        ref = _test_grads(lambda a, b, c: reference(a, b, c), test, q.double(), k.double(), v.double())

        def fails(fn) -> bool:
            return any(bool(((g.double() - r).abs() > test.atol + test.rtol * r.abs()).any())
                       for g, r in zip(_test_grads(fn, test, q, k, v), ref))

        caught = [c.name for c in mistakes if fails(c.fn)]
        passed = [c.name for c in correct if not fails(c.fn)]
        biggest = max(float(r.abs().max()) for r in ref)
        if test.expected == "grad_test_blind":
            good = biggest < test.atol and "d_missing" not in caught and len(passed) == len(correct)
        else:
            good = len(caught) == len(mistakes) and len(passed) == len(correct)
        ok = ok and good
        print(f"{test.name:16s} {str(test.expected):16s} {biggest:10.1e} {test.atol:8.0e}  "
              f"{len(caught):2d}/{len(mistakes)}   {len(passed):2d}/{len(correct)}        {'ok' if good else 'FAIL'}"
              + (f"   caught: {', '.join(caught)}" if test.expected else ""))
    return ok


if __name__ == "__main__":
    import sys

    cases_ok = self_check()
    tests_ok = check_grad_tests()
    sys.exit(0 if cases_ok and tests_ok else 1)
